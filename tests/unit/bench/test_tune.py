"""`bench tune`'s arithmetic: the best k by concurrency, the schedule made of it, and the proof's verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_eagle.bench.stats import spread
from kimi_eagle.bench.tune import (
    FULL,
    QUICK,
    TuneBench,
    TunePoint,
    TuneResult,
    after_proof,
    best_k_by_concurrency,
    boundary,
    judge_proof,
    profile_setting,
    schedule_from,
    verdict,
)
from kimi_eagle.serve.profile import load_profile


def point(config: str, c: int, *tps: float) -> TunePoint:
    return TunePoint(config=config, concurrency=c, per_round=list(tps), tokens_per_s=spread(list(tps)))


def test_the_best_k_is_the_highest_median_and_zero_where_the_target_alone_wins() -> None:
    points = [point("alone", 1, 300, 310), point("k=2", 1, 380, 390), point("k=4", 1, 400, 395),
              point("alone", 16, 1000, 1010), point("k=2", 16, 900, 990), point("k=4", 16, 700, 720)]
    assert best_k_by_concurrency(points) == {1: 4, 16: 0}


def test_a_k_that_ties_the_best_within_the_noise_band_is_kept_from_the_concurrency_below() -> None:
    points = [point("k=3", 1, 370, 380), point("k=4", 1, 360, 366),
              point("k=3", 4, 1059, 1088), point("k=4", 4, 1076, 1078),  # k=4 ahead by 0.3%, band 1.4%
              point("alone", 16, 2120, 2382), point("k=3", 16, 2009, 2163)]  # k=3 7% behind, band 5.8%
    assert best_k_by_concurrency(points) == {1: 3, 4: 3, 16: 0}
    points[3] = point("k=4", 4, 1200, 1210)  # ahead beyond the band: the best wins
    assert best_k_by_concurrency(points) == {1: 3, 4: 4, 16: 0}


def test_each_concurrency_covers_the_batch_sizes_up_to_it_and_equal_neighbours_merge() -> None:
    assert schedule_from({1: 4, 2: 3, 4: 3, 8: 0, 16: 0}, max_num_seqs=16) == [(1, 1, 4), (2, 4, 3), (5, 16, 0)]
    assert schedule_from({1: 3, 4: 2}, max_num_seqs=32) == [(1, 1, 3), (2, 32, 2)]  # the last range to max-num-seqs


def test_no_schedule_when_speculation_never_pays() -> None:
    assert schedule_from({1: 0, 4: 0}, max_num_seqs=16) is None


def test_the_crossing_straddles_a_boundary_of_the_schedule_between_two_loads_of_the_sweep() -> None:
    assert boundary([(1, 1, 4), (2, 4, 3), (5, 16, 0)], [1, 2, 4, 8, 16]) == (4, 8)  # where speculation turns off
    assert boundary([(1, 1, 4), (2, 16, 3)], [1, 2, 4, 8, 16]) == (1, 2)
    assert boundary([(1, 16, 3)], [1, 4, 16]) is None


def test_the_proof_holds_within_the_noise_band_and_fails_outside_it() -> None:
    points = [point("alone", 1, 300, 300), point("k=4", 1, 400, 420), point("tuned", 1, 405, 395),
              point("alone", 16, 1000, 1000), point("k=4", 16, 700, 700), point("tuned", 16, 800, 810)]
    at_1, at_16 = judge_proof(points)
    assert at_1.best_other == "k=4" and at_1.holds  # 400 vs 410: inside the +/-2.4% band
    assert at_16.best_other == "alone" and not at_16.holds and round(at_16.ratio, 3) == 0.805


def test_where_the_proof_finds_the_tuned_schedule_behind_its_fastest_configuration_takes_over() -> None:
    # The 2026-12-01 21:48 run: one slow round of the target alone at 16 in flight in the sweep (1,754 against 2,169
    # tok/s) made k=4 look best there; the proof's four rounds gave the target alone 2,179-2,457, k=4 2,041-2,093.
    best_k = {1: 4, 2: 4, 4: 4, 8: 4, 16: 4}
    proof = judge_proof([point("alone", 1, 254, 265, 265, 272), point("k=4", 1, 345, 352, 352, 366),
                         point("tuned", 1, 308, 354, 354, 369),
                         point("alone", 16, 2179, 2235, 2322, 2457), point("k=4", 16, 2041, 2043, 2044, 2093),
                         point("tuned", 16, 1918, 1954, 1963, 2111)])
    assert [p.holds for p in proof] == [True, False]
    corrected = after_proof(best_k, proof, max_num_seqs=16)
    assert corrected == [(1, 8, 4), (9, 16, 0)]
    result = TuneResult.model_construct(schedule=[(1, 16, 4)], schedule_after_proof=corrected)
    assert "num_speculative_tokens_per_batch_size: [[1, 8, 4], [9, 16, 0]]" in profile_setting(result)
    assert "after the proof: [[1, 8, 4], [9, 16, 0]]" in verdict([(1, 16, 4)], proof, None, corrected)


def test_a_proof_that_holds_leaves_the_sweeps_schedule_and_one_that_fails_everywhere_turns_the_draft_off() -> None:
    held = judge_proof([point("alone", 1, 300, 300), point("k=4", 1, 400, 420), point("tuned", 1, 405, 395)])
    assert after_proof({1: 4}, held, max_num_seqs=16) is None
    assert "num_speculative_tokens_per_batch_size: [[1, 16, 4]]" in profile_setting(
        TuneResult.model_construct(schedule=[(1, 16, 4)], schedule_after_proof=None))
    lost = judge_proof([point("alone", 1, 400, 400), point("k=4", 1, 300, 300), point("tuned", 1, 300, 300)])
    assert after_proof({1: 4}, lost, max_num_seqs=16) == []
    assert profile_setting(TuneResult.model_construct(schedule=[(1, 16, 4)], schedule_after_proof=[])).startswith(
        "# no schedule")


@pytest.mark.parametrize(("plan", "proof_servers"), [(FULL, ["alone", "k=3", "tuned"] * FULL.proof_rounds),
                                                     (QUICK, ["tuned"])])
def test_the_proof_starts_every_configuration_again_except_in_a_quick_run(
        plan, proof_servers: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which servers each phase starts; what a start measures is the e2e test's (tests/e2e/test_bench.py). Here k=3
    wins at every load, so the proof is of `alone`, k=3 and the tuned schedule."""
    plan = plan.model_copy(update={"ks": [3], "concurrency": [1, 4]})
    started: list[str] = []

    def measure(self, config, schedule, samples, round_of, crossing):
        started.append(config)
        for c in self.concurrency:
            samples.setdefault((config, c), []).append(100.0 if config == "alone" else 150.0)

    monkeypatch.setattr(TuneBench, "_measure", measure)
    bench = TuneBench(plan, load_profile("tiny-cpu-exact"), target=None, draft=None, prompts=["x"],
                      files_dir=tmp_path, command_line="kimi-eagle bench tune", say=lambda _: None)
    result = bench.run()
    sweep_servers = ["alone", "k=3"] * plan.rounds
    assert sorted(started) == sorted(sweep_servers + proof_servers), f"servers started: {started}"
    assert {p.config for p in result.proof} == {"alone", "k=3", "tuned"}
    assert all(p.holds for p in result.proof_points), result.proof_points
