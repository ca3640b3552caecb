"""The measured k on a simulated engine: each k of a batch-size range produces tokens at a rate of its own, and the
controller must find the fastest, within its probe budget, without flapping between equals."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from kimi_eagle.adapter import measured_k
from kimi_eagle.adapter.measured_k import MeasuredK, batch_ranges, candidate_ks, decode_step


def test_ranges_and_candidates() -> None:
    assert batch_ranges(16) == [(1, 1), (2, 2), (3, 4), (5, 8), (9, 16)]
    assert batch_ranges(6)[-1] == (5, 6)
    assert candidate_ks(4) == [0, 1, 2, 4] and candidate_ks(8) == [0, 1, 2, 4, 8] and candidate_ks(1) == [0, 1]


def expected_tokens(alpha: float, k: int) -> float:
    return 1 + sum(alpha ** j for j in range(1, k + 1))


def run(controller: MeasuredK, batch: int, seconds_per_request: dict[int, float], steps: int, alpha: float = 0.7,
        noise: float = 0.03, drift: float = 0.0, seed: int = 0) -> list[int]:
    """Steps of `batch` requests: the k the lookup gives for the batch is drafted and verified in the next step (the
    first step after a change verifies the old k, as in vLLM); each draft token is accepted with probability `alpha`
    while the ones before it were, and a step's time is its k's seconds per request times the batch, with noise and a
    slow drift of the whole machine's speed (other load coming and going)."""
    rng = random.Random(seed)
    ks_in_force, verified = [], controller.lookup[batch]
    choice = next(r for r in controller.ranges if r.low <= batch <= r.high)
    for step in range(steps):
        scheduled = controller.lookup[batch]
        for _ in range(batch if verified else 0):
            accepted = 0
            while accepted < verified and rng.random() < alpha:
                accepted += 1
            controller.count_draft(verified, accepted)
        speed = 1 + drift * math.sin(step / 150)
        seconds = batch * seconds_per_request[verified] * speed * (1 + rng.uniform(-noise, noise))
        controller.observe(batch, verified, scheduled, seconds)
        ks_in_force.append(choice.in_force)
        verified = scheduled
    return ks_in_force


def lookup(k_low: int, k_high: int) -> list[int]:
    """The default profile's shape: k_low up to 8 in flight, k_high above."""
    return [0] + [k_low] * 8 + [k_high] * 8


# Seconds per request of a step at k = 0, 1, 2, 4, shaped after issue 64's AVX2-only EPYC at 4 in flight, where
# the target alone was fastest, and after a machine where drafting pays.
DRAFTING_COSTS = {0: 1.0, 1: 1.8, 2: 2.3, 4: 3.2}
DRAFTING_PAYS = {0: 1.0, 1: 1.2, 2: 1.4, 4: 1.8}


def test_a_k_that_costs_is_replaced_by_the_fastest() -> None:
    controller = MeasuredK(lookup(4, 4), 16, [0, 1, 2, 4], probe_share=0.1)
    in_force = run(controller, 4, DRAFTING_COSTS, 1500, alpha=0.6)
    assert in_force[0] == 4 and in_force[-1] == 0
    switches = [(a, b) for a, b in itertools.pairwise(in_force) if a != b]
    assert len(switches) <= 2 and switches[-1] == (switches[-1][0], 0), switches  # no way back: it does not flap
    r = controller.ranges[2]
    assert r.probe_total <= 0.1 * r.steps + measured_k.PROBE_STEPS
    assert controller.lookup[3:5] == [0, 0] and controller.lookup[1] == 4 and controller.lookup[16] == 4


def test_the_profiles_k_stays_where_it_is_fastest_and_equals_do_not_flap() -> None:
    best = [expected_tokens(0.8, k) / DRAFTING_PAYS[k] for k in (0, 1, 2, 4)]
    assert max(best) == best[-1]
    assert set(run(MeasuredK(lookup(4, 0), 16, [0, 1, 2, 4], probe_share=0.1), 1, DRAFTING_PAYS, 3000,
                   alpha=0.8)) == {4}
    # k = 1, 2 and 4 equally fast (alpha 1: every draft token accepted, each costing its share): no switch.
    equal = {0: 0.5, 1: 1.0, 2: 1.5, 4: 2.5}
    assert set(run(MeasuredK(lookup(4, 0), 16, [0, 1, 2, 4], probe_share=0.1), 1, equal, 3000, alpha=1.0)) == {4}


@pytest.mark.parametrize("seed", range(5))
def test_noise_and_drift_do_not_make_it_flap(seed: int) -> None:
    """k = 2 and 4 within 3% of each other, steps 15% noisy, the machine's speed drifting by 30%: it never switches
    on a lucky probe."""
    close = {0: 1.0, 1: 1.25, 2: 1.5, 4: 2.1}  # alpha 0.8: k=4 1.60, k=2 1.63, k=1 1.44 tokens per unit time
    in_force = run(MeasuredK(lookup(4, 0), 16, [0, 1, 2, 4], probe_share=0.1), 1, close, 4000, alpha=0.8,
                   noise=0.15, drift=0.3, seed=seed)
    switches = [(a, b) for a, b in itertools.pairwise(in_force) if a != b]
    assert len(switches) <= 1, switches


def test_a_range_with_too_few_steps_keeps_the_profiles_k_and_says_so() -> None:
    controller = MeasuredK(lookup(4, 0), 16, [0, 1, 2, 4], probe_share=0.1)
    run(controller, 12, DRAFTING_PAYS, 5)
    assert controller.lookup[12] == 0
    assert "9-16: k=0, the profile's (too few probes yet" in controller.summary()


@pytest.mark.parametrize("share", [0.05, 0.2])
def test_probes_stay_within_their_share(share: float) -> None:
    controller = MeasuredK(lookup(4, 4), 16, [0, 1, 2, 4], probe_share=share)
    run(controller, 2, DRAFTING_PAYS, 3000)
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
