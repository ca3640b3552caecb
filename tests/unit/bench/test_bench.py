"""The benchmark's arithmetic, report and failure messages, without an engine (the e2e run is test_bench_e2e)."""


from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from kimi_eagle.acceptance import Acceptance
from kimi_eagle.bench.client import BenchClient, BenchRequestError, Sample
from kimi_eagle.bench.plan import FULL, QUICK, BenchPlan
from kimi_eagle.bench.report import markdown, profile_setting
from kimi_eagle.bench.result import BenchResult, CeilingProbe, Machine, ThroughputPoint, summed_acceptance
from kimi_eagle.bench.servers import ColdStart, RssSampler
from kimi_eagle.bench.speedup import ceiling_candidates, ceiling_prompts, checks_overhead
from kimi_eagle.bench.speedup_model import CostModel, fit_cost_model, recommend, step_cost, tokens_per_step
from kimi_eagle.bench.stats import paired_ratios, spread
from kimi_eagle.bench.subcommand import BenchError, load_prompts
from kimi_eagle.cli import main
from kimi_eagle.fixtures.pair_spec import PREDICTABLE_PROMPTS_FILE
from tests.helpers.sglang_stand_in import StandIn

PER_POSITION = [0.9, 0.8, 0.7, 0.5, 0.3]


def test_spread_is_median_min_max_and_unknown_stays_unknown():
    s = spread([3.0, 1.0, 10.0, 2.0, 4.0])
    assert (s.n, s.median, s.min, s.max) == (5, 3.0, 1.0, 10.0)
    assert s.relative_range == pytest.approx(3.0)
    assert spread([]) is None


def test_paired_ratios_refuse_unpaired_rounds():
    assert paired_ratios([2.0, 3.0], [1.0, 2.0]) == [2.0, 1.5]
    with pytest.raises(ValueError, match="as many B as A"):
        paired_ratios([1.0], [1.0, 2.0])


def test_tokens_per_step_adds_the_bonus_token_and_refuses_unmeasured_positions():
    assert tokens_per_step(PER_POSITION, 3) == pytest.approx(3.4)
    with pytest.raises(ValueError, match="larger num_speculative_tokens"):
        tokens_per_step(PER_POSITION[:2], 3)


def test_step_cost_and_a_single_k_give_leviathans_model():
    assert step_cost(PER_POSITION, 5, measured_speedup=2.1) == pytest.approx(2.0)
    model = fit_cost_model({5: 2.0})
    assert (model.fixed, model.per_draft_token, model.calibrated_at_k) == (0.0, pytest.approx(0.2), [5])
    assert model.speedup(PER_POSITION, 5) == pytest.approx(2.1)
    assert CostModel(fixed=0, per_draft_token=0, calibrated_at_k=[]).speedup(PER_POSITION, 5) == pytest.approx(4.2)


def test_two_k_separate_the_fixed_overhead_from_the_per_token_cost():
    model = fit_cost_model({1: 2.2, 3: 2.4, 5: 2.6})
    assert model.per_draft_token == pytest.approx(0.1) and model.fixed == pytest.approx(1.1)
    assert model.calibrated_at_k == [1, 5]
    assert model.cost(3) == pytest.approx(2.4)
    # Noise that makes the largest k look cheaper than the smallest cannot give a negative cost per token.
    assert fit_cost_model({1: 2.5, 5: 2.3}).per_draft_token == 0.0


def _measured(costs: dict[int, float], per_position: list[float]) -> dict[int, tuple[float, float, float]]:
    """k -> (median speed-up, slowest round, E_k) for a sweep whose step costs are `costs`."""
    out = {}
    for k, c in costs.items():
        e_k = tokens_per_step(per_position, k)
        out[k] = (e_k / c, e_k / c - 0.02, e_k)
    return out


def test_recommendation_picks_the_k_with_the_best_predicted_speedup():
    # c(k) = 1 + 0.5 + 0.3 k: speed-ups 1.05, 1.29, 1.42, 1.44, 1.40 (by hand from E_k = 1.9, 2.7, 3.4, 3.9, 4.2).
    costs = {k: 1.5 + 0.3 * k for k in range(1, 6)}
    rec = recommend(4, PER_POSITION, _measured(costs, PER_POSITION))
    assert rec.cost.fixed == pytest.approx(0.5) and rec.cost.per_draft_token == pytest.approx(0.3)
    assert rec.recommended_k == 4 and rec.measured_best_k == 4
    assert rec.verdict.startswith("agrees")
    assert rec.limit_speedup_by_k[5] == pytest.approx(4.2)
    assert "num_speculative_tokens: 4" in profile_setting([rec])


