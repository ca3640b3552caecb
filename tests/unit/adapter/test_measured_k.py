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
    r = controller.ranges[2]  # what probes cost in time stays within the share (probing a cheaper k costs nothing)
    assert r.probe_charge <= 0.1 * r.seconds + measured_k.PROBE_STEPS * 4 * 3.2 * 1.03 * measured_k.SLOWER_BACKOFF
    # Below the measured range the profile's k stays; above it, where nothing was measured, k takes no more.
    assert controller.lookup[3:5] == [0, 0] and controller.lookup[1:3] == [4, 4] and controller.lookup[5:] == [0] * 12


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


def test_a_range_not_measured_yet_takes_no_more_k_than_the_measured_range_below_it() -> None:
    """A load passes through batch sizes it does not stay at (2 while streams start, 5-8 while sixteen end): those
    ranges, too few probes of their own, follow the measured ranges around them (k does not grow with the batch
    size) rather than keep a k their neighbours found dear; a range's own probes still decide for it."""
    controller = MeasuredK(lookup(4, 4), 16, [0, 1, 2, 4], probe_share=0.05)
    run(controller, 1, DRAFTING_COSTS_MUCH, 600)
    assert controller.lookup[1:] == [0] * 16
    assert controller.ranges[1].summary().startswith("2: k=0, as 1 in flight measured (too few probes of its own yet")
    assert not any(r.measured for r in controller.ranges[1:])
    run(controller, 4, DRAFTING_PAYS, 1500, alpha=0.8)  # at 3-4 in flight drafting pays: its own probes say so
    mine = controller.ranges[2]
    assert mine.measured and mine.in_force > 0
    assert controller.lookup[5:] == [mine.in_force] * 12, "above it, no more than it measured"
    assert controller.lookup[2] == 4, "between 1 (k=0) and 3-4 (k>0), against the rule: the profile's k"


@pytest.mark.parametrize("share", [0.05, 0.2])
@pytest.mark.parametrize("costs", [DRAFTING_PAYS, DRAFTING_COSTS])
def test_what_probes_cost_stays_within_its_share_of_the_time(share: float, costs: dict[int, float]) -> None:
    controller = MeasuredK(lookup(4, 4), 16, [0, 1, 2, 4], probe_share=share)
    run(controller, 2, costs, 3000)
    r = controller.ranges[1]
    one_probe = measured_k.PROBE_STEPS * 2 * max(costs.values()) * 1.03 * measured_k.SLOWER_BACKOFF
    assert 0 < r.probe_charge <= share * r.seconds + one_probe and r.probe_total > 0


def test_where_the_k_in_force_is_the_dear_one_the_way_back_is_fast() -> None:
    """From k = 4 where it costs 13 times a plain step, probing the cheaper ks costs nothing: the target alone is
    found within a few hundred steps, at the default 5% share."""
    controller = MeasuredK(lookup(4, 4), 16, [0, 1, 2, 4], probe_share=0.05)
    ks = run(controller, 1, DRAFTING_COSTS_MUCH, 600)
    assert ks[-1] == 0 and ks.index(0) < 400, ks.index(0) if 0 in ks else ks[-10:]


# Where drafting costs far more than a plain step (a slow draft, or a CPU whose verification is dear): per request,
# k = 4 takes 13 times the target alone's step, as the `slow-draft` fault makes it on the tiny pair at one stream.
DRAFTING_COSTS_MUCH = {0: 1.0, 1: 4.0, 2: 7.0, 4: 13.0}


def test_where_drafting_costs_much_the_probes_cost_little() -> None:
    """Once the target alone is in force, probing the ks that cost 4-13x a step takes a small share of the time:
    the surely slower are probed SLOWER_BACKOFF times less often. The run's tokens per second stays within 2% of
    the target alone's."""
    controller = MeasuredK(lookup(4, 4), 16, [0, 1, 2, 4], probe_share=0.05)
    run(controller, 1, DRAFTING_COSTS_MUCH, 1000)
    r = controller.ranges[0]
    assert r.in_force == 0
    settled_seconds, settled_probe = r.seconds, r.probe_seconds
    run(controller, 1, DRAFTING_COSTS_MUCH, 20000)
    probe_share = (r.probe_seconds - settled_probe) / (r.seconds - settled_seconds)
    assert r.in_force == 0 and 0 < probe_share < 0.02, probe_share


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


def test_the_report_reaches_the_api_servers_gauges_through_vllms_own_serialization() -> None:
    """The engine core's state crosses to the API server inside a spec-decoding record, encoded and decoded by vLLM's
    own msgpack codec for `EngineCoreOutputs` (typed: anything outside the record's fields would be dropped), and
    becomes `/metrics` series; vLLM's own per-position counts are unchanged by it."""
    from prometheus_client import REGISTRY, generate_latest
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    controller = MeasuredK(lookup(4, 0), 16, [0, 1, 2, 4], probe_share=0.3)
    run(controller, 2, DRAFTING_COSTS, 1500)
    sent = controller.report()
    record = SpecDecodingStats.new(4)
    record.observe_draft(4, 2)
    measured_k.attach_report(record, sent)
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(spec_decoding_stats=record))
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    record = received.scheduler_stats.spec_decoding_stats
    got = measured_k.read_report(record)
    assert [(r.batch_sizes, r.k, r.configured, r.steps, r.probes) for r in got] == \
        [(r.batch_sizes, r.k, r.configured, r.steps, r.probes) for r in sent]
    for mine, theirs in zip(got, sent, strict=True):  # ratios travel in thousandths
        assert mine.speed_ratio == pytest.approx(theirs.speed_ratio, abs=5e-4)
    assert record.num_accepted_tokens_per_pos == [1, 1, 0, 0] and record.num_draft_tokens_per_pos[:4] == [1] * 4
    two = next(r for r in got if r.batch_sizes == "2")
    assert two.k == 0 and two.configured == 4 and two.steps > 0 and set(two.probes) == {1, 2, 4}
    assert all(0 < ratio < 1 for ratio in two.speed_ratio.values())  # every draft k is slower than the target alone
    assert measured_k.read_report(SpecDecodingStats.new(4)) is None  # vLLM's own records carry none

    gauges = measured_k.Gauges()
    try:
        gauges.set(measured_k.read_report(record))
        text = generate_latest(REGISTRY).decode()
        assert 'kimi_eagle:measured_k{batch_sizes="2"} 0.0' in text
        assert 'kimi_eagle:measured_k_configured{batch_sizes="2"} 4.0' in text
        assert 'kimi_eagle:measured_k_speed_ratio{batch_sizes="2",k="0"} 1.0' in text
        assert f'kimi_eagle:measured_k_speed_ratio{{batch_sizes="2",k="4"}} {two.speed_ratio[4]}' in text
        assert 'kimi_eagle:measured_k{batch_sizes="1"} 4.0' in text  # a range not measured keeps the profile's
    finally:
        for gauge in vars(gauges).values():
            REGISTRY.unregister(gauge)
