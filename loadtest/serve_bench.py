"""Results in the form `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py in vLLM 0.32), so that a run
here can be put beside one recorded on a GPU host, and an A/B can take such a file for either side.

Same definitions as theirs:
- `duration`: first request sent to last response ended; `request_throughput` = completed / duration,
  `output_throughput` = output tokens / duration, `total_token_throughput` = (input + output tokens) / duration.
- Latencies over the successful requests, in ms, with mean, median, population std and p99: `ttft` (to the first
  chunk that carries text), `tpot` = (latency - TTFT) / (output tokens - 1) over requests of 2+ tokens, `itl` =
  every gap between consecutive text chunks (under speculation one chunk carries several tokens: a gap per chunk,
  theirs and ours; our token-accurate ITL is in summary.json), `e2el` = the request's whole latency.
- `spec_decode_*`: deltas of the engine's counters over the run (`/metrics` read before and after, theirs too);
  `spec_decode_acceptance_rate` in percent, `spec_decode_acceptance_length` = 1 + accepted / drafts.
Where ours differ: Locust users are a closed loop (`max_concurrency` = users, `request_rate` "inf") or a Poisson
open loop (`request_rate`), run for a time rather than a number of prompts (`num_prompts` = requests sent);
tokens are the server's own usage counts; a SGLang server's acceptance comes from its counters under the same
definitions (loadtest/engines.py). Per-request lists (`--save-detailed`) are not written.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kimi_eagle.acceptance import Acceptance
from kimi_eagle.loadtest.engines import ServerConfig
from kimi_eagle.loadtest.records import RequestRecord
from kimi_eagle.loadtest.summary import (
    ClientOverhead,
    Distribution,
    Goodput,
    RequestCounts,
    RunSummary,
    Throughput,
    TokenAccounting,
)

FILE_NAME = "vllm_bench_serve.json"


class ServeBenchError(ValueError):
    """A file that is not a `vllm bench serve` result; the message names the file and what is wrong."""


class ServeBenchResult(BaseModel):
    """The fields of a `vllm bench serve` result this project writes and reads; a file's other fields are kept."""

    model_config = ConfigDict(extra="allow")
    date: str | None = None
    backend: str | None = None
    label: str | None = None
    model_id: str | None = None
    tokenizer_id: str | None = None
    num_prompts: int | None = None
    request_rate: float | str | None = Field(None, description='Requests/s of an open loop, or "inf".')
    burstiness: float | None = None
    max_concurrency: int | None = None
    duration: float
    completed: int
    failed: int | None = None
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None = None
    output_throughput: float
    total_token_throughput: float
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    std_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    std_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    std_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    mean_e2el_ms: float | None = None
    median_e2el_ms: float | None = None
    std_e2el_ms: float | None = None
    p99_e2el_ms: float | None = None
    spec_decode_acceptance_rate: float | None = Field(None, description="Accepted / draft tokens, in percent.")
    spec_decode_acceptance_length: float | None = None
    spec_decode_num_drafts: int | None = None
    spec_decode_draft_tokens: int | None = None
    spec_decode_accepted_tokens: int | None = None
    spec_decode_per_position_acceptance_rates: list[float] | None = None

    def latency(self, metric: str, stat: str) -> float | None:
        return getattr(self, f"{stat}_{metric}_ms")


def _latency_fields(metric: str, values_ms: list[float]) -> dict[str, float]:
    if not values_ms:
        return {}
    a = np.asarray(values_ms, dtype=float)
    stats = {"mean": a.mean(), "median": np.median(a), "std": a.std(), "p99": np.percentile(a, 99)}
    return {f"{stat}_{metric}_ms": float(value) for stat, value in stats.items()}


def _totals(duration: float, completed: int, failed: int, input_tokens: int, output_tokens: int
            ) -> dict[str, object]:
    def per_s(n: int) -> float:
        return n / duration if duration else 0.0

    return {"duration": duration, "completed": completed, "failed": failed, "total_input_tokens": input_tokens,
            "total_output_tokens": output_tokens, "request_throughput": per_s(completed),
            "output_throughput": per_s(output_tokens), "total_token_throughput": per_s(input_tokens + output_tokens)}


def _speculation(acceptance: Acceptance | None) -> dict[str, object]:
    if acceptance is None or not acceptance.num_draft_tokens:
        return {}
    return {"spec_decode_acceptance_rate": 100 * (acceptance.num_accepted_tokens or 0) / acceptance.num_draft_tokens,
            "spec_decode_acceptance_length": acceptance.mean_acceptance_length,
            "spec_decode_num_drafts": acceptance.num_verify_steps,
            "spec_decode_draft_tokens": acceptance.num_draft_tokens,
            "spec_decode_accepted_tokens": acceptance.num_accepted_tokens,
            "spec_decode_per_position_acceptance_rates": acceptance.per_position_acceptance_rate or []}


