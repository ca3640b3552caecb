"""The Locust user that drives an OpenAI-compatible server, and the per-process state it shares.

FastHttpUser (geventhttpclient) rather than the `openai` client: it is Locust's fast client, it keeps Locust's
connection handling, and its raw response gives each SSE line the moment it arrives. Do not use
`FastResponse.iter_content()` / `iter_lines()` for timing: they read in 1,024-byte blocks and wait until a block
is full, so several chunks arrive "at once" and ITL collapses to zero (geventhttpclient `read(n)` loops until n
bytes are buffered).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import gevent
from gevent.pool import Pool
from locust import task
from locust.contrib.fasthttp import FAILURE_EXCEPTIONS, FastHttpUser
from locust.env import Environment

from kimi_eagle.acceptance import spec_figures_from
from kimi_eagle.loadtest.engines import api_key_from_env, auth_headers, get_engine
from kimi_eagle.loadtest.prompts import PromptLine, load_prompts
from kimi_eagle.loadtest.records import RequestRecord, StreamAccumulator
from kimi_eagle.loadtest.workload import Workload

# Open loop: at most this many requests in flight per user (and connections in its pool); arrivals beyond it
# wait for a connection, which shows up as TTFT, as it would for a real client.
OPEN_LOOP_MAX_IN_FLIGHT = 256
# After a request that got no HTTP answer (refused, reset, timed out, stream cut), a user waits this long before
# its next one: a dead server then gives a failure a second per user, not a busy loop of them.
CONNECTION_ERROR_BACKOFF_S = 1.0


@dataclass
class RunState:
    """What every user of one Locust process shares: the workload, the prompts and the records so far."""

    workload: Workload
    prompts: list[PromptLine]
    model: str
    extras: dict[str, Any]
    worker: str = "local"
    max_requests: int | None = None
    records: list[RequestRecord] = field(default_factory=list)
    unsent: list[dict[str, Any]] = field(default_factory=list)  # records not yet sent to the master
    issued: int = 0
    offset_of: Callable[[], int] = lambda: 0
    _order: itertools.count | None = None

    @classmethod
    def build(cls, workload: Workload, worker: str, max_requests: int | None,
              offset_of: Callable[[], int] = lambda: 0) -> RunState:
        prompts = load_prompts(workload.prompts or "", workload.api, workload.seed)
        engine = get_engine(workload.engine, workload.url)
        model = workload.model or engine.served_model()
        return cls(workload=workload, prompts=prompts, model=model, extras=engine.request_extras(),
                   worker=worker, max_requests=max_requests, offset_of=offset_of)

    def next_request(self) -> tuple[int, int, PromptLine] | None:
        if self.max_requests is not None and self.issued >= self.max_requests:
            return None
        if self._order is None:
            # Each worker starts at its own place in the same seeded order (its index is known only once it
            # has connected to the master).
            self._order = itertools.count(self.offset_of() * 7919)
        self.issued += 1
        n = next(self._order)
        return self.issued - 1, n % len(self.prompts), self.prompts[n % len(self.prompts)]

    def add(self, record: RequestRecord) -> None:
        self.records.append(record)
        self.unsent.append(record.model_dump())


STATE_KEY = "kimi_eagle_run_state"


def run_state(environment: Environment) -> RunState:
    state = getattr(environment, STATE_KEY, None)
    if state is None:
        raise RuntimeError("the load-test state was not set up: run Locust with -f loadtest/locustfile.py")
    return state


class OpenAIUser(FastHttpUser):
    """Sends the workload's requests; closed loop (one in flight) or open loop (Poisson arrivals)."""

    network_timeout = 600.0
    connection_timeout = 10.0
    concurrency = OPEN_LOOP_MAX_IN_FLIGHT
    host = "http://127.0.0.1:8000"

    def on_start(self) -> None:
        self.state = run_state(self.environment)
        self.rng = random.Random(f"{self.state.workload.seed}-{self.state.worker}-{id(self)}")
        self.pool = Pool(OPEN_LOOP_MAX_IN_FLIGHT)
        # Read here, in the Locust process, and kept out of Workload: summary.json never holds the key.
        self.headers = auth_headers(api_key_from_env())
        self.backoff_until = 0.0

    def wait_time(self) -> float:
        rate = self.state.workload.request_rate_per_s
        if rate is None:
            return 0.0
        # Each user draws its own arrivals at its share of the total rate. Workers do not know how many users
        # the others run: `kimi-eagle loadtest` tells them (--open-loop-users); alone, a process counts its own.
        options = self.environment.parsed_options
        users = getattr(options, "open_loop_users", 0) or (self.environment.runner.user_count
                                                           if self.environment.runner else 1)
        return self.rng.expovariate(rate / max(1, users))

    def on_stop(self) -> None:
        # Open loop: let requests already in flight finish (bounded by Locust's --stop-timeout).
        self.pool.join()

    @task
    def send(self) -> None:
        pause = self.backoff_until - time.monotonic()
        if pause > 0:
            gevent.sleep(pause)
        picked = self.state.next_request()
        if picked is None:
            gevent.sleep(1.0)  # this process has sent its share of --max-requests; wait for the run to end
            return
        if self.state.workload.request_rate_per_s is None:
            self.send_one(*picked)
        else:
            self.pool.spawn(self.send_one, *picked)

    def send_one(self, index: int, prompt_index: int, prompt: PromptLine) -> None:
        workload = self.state.workload
        body = workload.request_body(prompt, self.state.model, self.state.extras)
        name = f"{workload.api}{' stream' if workload.stream else ''}"
        acc = StreamAccumulator()
        final: dict[str, Any] = {}
        error: str | None = None
        connection_lost = False
        start_unix = time.time()
        t0 = time.perf_counter()
        with self.client.post(workload.path, json=body, stream=workload.stream, catch_response=True,
                              name=name, headers=self.headers) as response:
            status = response.status_code or None
            if status is None:
                connection_lost = True
                error = f"no HTTP answer: {_exception_text(getattr(response, 'error', None))}"
            elif getattr(response, "error", None) is not None or status != 200:
                error = f"HTTP {status}: {_error_text(response)}"
            elif workload.stream:
                raw = response._response  # geventhttpclient's response: see the module docstring
                try:
                    while line := raw.readline(b"\n"):
                        acc.feed(line, (time.perf_counter() - t0) * 1000)
                except FAILURE_EXCEPTIONS as exc:  # what geventhttpclient raises for a cut or timed-out stream
                    connection_lost = True
                    error = f"stream broken: {_exception_text(exc)}"
                error = error or acc.error or (None if acc.done else "stream ended without [DONE]")
            else:
                try:
                    final = response.json()
                except ValueError:
                    error = "response is not JSON"
            latency_ms = (time.perf_counter() - t0) * 1000
            usage = (acc.usage if workload.stream else final.get("usage")) or {}
            if error is None and usage.get("completion_tokens") is None:
                error = "the server returned no usage.completion_tokens"
            # Locust's own statistics time the whole body, not just the headers.
            response.request_meta["response_time"] = latency_ms
            if error:
                response.failure(error)
            else:
                response.success()
        if connection_lost:
            self.backoff_until = time.monotonic() + CONNECTION_ERROR_BACKOFF_S
        self.state.add(RequestRecord(
            worker=self.state.worker, index=index, prompt_index=prompt_index, api=workload.api,
            stream=workload.stream, start_unix_s=start_unix, ok=error is None, error=error,
            status_code=status, ttft_ms=acc.ttft_ms, latency_ms=latency_ms,
            chunk_offsets_ms=acc.chunk_offsets_ms, chunk_tokens=acc.chunk_tokens,
            prompt_tokens=usage.get("prompt_tokens"), completion_tokens=usage.get("completion_tokens"),
            spec=acc.spec if workload.stream else spec_figures_from(final)))


def _exception_text(exc: BaseException | None) -> str:
    return "unknown error" if exc is None else f"{exc.__class__.__name__}: {exc}"


def _error_text(response: Any) -> str:
    try:
        return (response.text or "")[:200]
    except (*FAILURE_EXCEPTIONS, ValueError):
        return "(no body)"