def test_recommendation_turns_speculation_off_where_it_loses():
    rec = recommend(16, PER_POSITION, _measured({1: 3.0, 5: 6.0}, PER_POSITION))
    assert rec.recommended_k is None and rec.measured_best_k is None
    assert max(rec.predicted_speedup_by_k.values()) < 1
    assert rec.verdict.startswith("agrees: off")
    assert "turn speculation off" in profile_setting([rec])


def test_recommendation_is_checked_against_the_sweep():
    # The model through k=1 and k=5 predicts k=4 best; the sweep measured k=3 a little faster, inside its noise.
    measured = _measured({1: 1.8, 5: 3.0}, PER_POSITION)
    measured[3] = (1.45, 1.30, 3.4)
    measured[4] = (1.40, 1.35, 3.9)
    rec = recommend(1, PER_POSITION, measured)
    assert rec.recommended_k == 4 and rec.measured_best_k == 3
    assert rec.verdict.startswith("within noise")
    measured[3] = (1.60, 1.55, 3.4)
    assert recommend(1, PER_POSITION, measured).verdict.startswith("disagrees")


def test_plans_fit_the_issue():
    assert FULL.ks == [1, 2, 3, 4, 5] and FULL.concurrency == [1, 4, 16] and FULL.repeats >= 5
    assert QUICK.repeats < FULL.repeats and QUICK.max_tokens < FULL.max_tokens
    assert FULL.requests_at(1) == FULL.requests_per_sample
    assert FULL.requests_at(16) == 16
    assert BenchPlan(**{**QUICK.model_dump(), "requests_per_sample": 5}).requests_at(4) == 8
    with pytest.raises(ValueError, match="at least one"):
        BenchPlan(**{**QUICK.model_dump(), "ks": []})


def test_prompts_file_errors_name_the_fix(tmp_path):
    with pytest.raises(BenchError, match="--prompts FILE"):
        load_prompts(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"prompt": "x"}))
    with pytest.raises(BenchError, match="JSON list"):
        load_prompts(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(["one two", "three"]))
    assert load_prompts(good) == ["one two", "three"]


def test_ceiling_candidates_are_the_predictable_prompts_then_a_repeated_phrase_of_each_prompt():
    predictable = json.loads(PREDICTABLE_PROMPTS_FILE.read_text())
    assert len(predictable) == 8 and all(p.strip() for p in predictable)
    out = ceiling_candidates(["a b c d e f g h", "x y"], 2)
    assert out == [*predictable, " ".join(["a b c d e f"] * 10), " ".join(["x y"] * 10)]


def test_the_ceiling_sends_every_prompt_near_the_best_acceptance_best_first():
    probes = [CeilingProbe(prompt=p, acceptance_rate=r, mean_acceptance_length=None)
              for p, r in (("a", 0.90), ("b", 0.99), ("c", 0.95), ("d", 0.93), ("e", None))]
    assert ceiling_prompts(probes) == ["b", "c"]
    assert ceiling_prompts(probes, tolerance=0.1) == ["b", "c", "d", "a"]
    assert ceiling_prompts(probes[4:]) == ["e"]  # no rate at all: still a workload to send


def _sample(steps: int, accepted: int, per_position: list[float]) -> Sample:
    acc = Acceptance(speculation="on", source="test", num_verify_steps=steps, num_draft_tokens=steps * 2,
                     num_accepted_tokens=accepted, per_position_acceptance_rate=per_position)
    return Sample(concurrency=1, requests=1, completion_tokens=10, seconds=1.0, client_cpu_s=0.1, token_ids=[],
                  acceptance=acc)


def test_acceptance_is_summed_over_samples_weighted_by_verify_steps():
    total = summed_acceptance([_sample(10, 15, [1.0, 0.5]), _sample(30, 15, [0.5, 0.0])])
    assert (total.verify_steps, total.accepted_tokens, total.draft_tokens) == (40, 30, 80)
    assert total.mean_acceptance_length == pytest.approx(1.75)
    assert total.per_position == pytest.approx([(10 + 15) / 40, 5 / 40])
    assert summed_acceptance([]) is None


def test_checks_overhead_reports_the_cost_against_the_noise():
    quiet = checks_overhead(3, 1, on=[100.0, 100.5, 99.5], off=[100.4, 100.2, 100.6])
    assert quiet.cost_percent == pytest.approx(0.4)
    assert "meets the 1% goal" in quiet.verdict and "inside the noise" in quiet.verdict
    costly = checks_overhead(3, 1, on=[90.0, 90.1, 89.9], off=[100.0, 100.1, 99.9])
    assert costly.cost_percent > 10 and "misses" in costly.verdict and "outside" in costly.verdict


