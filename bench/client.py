"""The benchmark's own minimal client: greedy, fixed-length completions from a pool of threads.

Non-streamed by default: the server then does the least work per token outside the engine, and the client parses
one JSON body per request, so tokens/s measures the engine. Streamed (`stream=True`) it reads the server-sent
events as every chat client does, still with little work of its own (Locust costs this 2-core machine a share of a
core). Tokens are counted from the server's `usage`, never from the text.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import requests

from kimi_eagle.acceptance import Acceptance
from kimi_eagle.loadtest.engines import api_key_from_env, auth_headers, get_engine


class BenchRequestError(RuntimeError):
    """A request failed or came back short: a benchmark on partial outputs would be wrong, so it stops."""


@dataclass
class Sample:
    """One timed measurement: `requests` completions sent through `concurrency` workers."""

    concurrency: int
    requests: int
    completion_tokens: int
    seconds: float
    client_cpu_s: float  # CPU time of this whole process (all client threads) while the sample ran
    token_ids: list[list[int]]
    acceptance: Acceptance | None = None
    prompt_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)  # each request's, sent to answered

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds


class Completion(NamedTuple):
    completion_tokens: int
    token_ids: list[int]
    prompt_tokens: int
    latency_s: float


class BenchClient:
    def __init__(self, url: str, model: str, max_tokens: int, timeout_s: float = 600.0, *,
                 stream: bool = False, temperature: float = 0.0) -> None:
        self.url, self.model, self.max_tokens, self.timeout_s = url, model, max_tokens, timeout_s
        self.stream, self.temperature = stream, temperature
        self._local = threading.local()
        self._engine = get_engine("vllm", url)
        # `kimi-eagle serve` protects the server with VLLM_API_KEY from the environment, on loopback too.
        self._headers = auth_headers(api_key_from_env())

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def complete(self, prompt: str, max_tokens: int | None = None) -> Completion:
        """One completion (greedy unless the client was given a temperature), its tokens counted by the server's
        usage."""
        wanted = max_tokens or self.max_tokens
        body = {"model": self.model, "prompt": prompt, "max_tokens": wanted, "temperature": self.temperature,
                "ignore_eos": True, "return_token_ids": True}
        if self.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        started = time.perf_counter()
        try:
            try:
                response = self._session().post(f"{self.url}/v1/completions", json=body, timeout=self.timeout_s,
                                                stream=self.stream, headers=self._headers)
            except requests.ConnectionError:
                # Once, on a new connection: a kept-alive one the server closed as we sent is not the server failing.
                self._local.session = requests.Session()
                response = self._session().post(f"{self.url}/v1/completions", json=body, timeout=self.timeout_s,
                                                stream=self.stream, headers=self._headers)
            if response.status_code != 200:
                raise BenchRequestError(f"{self.url}: HTTP {response.status_code}: {response.text[:300]}")
            payload = self._streamed(response) if self.stream else response.json()
        except requests.RequestException as exc:
            raise BenchRequestError(f"{self.url}: request failed: {exc.__class__.__name__}: {exc}") from None
        tokens = payload["usage"]["completion_tokens"]
        if tokens != wanted:
            raise BenchRequestError(f"{self.url}: asked for {wanted} tokens with ignore_eos and got {tokens}")
        return Completion(tokens, payload["choices"][0].get("token_ids") or [], payload["usage"]["prompt_tokens"],
                          time.perf_counter() - started)

    def _streamed(self, response: requests.Response) -> dict:
        """The events of one streamed completion folded into the shape of a non-streamed body."""
        token_ids: list[int] = []
        usage = None
        with response:
            for line in response.iter_lines():
                if not line.startswith(b"data: {"):
                    continue  # blank separators and the closing `data: [DONE]`
                event = json.loads(line[len(b"data: "):])
                for choice in event.get("choices") or []:
                    token_ids += choice.get("token_ids") or []
                usage = event.get("usage") or usage
        if usage is None:
            raise BenchRequestError(f"{self.url}: the stream ended without the usage its request asked for")
        return {"usage": usage, "choices": [{"token_ids": token_ids}]}

    def measure(self, prompts: list[str], concurrency: int, requests_total: int, *,
                with_acceptance: bool = False) -> Sample:
        """Send `requests_total` requests (prompts in turn) with `concurrency` in flight; time the whole batch."""
        chosen = [prompts[i % len(prompts)] for i in range(requests_total)]
        before = self._engine.snapshot() if with_acceptance else None
        cpu0, t0 = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            results = list(pool.map(self.complete, chosen))
        seconds, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        acceptance = self._engine.acceptance(before, self._engine.snapshot(), []) if before else None
        return Sample(concurrency=concurrency, requests=requests_total,
                      completion_tokens=sum(r.completion_tokens for r in results), seconds=seconds, client_cpu_s=cpu,
                      token_ids=[r.token_ids for r in results], acceptance=acceptance,
                      prompt_tokens=sum(r.prompt_tokens for r in results),
                      latencies_s=[r.latency_s for r in results])
