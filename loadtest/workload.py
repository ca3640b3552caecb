"""What one load-test run sends: the same Workload against every endpoint makes runs comparable."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

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


# --- The workload on command lines: one table, every parser and argv made from it ------------------------------------
# `kimi-eagle loadtest` / `ab` and Locust's own parser (our locustfile's options: its web UI, its workers) take the
# same flags; the runner writes them back from a Workload. The URL, the engine and the request rate are each
# command's own (a sweep, a side of an A/B, Locust's --host).


@dataclass(frozen=True)
class Option:
    field: str
    flag: str
    help: str
    negated: bool = False  # a field that is on by default, switched off by the flag (--no-stream)


OPTIONS = (
    Option("model", "--model", "model name (default: the first of /v1/models)"),
    Option("api", "--api", "OpenAI API: completions or chat"),
    Option("stream", "--no-stream", "do not stream (then no TTFT/ITL)", negated=True),
    Option("prompts", "--prompts", "shipped prompt set or a JSONL file (default <api>-short)"),
    Option("max_tokens", "--max-tokens", "output tokens per request (default 64)"),
    Option("ignore_eos", "--no-ignore-eos", "let requests stop at EOS (lengths then vary)", negated=True),
    Option("logprob_token_counts", "--logprob-token-counts",
           "count tokens per chunk from logprobs, for servers that send no per-chunk usage"),
    Option("temperature", "--temperature", "sampling temperature (default 0: greedy)"),
    Option("seed", "--seed", "seed of the prompt order"),
    Option("ttft_limit_ms", "--ttft-limit-ms", "goodput: TTFT limit"),
    Option("tpot_limit_ms", "--tpot-limit-ms", "goodput: TPOT limit"),
)


def _value_type(field: str) -> type:
    annotation = Workload.model_fields[field].annotation
    if get_origin(annotation) is Literal:
        return str
    return next((t for t in get_args(annotation) if t is not type(None)), annotation)  # X | None -> X


def add_workload_options(parser: Any, *, unset: Literal["none", "empty"] = "none") -> None:
    """The workload's flags in an argparse (or Locust) parser, with Workload's defaults. With `unset="empty"` an
    optional field that is not given reads "" or 0 instead of None (Locust's web UI shows every default in a form)."""
    for option in OPTIONS:
        info = Workload.model_fields[option.field]
        kind = _value_type(option.field)
        if kind is bool:
            parser.add_argument(option.flag, action="store_true", default=False, help=option.help)
            continue
        default = info.default
        if default is None and unset == "empty":
            default = kind()
        choices = get_args(info.annotation) if get_origin(info.annotation) is Literal else None
        parser.add_argument(option.flag, type=kind, default=default, choices=choices, help=option.help)


def workload_from_options(options: Any, *, url: str, engine: str, request_rate_per_s: float | None) -> Workload:
    """The Workload a parsed command line asks for (from either kind of parser)."""
    values: dict[str, Any] = {}
    for option in OPTIONS:
        value = getattr(options, option.flag.removeprefix("--").replace("-", "_"))
        if option.negated:
            value = not value
        elif Workload.model_fields[option.field].default is None:
            value = value or None  # "" and 0 from Locust's form mean "not given"
        values[option.field] = value
    return Workload(url=url, engine=engine, request_rate_per_s=request_rate_per_s, **values)


def workload_argv(workload: Workload) -> list[str]:
    """The flags that make `workload_from_options` give this workload back (what the runner passes to Locust)."""
    argv: list[str] = []
    for option in OPTIONS:
        value = getattr(workload, option.field)
        if isinstance(value, bool):
            argv += [option.flag] if value != option.negated else []
        elif value is not None:
            argv += [option.flag, str(value)]
    return argv