def test_rss_sampler_sums_a_real_process_tree():
    child_code = "import subprocess, sys, time; b = bytearray(60 * 2**20); " \
                 "subprocess.Popen([sys.executable, '-c', 'import time; c = bytearray(40 * 2**20); time.sleep(30)']);" \
                 " time.sleep(30)"
    parent = subprocess.Popen([sys.executable, "-c", child_code])
    try:
        deadline = time.monotonic() + 20
        while len(psutil.Process(parent.pid).children()) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)
        sampler = RssSampler(parent.pid)
        sampler.sample()
    finally:
        for p in psutil.Process(parent.pid).children(recursive=True):
            p.kill()
        parent.kill()
        parent.wait()
    assert len(sampler.peak_by_process) == 2
    assert sampler.peak_total >= 100 * 2**20
    assert sampler.peak_total == pytest.approx(sum(sampler.peak_by_process.values()))


def _result() -> BenchResult:
    from kimi_eagle.bench.result import AcceptanceFigures

    def point(k: int, c: int, workload: str = "held-out") -> ThroughputPoint:
        return ThroughputPoint(workload=workload, num_speculative_tokens=k, concurrency=c, requests_per_sample=4,
                               plain_tokens_per_s=spread([100.0, 101.0]), spec_tokens_per_s=spread([150.0, 152.0]),
                               speedup_of_medians=1.5, paired_speedup=spread([1.49, 1.51]),
                               acceptance=AcceptanceFigures(verify_steps=10, draft_tokens=10 * k, accepted_tokens=9,
                                                            mean_acceptance_length=1.9, acceptance_rate=0.9,
                                                            per_position=PER_POSITION[:k]),
                               identical_outputs=[4, 4] if c == 1 else None)

    points = [point(k, c) for k in (1, 2) for c in (1, 16)] + [point(2, 1, "ceiling")]
    return BenchResult(
        mode="quick", command="kimi-eagle bench speedup --quick", started_utc="2026-11-30T02:00:00Z", duration_s=100.0,
        machine=Machine(cpu_model="Test CPU", cpus=2, memory_gib=23.4, load_average_before=[1.0, 1.0, 1.0],
                        load_average_after=[2.0, 1.0, 1.0], vllm_version="0.32.0", torch_version="2.13"),
        profile="tiny-cpu", target="t", draft="d", prompts_file="p.json", plan=QUICK, ceiling_prompt="a a a",
        ceiling_probes=[], throughput=points,
        cold_starts=[ColdStart(config="plain", draft=False, num_speculative_tokens=None, seconds_to_healthy=40.0,
                               seconds_to_first_token=41.0, peak_rss_bytes=5 * 2**30)],
        checks=[], harness=None,
        recommendations=[recommend(c, PER_POSITION[:2], {1: (1.4, 1.3, 1.9), 2: (1.5, 1.49, 2.7)}) for c in (1, 16)])


def test_markdown_report_has_every_section_and_the_command():
    text = markdown(_result())
    assert "Command: `kimi-eagle bench speedup --quick`" in text and "Test CPU, 2 CPUs" in text
    for n in range(1, 8):
        assert f"## {n}." in text
    assert "| 2 | 1 | 100.5 [100.0, 101.0] | 151.0 [150.0, 152.0] | 1.50x [1.49, 1.51] | 1.90 | 4/4 |" in text
    assert "Not measured in this run" in text
    assert "num_speculative_tokens: 2" in text
    assert BenchResult.model_validate_json(_result().model_dump_json(by_alias=True)).mode == "quick"


def test_cli_refuses_missing_prompts_and_vllm_flags(tmp_path, capsys):
    assert main(["bench", "speedup", "--quick", "--prompts", str(tmp_path / "none.json"), "--out",
                 str(tmp_path)]) == 2
    assert "no held-out prompts" in capsys.readouterr().err
    assert main(["bench", "speedup", "--quick", "--", "--max-num-seqs", "4"]) == 2
    assert "no vLLM flags" in capsys.readouterr().err
    assert main(["bench", "speedup", "--profile", "no-such-profile"]) == 2
    assert "known profiles" in capsys.readouterr().err



def test_the_bench_client_sends_the_api_key_serve_protects_the_server_with(sglang_recordings: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`kimi-eagle serve` takes VLLM_API_KEY from the environment, on loopback too: every bench mode's requests
    carry it (they got 401 before), and a server that wants another key is a request error that says so."""
    stand_in = StandIn(sglang_recordings, line_delay_s=0, key="bench-key")  # its recorded stream: 16 tokens
    try:
        monkeypatch.setenv("VLLM_API_KEY", "bench-key")
        assert BenchClient(stand_in.url, "m", 16, stream=True).complete("x").completion_tokens == 16
        monkeypatch.setenv("VLLM_API_KEY", "another-key")
        with pytest.raises(BenchRequestError, match="HTTP 401"):
            BenchClient(stand_in.url, "m", 16, stream=True).complete("x")
    finally:
        stand_in.close()
    assert stand_in.authorizations == ["Bearer bench-key", "Bearer another-key"]
