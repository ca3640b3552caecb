"""What one load-test run sends: the same Workload against every endpoint makes runs comparable."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kimi_eagle.loadtest.prompts import Api, PromptLine


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(description="Server base URL without /v1, e.g. http://127.0.0.1:8000.")
    engine: str = Field("vllm", description="Engine kind behind the URL (a key of loadtest.engines.ENGINES).")
    model: str | None = Field(None, description="Model name to request; None = the first of GET /v1/models.")
    api: Api = Field("completions", description="OpenAI API: `completions` or `chat`.")
    stream: bool = Field(True, description="Stream the response (SSE); TTFT and ITL need it.")
    prompts: str | None = Field(None, description="Shipped prompt set or JSONL path; None = `<api>-short`.")
    max_tokens: int = Field(64, ge=1, description="Output length asked for each request.")
    ignore_eos: bool = Field(True, description="Generate exactly max_tokens tokens (comparable runs).")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature; greedy (0) by default.")
    seed: int = Field(0, description="Picks the prompt order (and the open-loop arrival times).")
    ttft_limit_ms: float | None = Field(None, gt=0, description="Goodput: a good request's TTFT is at most this.")
    tpot_limit_ms: float | None = Field(None, gt=0, description="Goodput: a good request's TPOT is at most this.")
    request_rate_per_s: float | None = Field(
        None, gt=0, description="Open loop: Poisson arrivals at this total rate; None = closed loop (one request "
                                "in flight per user).")
    logprob_token_counts: bool = Field(
        False, description="Also ask for logprobs (one entry per token) to count tokens per chunk, for servers "
                           "that send no per-chunk usage; it costs the server some work, so both sides of an A/B "
                           "get it or neither.")
    request_timeout_s: float = Field(600.0, gt=0, description="Give up on one request after this long.")

    @model_validator(mode="after")
    def _defaults(self) -> Workload:
        self.url = self.url.rstrip("/").removesuffix("/v1")
        if self.prompts is None:
            self.prompts = f"{'chat' if self.api == 'chat' else 'completion'}-short"
        return self

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    def request_body(self, prompt: PromptLine, model: str, extras: dict[str, Any]) -> dict[str, Any]:
        """The JSON body of one request. `extras` are the engine's own fields (see engines.EngineReader)."""
        body: dict[str, Any] = {"model": model, **prompt.request_fields(self.api), "max_tokens": self.max_tokens,
                                "temperature": self.temperature, "ignore_eos": self.ignore_eos,
                                "stream": self.stream}
        if self.stream:
            # Cumulative usage on every chunk: the exact number of tokens each chunk carries, which under
            # speculative decoding is often more than one.
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
            if self.logprob_token_counts:
                body.update({"logprobs": True, "top_logprobs": 0} if self.api == "chat" else {"logprobs": 0})
        body.update(extras)
        return body