def from_run(summary: RunSummary, records: list[RequestRecord]) -> ServeBenchResult:
    """One Locust run in `vllm bench serve`'s form."""
    ok = [r for r in records if r.ok]
    workload = summary.workload
    return ServeBenchResult.model_validate({
        "date": time.strftime("%Y%m%d-%H%M%S", time.localtime(summary.started_unix_s or time.time())),
        "backend": "openai-chat" if workload.api == "chat" else "openai",
        "label": summary.label, "model_id": summary.model, "num_prompts": len(records),
        "request_rate": workload.request_rate_per_s or "inf", "burstiness": 1.0,
        "max_concurrency": None if workload.request_rate_per_s else summary.locust.users,
        **_totals(summary.throughput.duration_s or 0.0, len(ok), len(records) - len(ok),
                  sum(r.prompt_tokens or 0 for r in ok), sum(r.completion_tokens or 0 for r in ok)),
        "request_goodput": summary.goodput.goodput_requests_per_s,
        **_latency_fields("ttft", [r.ttft_ms for r in ok if r.ttft_ms is not None]),
        **_latency_fields("tpot", [t for r in ok if (t := r.tpot_ms) is not None]),
        **_latency_fields("itl", [g for r in ok for g in r.inter_chunk_ms()]),
        **_latency_fields("e2el", [r.latency_ms for r in ok if r.latency_ms is not None]),
        **_speculation(summary.acceptance)})


def from_batches(*, label: str, model: str, concurrency: int, seconds: float, requests: int, input_tokens: int,
                 output_tokens: int, latencies_ms: list[float], acceptance: Acceptance | None) -> ServeBenchResult:
    """Batches of non-streamed completions, `concurrency` in flight (`kimi-eagle bench speedup`): no TTFT, TPOT or ITL
    without a stream, so those are null; `duration` is the batches' time summed."""
    return ServeBenchResult.model_validate({
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": "openai", "label": label, "model_id": model,
        "num_prompts": requests, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": concurrency,
        **_totals(seconds, requests, 0, input_tokens, output_tokens),
        **_latency_fields("e2el", latencies_ms), **_speculation(acceptance)})


def write(path: Path, results: list[ServeBenchResult]) -> Path:
    """One JSON object a line, as `--save-result` (one run) and `--append-result` (several) write them: every field,
    null where unknown, but the speculative ones only where the server speculated (vLLM leaves them out then)."""
    from kimi_eagle.loadtest.files import write_atomic

    lines = [json.dumps({k: v for k, v in r.model_dump().items() if v is not None or not k.startswith("spec_decode_")})
             for r in results]
    return write_atomic(path, "".join(line + "\n" for line in lines))


def read(path: Path) -> list[ServeBenchResult]:
    """Every result in a file: one JSON object (`--save-result`), or one per line (`--append-result`)."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ServeBenchError(f"cannot read {path}: {exc.strerror}") from None
    try:
        objects = [json.loads(text)]
    except json.JSONDecodeError:
        try:
            objects = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ServeBenchError(f"{path} is not JSON ({exc.msg}, line {exc.lineno}): give the file "
                                  "`vllm bench serve --save-result` wrote") from None
    if not objects:
        raise ServeBenchError(f"{path} is empty: give the file `vllm bench serve --save-result` wrote")
    try:
        return [ServeBenchResult.model_validate(o) for o in objects]
    except ValidationError as exc:
        missing = sorted({str(e["loc"][0]) for e in exc.errors() if e["loc"]})
        raise ServeBenchError(f"{path} is not a `vllm bench serve` result: {', '.join(missing)} missing or not "
                              "numbers") from None



def as_run_summary(result: ServeBenchResult, engine: str, source: Path) -> RunSummary:
    """A recorded result as one round of an A/B side: what the file gives, None for the rest (its p90, tokens per
    chunk, the harness's overhead, the server's settings)."""

    def spread(metric: str) -> Distribution | None:
        mean, median = result.latency(metric, "mean"), result.latency(metric, "median")
        if mean is None or median is None:
            return None
        return Distribution(count=result.completed, mean=mean, p50=median, p99=result.latency(metric, "p99"))

    acceptance = None
    if result.spec_decode_draft_tokens:
        acceptance = Acceptance(
            speculation="on", source=f"recorded by `vllm bench serve` ({source.name}): the engine's counters "
                                     "before and after its run, the same definitions",
            num_verify_steps=result.spec_decode_num_drafts, num_draft_tokens=result.spec_decode_draft_tokens,
            num_accepted_tokens=result.spec_decode_accepted_tokens,
            acceptance_rate=None if result.spec_decode_acceptance_rate is None
            else result.spec_decode_acceptance_rate / 100,
            mean_acceptance_length=result.spec_decode_acceptance_length,
            per_position_acceptance_rate=result.spec_decode_per_position_acceptance_rates)
    return RunSummary(
        label=result.label or f"recorded ({source.name})", workload=None, locust=None,
        model=result.model_id or "unknown", started_unix_s=None,
        requests=RequestCounts(total=result.completed + (result.failed or 0), ok=result.completed,
                               failed=result.failed or 0),
        ttft_ms=spread("ttft"), e2e_latency_ms=spread("e2el"), tpot_ms=spread("tpot"),
        inter_chunk_latency_ms=spread("itl"),
        throughput=Throughput(duration_s=result.duration, requests_per_s=result.request_throughput,
                              output_tokens_per_s=result.output_throughput,
                              input_tokens_per_s=result.total_token_throughput - result.output_throughput),
        goodput=Goodput(ttft_limit_ms=None, tpot_limit_ms=None, goodput_requests_per_s=result.request_goodput),
        tokens=TokenAccounting(prompt_tokens_total=result.total_input_tokens,
                               completion_tokens_total=result.total_output_tokens, requests_with_per_chunk_counts=0,
                               per_chunk_count_mismatches=0),
        acceptance=acceptance, per_request_acceptance=None, client_overhead=ClientOverhead(client_mean_ttft_ms=None),
        server_config=ServerConfig(kind=engine, model=result.model_id), recorded_from=str(source),
        recorded=result.model_dump(exclude_none=True))
