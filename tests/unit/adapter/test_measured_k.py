"""The measured k on a simulated engine: each k of a batch-size range produces tokens at a rate of its own, and the
controller must find the fastest, within its probe budget, without flapping between equals."""

from __future__ import annotations

import random

import pytest

from kimi_eagle.adapter import measured_k
from kimi_eagle.adapter.measured_k import MeasuredK, batch_ranges, candidate_ks, decode_step


def test_ranges_and_candidates() -> None:
    assert batch_ranges(16) == [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16)]
    assert batch_ranges(6)[-1] == (5, 6)
    assert candidate_ks(4) == [0, 1, 2, 4] and candidate_ks(8) == [0, 1, 2, 4, 8] and candidate_ks(1) == [0, 1]


def run(controller: MeasuredK, batch: int, tokens_per_s: dict[int, float], steps: int, noise: float = 0.02,
        seed: int = 0) -> list[int]:
    """Steps of `batch` requests: the k the lookup gives for the batch is drafted, verified in the next step (the
    first step after a change verifies the old k, as in vLLM), and each step's time follows from its k's rate."""
    rng = random.Random(seed)
    ks_in_force, verified = [], controller.lookup[batch]
    for _ in range(steps):
        scheduled = controller.lookup[batch]
        tokens = batch * (1 + verified)
        seconds = tokens / tokens_per_s[verified] * (1 + rng.uniform(-noise, noise))
        controller.observe(batch, verified, scheduled, tokens, seconds)
        ks_in_force.append(controller.ranges[[r.low <= batch <= r.high for r in controller.ranges].index(True)]
                           .in_force)
        verified = scheduled
    return ks_in_force


def lookup(k_low: int, k_high: int) -> list[int]:
    """The default profile's shape: k_low up to 8 in flight, k_high above."""
    return [0] + [k_low] * 8 + [k_high] * 8


def test_a_k_that_costs_is_replaced_by_the_fastest() -> None:
    controller = MeasuredK(lookup(4, 4), 16, [0, 1, 2, 4], probe_share=0.1)
    # At 4 in flight on an AVX2-only EPYC (issue 64): the target alone 379 tokens/s, k=1 340, k=4 271.
    in_force = run(controller, 4, {0: 379.0, 1: 340.0, 2: 300.0, 4: 271.0}, 1500)
    assert in_force[0] == 4 and in_force[-1] == 0
    r = controller.ranges[2]
    assert r.probe_total <= 0.1 * r.steps + measured_k.PROBE_STEPS
    assert controller.lookup[3:5] == [0, 0] and controller.lookup[1] == 4 and controller.lookup[16] == 4


def test_the_profiles_k_stays_where_it_is_fastest_and_equals_do_not_flap() -> None:
    controller = MeasuredK(lookup(4, 0), 16, [0, 1, 2, 4], probe_share=0.1)
    assert set(run(controller, 1, {0: 170.0, 1: 183.0, 2: 181.0, 4: 178.0}, 2000, noise=0.03)) <= {4, 1, 2}
    steady = MeasuredK(lookup(4, 0), 16, [0, 1, 2, 4], probe_share=0.1)
    assert set(run(steady, 1, {0: 100.0, 1: 200.0, 2: 200.0, 4: 200.0}, 2000, noise=0.03)) == {4}


def test_a_range_with_too_few_steps_keeps_the_profiles_k_and_says_so() -> None:
    controller = MeasuredK(lookup(4, 0), 16, [0, 1, 2, 4], probe_share=0.1)
    run(controller, 12, {0: 500.0, 1: 600.0, 2: 700.0, 4: 800.0}, 5)
    assert controller.lookup[12] == 0
    assert "9-16: k=0, the profile's (too few steps measured" in controller.summary()


@pytest.mark.parametrize("share", [0.05, 0.2])
def test_probes_stay_within_their_share(share: float) -> None:
    controller = MeasuredK(lookup(4, 4), 16, [0, 1, 2, 4], probe_share=share)
    run(controller, 2, {0: 200.0, 1: 210.0, 2: 220.0, 4: 230.0}, 3000)
    r = controller.ranges[1]
    assert 0 < r.probe_total <= share * r.steps + measured_k.PROBE_STEPS


class _Output:
    def __init__(self, tokens: dict[str, int], spec: dict[str, list[int]], k: int, new: bool = False) -> None:
        self.num_scheduled_tokens = tokens
        self.scheduled_spec_decode_tokens = spec
        self.total_num_scheduled_tokens = sum(tokens.values())
        self.scheduled_new_reqs = [object()] if new else []
        self.num_spec_tokens_to_schedule = k


def test_only_uniform_decode_steps_are_measured() -> None:
    step = decode_step(_Output({"a": 3, "b": 3}, {"a": [1, 2], "b": [3, 4]}, 2), 1.0)
    assert (step.batch_size, step.verified_k, step.scheduled_k) == (2, 2, 2)
    assert decode_step(_Output({"a": 1, "b": 1}, {}, 0), 1.0).verified_k == 0
    assert decode_step(_Output({"a": 3, "b": 2}, {"a": [1, 2], "b": [3]}, 2), 1.0) is None  # mixed drafts
    assert decode_step(_Output({"a": 40, "b": 1}, {}, 2), 1.0) is None  # a prefill chunk
    assert decode_step(_Output({"a": 1}, {}, 2, new=True), 1.0) is None
