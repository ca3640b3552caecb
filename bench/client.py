"""The benchmark's own minimal client: greedy, fixed-length, non-streamed completions from a pool of threads.

Non-streamed on purpose: the server then does the least work per token outside the engine, and the client parses
one JSON body per request, so tokens/s measures the engine, not the harness (`kimi-eagle loadtest` measures the
streaming side). Tokens are counted from the server's `usage`, never from the text.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import requests

from kimi_eagle.acceptance import Acceptance
from kimi_eagle.loadtest.engines import get_engine


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
    def __init__(self, url: str, model: str, max_tokens: int, timeout_s: float = 600.0) -> None:
        self.url, self.model, self.max_tokens, self.timeout_s = url, model, max_tokens, timeout_s
        self._local = threading.local()
        self._engine = get_engine("vllm", url)

    def _session(self) -> requests.Session:
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return self._local.session

    def complete(self, prompt: str, max_tokens: int | None = None) -> Completion:
        """One greedy completion, its tokens counted by the server's usage."""
        wanted = max_tokens or self.max_tokens
        body = {"model": self.model, "prompt": prompt, "max_tokens": wanted, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        started = time.perf_counter()
        try:
            response = self._session().post(f"{self.url}/v1/completions", json=body, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise BenchRequestError(f"{self.url}: request failed: {exc.__class__.__name__}: {exc}") from None
        if response.status_code != 200:
            raise BenchRequestError(f"{self.url}: HTTP {response.status_code}: {response.text[:300]}")
        payload = response.json()
        tokens = payload["usage"]["completion_tokens"]
        if tokens != wanted:
            raise BenchRequestError(f"{self.url}: asked for {wanted} tokens with ignore_eos and got {tokens}")
        return Completion(tokens, payload["choices"][0].get("token_ids") or [], payload["usage"]["prompt_tokens"],
                          time.perf_counter() - started)

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
