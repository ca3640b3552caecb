"""`kimi-eagle ab`: verdicts only beyond the round-to-round spread, fairness checks, and a real A/B between a
speculating and a plain vLLM server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from loadtest.ab import FIGURES, compare, fairness_checks
from loadtest.engines import Acceptance, ServerConfig
from loadtest.metrics import summarise
from loadtest.records import RequestRecord
from loadtest.summary import LocustSettings, RunSummary
from loadtest.workload import Workload

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_eagle.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


THROUGHPUT = next(f for f in FIGURES if f.name == "output tokens/s")
TTFT_P50 = next(f for f in FIGURES if f.name == "TTFT p50 (ms)")


def _run(tokens_per_s: float, ttft_ms: float, acceptance: Acceptance | None = None) -> RunSummary:
    # One request of `tokens_per_s` tokens lasting exactly one second.
    record = RequestRecord(worker="t", index=0, prompt_index=0, api="completions", stream=True, start_unix_s=0,
                           ok=True, ttft_ms=ttft_ms, latency_ms=1000.0, completion_tokens=int(tokens_per_s),
                           prompt_tokens=1)
    return summarise([record], workload=Workload(url="http://x"), locust=LocustSettings(users=1), model="m",
                     acceptance=acceptance)


def test_verdict_only_beyond_round_to_round_spread() -> None:
    a = [_run(100, 50), _run(110, 52)]
    clearly_faster = [_run(150, 50), _run(152, 51)]
    within = [_run(104, 51), _run(106, 51)]
    c = compare(THROUGHPUT, a, clearly_faster)
    assert c["verdict"] == "B better" and c["ratio"] == f"{151 / 105:.3f}"
    assert c["a"] == "105.0 ± 5.0"
    assert compare(THROUGHPUT, a, within)["verdict"] == "within round-to-round spread"
    # Lower is better for latency: B's TTFT 20 ms higher than A's with a 2 ms spread is worse.
    assert compare(TTFT_P50, a, [_run(100, 70), _run(100, 72)])["verdict"] == "B worse"
    assert compare(THROUGHPUT, a[:1], clearly_faster[:1])["verdict"] == "no verdict (needs 2+ rounds per side)"


def test_acceptance_against_no_speculation_is_not_compared() -> None:
    on = Acceptance(speculation="on", source="s", acceptance_rate=0.8, mean_acceptance_length=3.4)
    off = Acceptance(speculation="off", source="no counters")
    rate = next(f for f in FIGURES if f.name == "acceptance rate")
    c = compare(rate, [_run(1, 1, on), _run(1, 1, on)], [_run(1, 1, off), _run(1, 1, off)])
    assert c["b"] == "n/a" and c["verdict"] == "not comparable (missing on one side)"


def test_fairness_checks_name_differences_and_unknowns() -> None:
    a = ServerConfig(kind="vllm", model="m", num_speculative_tokens=3)
    b = ServerConfig(kind="sglang", model="m", num_speculative_tokens=4, dtype="bfloat16", max_num_seqs=16)
    runs = [_run(1, 1)]
    checks = {c.setting: c.verdict for c in fairness_checks(a, b, runs, runs)}
    assert checks["model"] == "same"
    assert checks["num_speculative_tokens"] == "DIFFERS"
    assert checks["dtype"] == "not exposed by A"
    assert checks["workload (prompts, seed, max_tokens, ...)"] == "same"
