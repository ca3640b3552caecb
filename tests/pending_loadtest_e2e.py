"""Written, not yet run against a real vLLM server (lead, first session): kept out of collection until they pass."""
"""`kimi-eagle loadtest`: prompt sets, request bodies, per-request figures, and real Locust runs against the
tiny served model (local and distributed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.files import write_atomic
from loadtest.metrics import summarise
from loadtest.prompts import PromptError, load_prompts, shipped_sets
from loadtest.records import RequestRecord, StreamAccumulator
from loadtest.results import load_records, load_summary
from loadtest.summary import LocustSettings, RunSummary
from loadtest.workload import Workload

REPO = Path(__file__).resolve().parents[1]

from tests.test_loadtest import check_run, load_records, load_summary, run_cli  # noqa: E402


@pytest.mark.e2e
def test_real_run_against_the_speculating_server(spec_server, tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = run_cli("loadtest", "--url", spec_server.url, "--users", "2", "--run-time", "15s", "--max-tokens",
                     "32", "--max-requests", "10", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = check_run(out, 32)
    acceptance = summary.acceptance
    assert acceptance is not None and acceptance.speculation == "on"
    assert acceptance.acceptance_rate is not None and acceptance.acceptance_rate > 0
    assert acceptance.mean_acceptance_length is not None and acceptance.mean_acceptance_length > 1
    assert acceptance.num_speculative_tokens == 3 and len(acceptance.per_position_acceptance_rate or []) == 3
    # Several tokens per chunk is what speculation looks like on the wire.
    assert summary.tokens_per_chunk is not None and summary.tokens_per_chunk.max > 1
    overhead = summary.client_overhead
    assert overhead.server_mean_ttft_ms is not None and overhead.overhead_ms is not None
    assert "users 2 |" in result.stderr  # the live progress line



@pytest.mark.e2e
def test_chat_without_streaming(spec_server, tmp_path: Path) -> None:
    out = tmp_path / "chat"
    result = run_cli("loadtest", "--url", spec_server.url, "--api", "chat", "--no-stream", "--run-time", "10s",
                     "--max-tokens", "16", "--max-requests", "3", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = load_summary(out / "summary.json")
    assert summary.requests.ok >= 1 and summary.ttft_ms is None  # no stream, no TTFT: unknown, not zero
    assert summary.tokens.completion_tokens_total == 16 * summary.requests.ok



@pytest.mark.e2e
def test_distributed_mode_gives_the_same_summary(spec_server, tmp_path: Path) -> None:
    out = tmp_path / "dist"
    result = run_cli("loadtest", "--url", spec_server.url, "--api", "chat", "--workers", "2", "--users", "2",
                     "--run-time", "15s", "--max-tokens", "24", "--max-requests", "8", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    summary = check_run(out, 24)
    assert summary.locust.mode == "distributed" and summary.locust.workers == 2
    assert len({r.worker for r in load_records(out / "requests.jsonl")}) == 2
    assert summary.acceptance is not None and summary.acceptance.speculation == "on"
