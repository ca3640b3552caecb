"""Per-request records -> the figures of a RunSummary."""

from __future__ import annotations

from collections import Counter

from kimi_eagle.acceptance import Acceptance
from kimi_eagle.loadtest.engines import ServerConfig, ServerTiming
from kimi_eagle.loadtest.records import RequestRecord
from kimi_eagle.loadtest.summary import (
    ClientOverhead,
    Goodput,
    LocustSettings,
    PerRequestAcceptance,
    RequestCounts,
    RunSummary,
    Throughput,
    TokenAccounting,
    distribution,
)
from kimi_eagle.loadtest.workload import Workload


def _throughput(ok: list[RequestRecord], all_records: list[RequestRecord]) -> Throughput:
    timed = [r for r in all_records if r.latency_ms is not None]
    if not timed:
        return Throughput()
    start = min(r.start_unix_s for r in timed)
    end = max(r.start_unix_s + r.latency_ms / 1000 for r in timed if r.latency_ms is not None)
    duration = end - start
    if duration <= 0:
        return Throughput(duration_s=duration)
    out_tokens = [r.completion_tokens for r in ok]
    in_tokens = [r.prompt_tokens for r in ok]
    return Throughput(
        duration_s=duration, requests_per_s=len(ok) / duration,
        output_tokens_per_s=sum(out_tokens) / duration if None not in out_tokens else None,
        input_tokens_per_s=sum(in_tokens) / duration if None not in in_tokens else None)


def _goodput(workload: Workload, ok: list[RequestRecord], duration_s: float | None) -> Goodput:
    ttft_limit, tpot_limit = workload.ttft_limit_ms, workload.tpot_limit_ms
    if ttft_limit is None and tpot_limit is None:
        return Goodput(ttft_limit_ms=None, tpot_limit_ms=None)

    def good(r: RequestRecord) -> bool:
        # An unknown figure cannot be shown to meet a limit.
        if ttft_limit is not None and (r.ttft_ms is None or r.ttft_ms > ttft_limit):
            return False
        return not (tpot_limit is not None and (r.tpot_ms is None or r.tpot_ms > tpot_limit))

    n = sum(good(r) for r in ok)
    return Goodput(ttft_limit_ms=ttft_limit, tpot_limit_ms=tpot_limit, good_requests=n,
                   goodput_requests_per_s=n / duration_s if duration_s else None,
                   good_fraction=n / len(ok) if ok else None)


def _tokens(workload: Workload, ok: list[RequestRecord]) -> TokenAccounting:
    counted = [r for r in ok if r.counted_tokens is not None]
    mismatches = sum(r.counted_tokens != r.completion_tokens for r in counted)
    prompt = [r.prompt_tokens for r in ok]
    completion = [r.completion_tokens for r in ok]
    return TokenAccounting(
        prompt_tokens_total=sum(prompt) if ok and None not in prompt else None,
        completion_tokens_total=sum(completion) if ok and None not in completion else None,
        requests_with_per_chunk_counts=len(counted), per_chunk_count_mismatches=mismatches,
        per_chunk_counts_match_usage=(mismatches == 0) if counted else None,
        requests_short_of_max_tokens=sum((r.completion_tokens or 0) < workload.max_tokens for r in ok))


def _per_request_acceptance(ok: list[RequestRecord]) -> PerRequestAcceptance | None:
    figures = [r.spec for r in ok if r.spec is not None]
    if not figures:
        return None
    return PerRequestAcceptance(
        source=figures[0].source, requests=len(figures),
        mean_acceptance_length=distribution([f.mean_acceptance_length for f in figures
                                             if f.mean_acceptance_length is not None]),
        acceptance_rate=distribution([f.acceptance_rate for f in figures if f.acceptance_rate is not None]))


def _overhead(ok: list[RequestRecord], timing: ServerTiming | None, cpu_max: float | None) -> ClientOverhead:
    ttfts = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    client = sum(ttfts) / len(ttfts) if ttfts else None
    server = timing.mean_ttft_ms if timing else None
    overhead = None if client is None or server is None else client - server
    return ClientOverhead(client_requests=len(ttfts), client_mean_ttft_ms=client, server_mean_ttft_ms=server,
                          server_requests=timing.requests if timing else None, overhead_ms=overhead,
                          overhead_fraction=None if overhead is None or not client else overhead / client,
                          harness_cpu_percent_max=cpu_max)


def summarise(records: list[RequestRecord], *, workload: Workload, locust: LocustSettings, model: str,
              acceptance: Acceptance | None = None, timing: ServerTiming | None = None,
              server_config: ServerConfig | None = None, cpu_max: float | None = None,
              label: str | None = None, interrupted: bool = False) -> RunSummary:
    ok = [r for r in records if r.ok]
    errors = Counter((r.error or "unknown error")[:80] for r in records if not r.ok)
    throughput = _throughput(ok, records)
    per_request_tps = [r.completion_tokens / (r.latency_ms / 1000) for r in ok
                       if r.completion_tokens and r.latency_ms]
    return RunSummary(
        label=label, interrupted=interrupted, workload=workload, locust=locust, model=model,
        started_unix_s=min((r.start_unix_s for r in records), default=None),
        requests=RequestCounts(total=len(records), ok=len(ok), failed=len(records) - len(ok), errors=dict(errors)),
        ttft_ms=distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        e2e_latency_ms=distribution([r.latency_ms for r in ok if r.latency_ms is not None]),
        tpot_ms=distribution([t for r in ok if (t := r.tpot_ms) is not None]),
        inter_chunk_latency_ms=distribution([g for r in ok for g in r.inter_chunk_ms()]),
        itl_per_token_ms=distribution([g for r in ok for g in r.per_token_itl_ms()]),
        tokens_per_chunk=distribution([n for r in ok for n in r.chunk_tokens if n is not None]),
        output_tokens_per_s_per_request=distribution(per_request_tps),
        throughput=throughput, goodput=_goodput(workload, ok, throughput.duration_s), tokens=_tokens(workload, ok),
        acceptance=acceptance, per_request_acceptance=_per_request_acceptance(ok),
        client_overhead=_overhead(ok, timing, cpu_max), server_config=server_config)
