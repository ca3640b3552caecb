"""The summary of a run (summary.json): pydantic models, units in the field names, None where unknown."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

from kimi_eagle.acceptance import Acceptance
from kimi_eagle.loadtest.engines import ServerConfig
from kimi_eagle.loadtest.workload import Workload

SUMMARY_SCHEMA = "kimi-eagle/loadtest-summary/1"
EXIT_INTERRUPTED = 130  # exit code of a run stopped by Ctrl-C or SIGTERM (128 + SIGINT, as a shell reports it)


class Distribution(BaseModel):
    """Percentiles of per-request (or per-token) samples taken by the harness itself, not Locust's histogram."""

    count: int
    mean: float
    p50: float
    p90: float | None = Field(None, description="None in a result recorded by another tool that gives no p90.")
    p99: float | None = None
    min: float | None = None
    max: float | None = None


def distribution(values: list[float]) -> Distribution | None:
    if not values:
        return None
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return Distribution(count=len(a), mean=float(a.mean()), p50=float(p50), p90=float(p90), p99=float(p99),
                        min=float(a.min()), max=float(a.max()))


class LocustSettings(BaseModel):
    users: int | None = Field(None, description="Closed loop: concurrent users (one request in flight each).")
    spawn_rate_per_s: float | None = None
    run_time_s: float | None = None
    mode: Literal["local", "distributed"] = "local"
    workers: int = Field(0, description="Locust worker processes (distributed mode).")


class RequestCounts(BaseModel):
    total: int
    ok: int
    failed: int
    errors: dict[str, int] = Field(default_factory=dict, description="Error message -> count (first 80 chars).")


class Throughput(BaseModel):
    duration_s: float | None = Field(None, description="First request sent to last response ended.")
    requests_per_s: float | None = None
    output_tokens_per_s: float | None = Field(None, description="All output tokens (server usage) / duration.")
    input_tokens_per_s: float | None = None


class Goodput(BaseModel):
    ttft_limit_ms: float | None
    tpot_limit_ms: float | None
    good_requests: int | None = Field(None, description="OK requests within every limit set; None: no limit set.")
    goodput_requests_per_s: float | None = None
    good_fraction: float | None = None


class TokenAccounting(BaseModel):
    prompt_tokens_total: int | None
    completion_tokens_total: int | None
    requests_with_per_chunk_counts: int = Field(description="Requests where every chunk's token count was known.")
    per_chunk_count_mismatches: int = Field(description="Of those, requests whose chunk counts do not add up to "
                                                        "the server's usage.completion_tokens.")
    per_chunk_counts_match_usage: bool | None = Field(None, description="None: no request had per-chunk counts.")
    requests_short_of_max_tokens: int = Field(0, description="OK requests that got fewer tokens than max_tokens.")


class PerRequestAcceptance(BaseModel):
    source: str
    requests: int
    mean_acceptance_length: Distribution | None
    acceptance_rate: Distribution | None


class ClientOverhead(BaseModel):
    """How much of TTFT the harness (HTTP, SSE parsing, Locust) adds over the engine's own TTFT."""

    client_requests: int = Field(0, description="Requests with a client-side TTFT.")
    client_mean_ttft_ms: float | None
    server_mean_ttft_ms: float | None = Field(None, description="Engine histogram delta over the run.")
    server_requests: int | None = None
    overhead_ms: float | None = Field(None, description="client - server mean TTFT.")
    overhead_fraction: float | None = Field(None, description="overhead / client mean TTFT.")
    harness_cpu_percent_max: float | None = Field(None, description="Highest CPU use of a Locust process "
                                                                     "(a process above 90% is the bottleneck).")


class RunSummary(BaseModel):
    schema_id: str = Field(SUMMARY_SCHEMA, alias="schema")
    label: str | None = Field(None, description="Free text: which server / round this run is.")
    interrupted: bool = Field(False, description="Stopped by Ctrl-C or SIGTERM before its end: the figures cover "
                                                 "the requests answered until then.")
    workload: Workload | None = Field(description="None for a run recorded by another tool (`recorded`).")
    locust: LocustSettings | None
    model: str
    started_unix_s: float | None
    requests: RequestCounts
    ttft_ms: Distribution | None
    e2e_latency_ms: Distribution | None
    tpot_ms: Distribution | None = Field(None, description="Per request: (latency - TTFT) / (tokens - 1).")
    inter_chunk_latency_ms: Distribution | None = Field(None, description="Gaps between streamed chunks.")
    itl_per_token_ms: Distribution | None = Field(None, description="Each gap / tokens in the chunk, per token.")
    tokens_per_chunk: Distribution | None = None
    output_tokens_per_s_per_request: Distribution | None = None
    throughput: Throughput
    goodput: Goodput
    tokens: TokenAccounting
    acceptance: Acceptance | None
    per_request_acceptance: PerRequestAcceptance | None
    client_overhead: ClientOverhead
    server_config: ServerConfig | None
    files: dict[str, str] = Field(default_factory=dict, description="What is in the results folder.")
    recorded_from: str | None = Field(None, description="The file of a run recorded by another tool "
                                                        "(`vllm bench serve`), read for an A/B.")
    recorded: dict[str, Any] | None = Field(None, description="That file's own fields, as it gives them.")

    model_config = {"populate_by_name": True}


class SweepSummary(BaseModel):
    schema_id: str = Field("kimi-eagle/loadtest-sweep/1", alias="schema")
    points: list[RunSummary]
    folders: list[str]

    model_config = {"populate_by_name": True}
