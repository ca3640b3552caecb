"""`kimi-eagle bench configs` without an engine: the served variants, the judgement and the report (the e2e run
is tests/e2e/test_bench.py)."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from itertools import pairwise

import pytest

from kimi_eagle.bench import bypass, configs, startup
from kimi_eagle.bench.configs import (
    BIND_ENV,
    FULL,
    MATRIX,
    QUICK,
    ConfigPoint,
    ConfigsResult,
    ConfigStart,
    ServingConfig,
    compare,
    judge,
    markdown,
)
from kimi_eagle.bench.plan import rotated
from kimi_eagle.bench.result import Machine
from kimi_eagle.bench.stats import spread
from kimi_eagle.bench.subcommand import plan_of
from kimi_eagle.cli import main
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.profile import load_profile
from kimi_eagle.serve.validate import validate_with_vllm


def test_the_matrix_is_every_dtype_core_layout_and_draft_once() -> None:
    assert len(MATRIX) == len({c.name for c in MATRIX}) == 16
    assert {(c.dtype, c.cores, c.draft) for c in MATRIX} == {
        (d, c, s) for d in ("float32", "bfloat16") for c in ("bound", "vllm-default", "vllm-floating", "in-process")
        for s in (False, True)}
    assert QUICK.configs == [c for c in MATRIX if c.dtype == "bfloat16" and c.cores == "in-process"]


def test_float32_bound_pins_the_reference_kernel_and_every_core() -> None:
    base = load_profile("tiny-cpu")
    profile = ServingConfig(dtype="float32", cores="bound", draft=True).profile(base)
    assert profile.vllm_args["dtype"] == "float32" and profile.vllm_args["attention-backend"] == "CPU_MLA"
    assert profile.env["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert profile.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    # what the configuration does not name stays the profile's
    for flag in ("kv-cache-memory-bytes", "max-num-seqs", "max-model-len"):
        assert profile.vllm_args[flag] == base.vllm_args[flag]
    assert base.vllm_args["dtype"] == "bfloat16"  # the base is copied, never changed


def test_bfloat16_in_vllms_layout_leaves_kernel_and_cores_to_vllm() -> None:
    exact = load_profile("tiny-cpu-exact")  # float32, CPU_MLA, the worker inside the engine core
    profile = ServingConfig(dtype="bfloat16", cores="vllm-default", draft=False).profile(exact)
    assert profile.vllm_args["dtype"] == "bfloat16" and "attention-backend" not in profile.vllm_args
    assert not set(BIND_ENV) & set(profile.env)
    assert profile.env["VLLM_MAX_N_SEQUENCES"] == exact.env["VLLM_MAX_N_SEQUENCES"]


def test_the_floating_layout_is_vllms_own_and_the_default_pins_the_engine_core() -> None:
    base = load_profile("tiny-cpu")
    floating = ServingConfig(dtype="bfloat16", cores="vllm-floating", draft=True).profile(base)
    assert floating.env["KIMI_EAGLE_CPU_LAYOUT"] == "vllm" and not set(BIND_ENV) & set(floating.env)
    default = ServingConfig(dtype="bfloat16", cores="vllm-default", draft=True).profile(base)
    assert "KIMI_EAGLE_CPU_LAYOUT" not in default.env  # the plugin's default: the engine core on the worker's cores


@pytest.mark.parametrize("config", MATRIX, ids=lambda c: c.name)
def test_every_configuration_is_a_command_vllm_accepts(config: ServingConfig) -> None:
    validate_with_vllm(build_command(config.profile(load_profile("tiny-cpu")), no_draft=not config.draft))


def test_in_process_is_vllms_uniprocess_executor_and_every_other_layout_drops_it() -> None:
    base = load_profile("tiny-cpu")
    in_process = ServingConfig(dtype="bfloat16", cores="in-process", draft=True).profile(base)
    assert in_process.vllm_args["distributed-executor-backend"] == "uni"
    assert in_process.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and not set(BIND_ENV) & set(in_process.env)
    for cores in ("bound", "vllm-default", "vllm-floating"):
        other = ServingConfig(dtype="bfloat16", cores=cores, draft=True).profile(base)
        assert "distributed-executor-backend" not in other.vllm_args
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in other.env


def test_the_default_profile_is_the_configuration_the_benchmark_chose() -> None:
    """tiny-cpu is what `bench configs` found fastest with a draft (BENCHMARKS.md): bfloat16, the worker inside
    the engine core process."""
    default = load_profile("tiny-cpu")
    chosen = ServingConfig(dtype="bfloat16", cores="in-process", draft=True).profile(default)
    assert (default.vllm_args, default.env) == (chosen.vllm_args, chosen.env)
    assert default.draft is not None


def test_rounds_rotate_the_order_so_drift_spreads_over_every_configuration() -> None:
    firsts = [rotated(MATRIX, r)[0] for r in range(1, len(MATRIX) + 1)]
    assert firsts == MATRIX
    assert sorted(c.name for c in rotated(MATRIX, 3)) == sorted(c.name for c in MATRIX)


@pytest.mark.parametrize("n", [2, 3])
def test_every_item_runs_right_after_every_other_equally_often_over_2n_rounds(n: int) -> None:
    items = list(range(n))
    orders = [rotated(items, r) for r in range(1, 2 * n + 1)]
    follows = Counter(pair for order in orders for pair in pairwise(order))
    assert set(follows) == {(a, b) for a in items for b in items if a != b}, orders
    assert len(set(follows.values())) == 1, f"unbalanced: {dict(follows)} from {orders}"
    assert Counter(order[0] for order in orders) == dict.fromkeys(items, 2), orders


def _point(config: str, load: str, values: list[float], ratios: list[float] | None = None) -> ConfigPoint:
    return ConfigPoint(config=config, load=load, per_round=values, tokens_per_s=spread(values),
                       ratio_to_fastest_without_draft=spread(ratios) if ratios else None)


def test_a_draft_is_paired_with_the_fastest_plain_configuration_by_median_not_each_rounds_best() -> None:
    """The best of several noisy samples in a round is biased upwards; one configuration, chosen by its median, is
    not."""
    alone_bound, draft_bound, alone_default = MATRIX[:3]
    plan = QUICK.model_copy(update={"configs": [alone_bound, alone_default, draft_bound], "rounds": 3,
                                    "points": QUICK.points[:1]})
    load = plan.points[0].name
    plain_a, plain_b, draft = alone_bound.name, alone_default.name, draft_bound.name
    samples = {(plain_a, load): [100.0, 100.0, 100.0], (plain_b, load): [90.0, 130.0, 95.0],
               (draft, load): [120.0, 120.0, 120.0]}
    [a, b, d] = compare(plan, samples)
    assert (a.compared_with, b.compared_with, d.compared_with) == (None, None, plain_a)  # medians 100 vs 95
    assert d.per_round == [120.0, 120.0, 120.0] and d.ratio_to_fastest_without_draft.median == pytest.approx(1.2)


def test_judge_picks_the_best_worst_case_and_names_each_missed_goal() -> None:
    one, many = (p.name for p in FULL.points[:2])  # streamed, 1 and 4 in flight
    points = [_point("plain", one, [100.0]), _point("A", one, [180.0], [1.8]), _point("A", many, [300.0], [0.9]),
              _point("B", one, [130.0], [1.3]), _point("B", many, [400.0], [1.25])]
    fastest, verdict = judge(points, FULL)
    assert fastest == "B"  # A is faster on one stream, but loses under load
    assert "worst ratio 1.25x" in verdict and f"{one}: 1.30x (goal 1.5x)" in verdict and many not in verdict
    assert judge([_point("plain", one, [100.0])], FULL) == (None, "no draft configuration was measured")


def test_the_report_is_one_row_per_configuration_with_ratios_for_drafts() -> None:
    loads = [p.name for p in QUICK.points]
    plain, draft = (c.name for c in QUICK.configs)
    points = [_point(plain, loads[0], [100.0]), _point(draft, loads[0], [150.0], [1.5]),
              _point(plain, loads[1], [400.0, 420.0]), _point(draft, loads[1], [500.0, 520.0], [1.25, 1.24])]
    result = ConfigsResult(
        command="kimi-eagle bench configs --quick", started_utc="2026-12-01T00:00:00Z", duration_s=120,
        machine=Machine(cpu_model="cpu", cpus=2, memory_gib=24, load_average_before=[0, 0, 0],
                        load_average_after=[0, 0, 0], vllm_version="0.32.0", torch_version="2.13.0"),
        profile="tiny-cpu", plan=QUICK, points=points, mean_acceptance_length={draft: 2.61},
        starts=[ConfigStart(config=plain, round=1, seconds_to_healthy=31.2, peak_rss_bytes=None),
                ConfigStart(config=draft, round=1, seconds_to_healthy=40.7, peak_rss_bytes=None)],
        fastest=draft, verdict="fastest with a draft: ...")
    text = markdown(result)
    assert f"| {plain} | 100 [100-100] | 410 [400-420] | 31-31 |" in text
    assert f"| {draft} | 150 [150-150] **1.50x** | 510 [500-520] **1.25x** | 41-41 |" in text
    assert f"{draft}: 2.61" in text and "**fastest with a draft: ....**" in text


def test_rounds_go_with_the_modes_that_have_rounds(capsys: pytest.CaptureFixture[str]) -> None:
    for mode in ("speedup", "tune", "guidellm"):
        with pytest.raises(SystemExit) as refused:
            main(["bench", mode, "--rounds", "2"])
        assert refused.value.code == 2 and "unrecognized arguments: --rounds 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main(["bench", "configs", "--rounds", "0"])
    assert refused.value.code == 2 and "give a whole number of rounds, 1 or more" in capsys.readouterr().err
    for module in (configs, bypass, startup):
        for quick in (False, True):
            plan = plan_of(module.FULL, module.QUICK, argparse.Namespace(quick=quick, rounds=5))
            assert plan.rounds == 5 and plan.mode == (module.QUICK if quick else module.FULL).mode
    assert plan_of(bypass.FULL, bypass.QUICK, argparse.Namespace(quick=False, rounds=None)) == bypass.FULL
