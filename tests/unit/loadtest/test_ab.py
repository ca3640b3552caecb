"""`kimi-eagle ab` without an engine: verdicts only beyond the round-to-round spread, fairness checks, interrupts."""


from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_eagle.acceptance import Acceptance
from kimi_eagle.loadtest.ab import FIGURES, AbSummary, compare, fairness_checks
from kimi_eagle.loadtest.engines import ServerConfig
from kimi_eagle.loadtest.metrics import summarise
from kimi_eagle.loadtest.records import RequestRecord
from kimi_eagle.loadtest.results import load_summary
from kimi_eagle.loadtest.summary import LocustSettings, RunSummary
from kimi_eagle.loadtest.workload import Workload
from tests.helpers.cli import REPO
from tests.helpers.sglang_stand_in import StandIn

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


def test_interrupted_ab_reports_the_whole_rounds_only(sglang_recordings: Path, tmp_path: Path) -> None:
    a, b = StandIn(sglang_recordings, line_delay_s=0.01), StandIn(sglang_recordings, line_delay_s=0.02)
    out = tmp_path / "ab"
    cli = subprocess.Popen([sys.executable, "-m", "kimi_eagle.cli", "ab", "--a", a.url, "--a-engine", "sglang",
                            "--b", b.url, "--b-engine", "sglang", "--rounds", "3", "--run-time", "60s",
                            "--max-tokens", "16", "--max-requests", "3", "--out", str(out)],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert cli.stderr is not None
        for line in cli.stderr:
            if "B round 1:" in line:  # the title of B's first summary: round 2 starts now
                break
        else:
            pytest.fail("the A/B never finished its first round")
        cli.send_signal(signal.SIGTERM)
        _, stderr = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
        a.close()
        b.close()
    assert cli.returncode == 130, f"exit {cli.returncode} after the interrupt, expected 130: {stderr[-300:]!r}"
    summary = AbSummary.model_validate_json((out / "ab_summary.json").read_text())
    assert (len(summary.a.rounds), len(summary.b.rounds)) == (1, 1)
    assert "| 1 | A |" in (out / "report.md").read_text() and "| 2 | A |" not in (out / "report.md").read_text()
    partial = out / "round2-A" / "summary.json"
    assert not partial.exists() or load_summary(partial).interrupted


def test_tokens_per_chunk_gets_no_better_or_worse() -> None:
    def run(tokens_per_chunk: float) -> RunSummary:
        record = RequestRecord(worker="t", index=0, prompt_index=0, api="completions", stream=True, start_unix_s=0,
                               ok=True, ttft_ms=1.0, latency_ms=10.0, completion_tokens=4, prompt_tokens=1,
                               chunk_offsets_ms=[1.0, 5.0], chunk_tokens=[1, int(tokens_per_chunk)])
        return summarise([record], workload=Workload(url="http://x"), locust=LocustSettings(users=1), model="m")

    figure = next(f for f in FIGURES if f.name == "tokens per chunk (mean)")
    # Speculation (A) sends several tokens per chunk, plain decoding (B) one: a difference, not a merit.
    assert compare(figure, [run(3), run(3)], [run(1), run(1)])["verdict"] == "B lower"

