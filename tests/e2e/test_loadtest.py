"""`kimi-eagle loadtest` against the served tiny pair: real Locust runs, local and distributed."""


from __future__ import annotations

from pathlib import Path

import pytest

from kimi_eagle.loadtest.results import load_records, load_summary
from kimi_eagle.loadtest.summary import RunSummary
from tests.helpers.cli import exit_message, run_cli


def check_run(out: Path, max_tokens: int) -> RunSummary:
    summary = load_summary(out / "summary.json")
    records = load_records(out / "requests.jsonl")
    assert summary.requests.ok == len(records) > 0 and summary.requests.failed == 0
    # Token counts per chunk add up exactly to the server's usage, request by request.
    assert summary.tokens.per_chunk_counts_match_usage is True
    assert summary.tokens.requests_with_per_chunk_counts == len(records)
    for r in records:
        assert r.counted_tokens == r.completion_tokens == max_tokens
    for name in ("report.md", "latency_cdf.png", "acceptance_per_position.png", "locust_stats.csv",
                 "engine_before.json", "engine_after.json"):
        assert (out / name).is_file(), name
    return summary


@pytest.mark.e2e
def test_real_run_against_the_speculating_server(spec_server, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("loadtest", "--url", spec_server.url, "--users", "2", "--run-time", "15s", "--max-tokens",
                     "32", "--max-requests", "10", "--out", str(out))
    assert result.returncode == 0, exit_message(result)
    summary = check_run(out, 32)
    acceptance = summary.acceptance
    assert acceptance is not None and acceptance.speculation == "on"
    assert acceptance.acceptance_rate is not None and acceptance.acceptance_rate > 0
    assert acceptance.mean_acceptance_length is not None and acceptance.mean_acceptance_length > 1
    assert acceptance.num_speculative_tokens == 3 and len(acceptance.per_position_acceptance_rate or []) == 3
    # The exactness profile keeps its k (KIMI_EAGLE_MEASURED_K=0): the report says so rather than show nothing.
    assert acceptance.measured_k is None
    assert "the engine's measured k at the end (per batch-size range" in (out / "report.md").read_text()
    assert "KIMI_EAGLE_MEASURED_K=0" in (out / "report.md").read_text()
    # The profile asks vLLM for each response's own acceptance: its spread is in the summary.
    per_request = summary.per_request_acceptance
    assert per_request is not None and per_request.requests == summary.requests.ok
    assert per_request.mean_acceptance_length is not None and per_request.mean_acceptance_length.p50 > 1
    # Several tokens per chunk is what speculation looks like on the wire.
    assert summary.tokens_per_chunk is not None and summary.tokens_per_chunk.max > 1
    overhead = summary.client_overhead
    assert overhead.server_mean_ttft_ms is not None and overhead.overhead_ms is not None
    assert "users 2 |" in result.stderr  # the live progress line
    print(f"\nloadtest e2e (spec server): {summary.requests.ok} requests, acceptance rate "
          f"{acceptance.acceptance_rate:.3f}, mean acceptance length {acceptance.mean_acceptance_length:.3f}, per "
          f"position {[round(r, 3) for r in acceptance.per_position_acceptance_rate or []]}, "
          f"{summary.throughput.output_tokens_per_s:.1f} output tok/s, TTFT p50 {summary.ttft_ms.p50:.1f} ms, "
          f"client mean TTFT {overhead.client_mean_ttft_ms:.1f} ms vs server {overhead.server_mean_ttft_ms:.1f} ms "
          f"(harness {overhead.overhead_ms:.1f} ms), tokens per chunk mean {summary.tokens_per_chunk.mean:.2f} max "
          f"{summary.tokens_per_chunk.max:.0f}, per-chunk counts match usage "
          f"{summary.tokens.per_chunk_counts_match_usage}")


@pytest.mark.e2e
def test_chat_without_streaming(spec_server, tmp_path: Path) -> None:
    out = tmp_path / "chat"
    result = run_cli("loadtest", "--url", spec_server.url, "--api", "chat", "--no-stream", "--run-time", "10s",
                     "--max-tokens", "16", "--max-requests", "3", "--out", str(out))
    assert result.returncode == 0, exit_message(result)
    summary = load_summary(out / "summary.json")
    assert summary.requests.ok >= 1 and summary.ttft_ms is None  # no stream, no TTFT: unknown, not zero
    assert summary.tokens.completion_tokens_total == 16 * summary.requests.ok


@pytest.mark.e2e
def test_distributed_mode_gives_the_same_summary(spec_server, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    result = run_cli("loadtest", "--url", spec_server.url, "--api", "chat", "--workers", "2", "--users", "2",
                     "--run-time", "15s", "--max-tokens", "24", "--max-requests", "8", "--out", str(out))
    assert result.returncode == 0, exit_message(result)
    summary = check_run(out, 24)
    assert summary.locust.mode == "distributed" and summary.locust.workers == 2
    assert len({r.worker for r in load_records(out / "requests.jsonl")}) == 2
    assert summary.acceptance is not None and summary.acceptance.speculation == "on"
    assert summary.client_overhead.harness_cpu_percent_max is not None  # measured on the workers, not a zero
    print(f"\nloadtest e2e (distributed, 2 workers): {summary.requests.ok} requests from "
          f"{sorted({r.worker for r in load_records(out / 'requests.jsonl')})}, "
          f"{summary.throughput.output_tokens_per_s:.1f} output tok/s, TTFT p50 {summary.ttft_ms.p50:.1f} ms, "
          f"mean acceptance length {summary.acceptance.mean_acceptance_length:.3f}, harness CPU max "
          f"{summary.client_overhead.harness_cpu_percent_max}%")

