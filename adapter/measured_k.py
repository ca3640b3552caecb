"""The number of draft tokens, chosen where the engine serves: per range of batch sizes, from what steps cost here.

A profile's `num_speculative_tokens_per_batch_size` was measured on one machine; on another the same k can cost
(BENCHMARKS.md, `kimi-eagle bench guidellm`, has the figures on both kinds of machine). Inside
vLLM's scheduler, where both model runners pass, this measures two things and multiplies them, per range of batch
sizes (1, 2, 3-4, 5-8, ...):

- what a step costs at another k, relative to the k in force: a probe runs a few consecutive decode steps at it, and
  their time per request (from `schedule` to the end of `update_from_output`) is divided by that of the steps just
  before it, at the k in force. Paired so, a ratio is free of what changes between one probe and the next (the
  batch, other load on the machine); a first version that compared windows of each k's own steps flapped between
  k = 2 and 4 every few seconds on one stream;
- what a draft yields: over the last drafts of every request, the share whose first j tokens were all accepted
  (vLLM's own per-request counts), j = 1..k, pooled over the ranges: a property of the draft and the prompts.

k's tokens per second over the k in force's is then (1 + its shares) / (1 + the in-force k's shares) over the time
ratio; k = 0 is the target alone (on Model Runner V1 a step without drafts runs as a plain step, `draft_bypass`,
except in a probe: there vLLM's own k = 0 keeps the draft's KV cache whole, and the probe's estimate errs slow). The
profile's k holds a range until, over at least three probes, another k beats it by more than the hysteresis even at
the low end of two standard errors. What probes cost (the tokens per second a probe lost against the k in force,
over its seconds; nothing for a faster k, so that where the k in force is the dear one the engine finds its way
back fast) is kept within a set share of the range's time, and a k surely slower than the one in force counts
SLOWER_BACKOFF times. A range that has seen too few probes of its own keeps the profile's k, and the periodic
summary says so, with one exception: k does not grow with the batch size (a larger batch makes verification dearer
against what a draft saves), so a range not measured yet takes no more than the nearest measured range below it and
no less than the nearest one above it. A range a load only passes through (2 in flight while four streams start,
5-8 while sixteen end) is then not left at a k its neighbours found dear: with the `slow-draft` fault, the default
profile's k = 4 there cost seconds per such step.

The choice is written where vLLM reads it each step, `Scheduler.dynamic_sd_lookup` (batch size -> k); the draft
fail-safe, when it has bypassed the draft, puts zeros there instead and this waits.

What it chose and why is seen in three places: the engine log (a line per change, a summary every minute), `/metrics`
(`kimi_eagle:measured_k*` per range, `Gauges`) and `kimi-eagle loadtest`'s report, which reads those gauges. The
engine core has no `/metrics` of its own: the API server learns the state from the stats vLLM already sends it each
step (`attach_report` / `read_report`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from kimi_eagle import envs

logger = logging.getLogger("vllm.kimi_eagle")

PAIRED_PROBES = 8  # the last probes of a k that count
MIN_PROBES = 3  # probes of a k before it can replace the one in force
ACCEPTANCE_WINDOW = 2048  # drafts per position in the acceptance window
MIN_DRAFTS = 64  # drafts that reached a position before its share counts
PROBE_STEPS = 12  # consecutive steps of a probe (the first after a change of k verifies the old k: not timed)
HYSTERESIS = 0.03  # another k replaces the one in force only when surely faster by more than this
# A k its probes show surely slower is still probed (the load, the prompts or the machine may change), but its probes
# count this many times against the budget: where drafting costs, probing it costs too, and that is what a probe
# of a slow k spends.
SLOWER_BACKOFF = 4
SUMMARY_EVERY_S = 60.0
REPORT_EVERY_S = 1.0  # how often the engine sends the API server its state (and at once after a change)
# vLLM sends the engine core's stats to the API server only as `SchedulerStats`, whose fields are typed (msgspec drops
# anything else); its spec-decoding record's `num_draft_tokens_per_pos` is read by none of vLLM's loggers. The report
# travels appended to that list after this marker (no count is negative).
REPORT_MARKER = -1


def batch_ranges(max_num_seqs: int) -> list[tuple[int, int]]:
    """1, 2, 3-4, 5-8, ... up to `max_num_seqs`."""
    ranges, low = [], 1
    while low <= max_num_seqs:
        high = min(max(low, 2 * low - 2) if low > 2 else low, max_num_seqs)
        ranges.append((low, high))
        low = high + 1
    return ranges


def batch_sizes_name(low: int, high: int) -> str:
    """A range of batch sizes as the log and the `batch_sizes` label name it: "1", "3-4"."""
    return str(low) if low == high else f"{low}-{high}"


def candidate_ks(num_speculative_tokens: int) -> list[int]:
    """0 (the target alone), 1, 2 and the configured k, with the powers of two between."""
    ks = {0, 1, 2, num_speculative_tokens}
    ks |= {2 ** p for p in range(num_speculative_tokens.bit_length()) if 2 ** p <= num_speculative_tokens}
    return sorted(k for k in ks if k <= num_speculative_tokens)


class AcceptanceByPosition:
    """Per draft position j, whether the first j draft tokens were all accepted, over the last drafts that reached
    it: the expected tokens of a request's step at k is 1 plus the shares up to k."""

    def __init__(self, max_k: int) -> None:
        self.hits = [deque(maxlen=ACCEPTANCE_WINDOW) for _ in range(max_k)]

    def add(self, drafted: int, accepted: int) -> None:
        for j in range(min(drafted, len(self.hits))):
            self.hits[j].append(accepted > j)

    def expected_tokens(self, k: int) -> float | None:
        total = 1.0
        for window in self.hits[:k]:
            if len(window) < MIN_DRAFTS:
                return None
            total += sum(window) / len(window)
        return total


def seconds_per_request(steps) -> float:
    return sum(s for _, s in steps) / sum(b for b, _ in steps)


class RangeChoice:
    """k for one range of batch sizes: the one in force, and the probes that may replace it.

    Each probe is paired with the steps at the k in force just before it (the same requests, at most a few steps
    apart): the ratio of their times per request is free of what changed on the machine and in the batch between one
    probe and the next. A k replaces the one in force when, over its last probes, its expected tokens over its time
    ratio beat the k in force by more than the hysteresis even at the low end of two standard errors."""

    def __init__(self, low: int, high: int, ks: list[int], configured: int, probe_share: float,
                 acceptance: AcceptanceByPosition) -> None:
        self.low, self.high = low, high
        self.ks = ks
        self.configured = configured
        self.in_force = configured
        self.acceptance = acceptance
        self.probe_share = probe_share
        self.recent: deque = deque(maxlen=PROBE_STEPS)  # (batch size, seconds) of the k in force's last steps
        self.paired: dict[int, deque] = {k: deque(maxlen=PAIRED_PROBES) for k in ks}  # log time ratios
        self.probing: int | None = None
        self.probe_steps: list[tuple[int, float]] = []
        self.baseline = 0.0
        self.steps = self.probe_total = 0
        self.seconds = self.probe_seconds = 0.0  # of the range's measured steps, and of those in probes
        self.probe_charge = 0.0  # probe seconds as the budget counts them (SLOWER_BACKOFF)
        self._next = 0  # round robin over the other ks
        self.switched = False  # its own probes have replaced a k
        self.bounded_by: RangeChoice | None = None  # the measured range whose k this one takes (see `bound`)

    @property
    def name(self) -> str:
        return batch_sizes_name(self.low, self.high)

    def k(self) -> int:
        return self.in_force if self.probing is None else self.probing

    @property
    def measured(self) -> bool:
        """Whether its own probes chose the k in force: they replaced a k, or every other k has enough of them."""
        return self.switched or all(len(self.paired[k]) >= MIN_PROBES for k in self.ks if k != self.in_force)

    def bound(self, k: int, by: RangeChoice | None) -> bool:
        """Put `k` in force in a range its own probes have not measured, as the measured range `by` bounds it (None:
        the profile's k again). What was probed was timed against the k in force before, so it starts over."""
        self.bounded_by = by
        if k == self.in_force:
            return False
        self.in_force, self.probing = k, None
        self.probe_steps = []
        self.recent.clear()
        for ratios in self.paired.values():
            ratios.clear()
        return True

    def observe(self, k: int, batch_size: int, seconds: float) -> str | None:
        """One decode step that verified k draft tokens per request and scheduled k again. Returns a log line when
        the k in force changed."""
        if k != self.k():
            return None
        self.steps += 1
        self.seconds += seconds
        if self.probing is None:
            self.recent.append((batch_size, seconds))
            if len(self.recent) == PROBE_STEPS:
                self._start_probe()
            return None
        self.probe_total += 1
        self.probe_seconds += seconds
        self.probe_steps.append((batch_size, seconds))
        if len(self.probe_steps) < PROBE_STEPS:
            return None
        probed, self.probing = self.probing, None
        ratio = seconds_per_request(self.probe_steps) / self.baseline
        self.paired[probed].append(math.log(ratio))
        self.probe_charge += self._cost(probed, ratio) * sum(s for _, s in self.probe_steps)
        self.recent.clear()  # the next probe's baseline comes after this one
        return self._choose()

    def _cost(self, k: int, time_ratio: float) -> float:
        """What a second of probing k cost, as a share of that second: the tokens per second it lost against the k
        in force (none for a faster k: where the k in force is the dear one, probing is free), times
        SLOWER_BACKOFF for a k surely slower. Before acceptance is known, the whole second."""
        mine, now = self.acceptance.expected_tokens(k), self.acceptance.expected_tokens(self.in_force)
        lost = 1.0 if mine is None or now is None else max(0.0, 1 - mine / now / time_ratio)
        gain = self.gain(k, sigmas=-2)
        return lost * (SLOWER_BACKOFF if gain is not None and gain[1] < 1 else 1.0)

    def _start_probe(self) -> None:
        """Probe the next k when what probes cost so far leaves room in the budget for what this one is expected to
        cost (from its earlier probes; for a k not probed yet, its steps as long as the k in force's)."""
        others = [k for k in self.ks if k != self.in_force]
        if not others:
            return
        others.sort(key=lambda k: (len(self.paired[k]) >= MIN_PROBES, (k - self._next) % (max(self.ks) + 1)))
        k = others[0]
        ratios = self.paired[k]
        ratio = math.exp(sum(ratios) / len(ratios)) if ratios else 1.0  # not probed yet: as long as a step now
        expected = sum(s for _, s in self.recent) * ratio * self._cost(k, ratio)
        if self.probe_charge + expected > self.probe_share * (self.seconds + expected):
            return
        self.probing = k
        self._next = k + 1
        self.baseline = seconds_per_request(self.recent)
        self.probe_steps = []

    def gain(self, k: int, sigmas: float = 2) -> tuple[float, float] | None:
        """(estimate, low end) of k's tokens per second over the k in force's, or None before enough probes; the
        low end is `sigmas` standard errors down (a negative `sigmas`: up)."""
        if k == self.in_force:
            return 1.0, 1.0
        ratios, mine, now = self.paired[k], self.acceptance.expected_tokens(k), self.acceptance.expected_tokens(
            self.in_force)
        if len(ratios) < MIN_PROBES or mine is None or now is None:
            return None
        mean = sum(ratios) / len(ratios)
        spread = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (len(ratios) - 1) / len(ratios))
        return mine / now / math.exp(mean), mine / now / math.exp(mean + sigmas * spread)

    def _choose(self) -> str | None:
        gains = {k: g for k in self.ks if k != self.in_force and (g := self.gain(k)) is not None}
        if not gains:
            return None
        best = max(gains, key=lambda k: gains[k][1])
        if gains[best][1] <= 1 + HYSTERESIS:
            return None
        before, self.in_force = self.in_force, best
        self.switched, self.bounded_by = True, None
        line = (f"kimi-eagle: measured k: {self.name} in flight: k {before} -> {best} ({gains[best][0]:.2f}x the "
                f"tokens per second of k={before}, at least {gains[best][1]:.2f}x over {len(self.paired[best])} "
                f"paired probes; {self.summary(gains, before)})")
        # The probes were timed against the k that was in force: rebased on the new one (a time ratio to it is the
        # ratio to the old one over the new one's), they keep what is known, and a k known to be slower is probed
        # less often from the first step after the switch.
        shift = sum(self.paired[best]) / len(self.paired[best])
        rebased = {k: [r - shift for r in self.paired[k]] for k in self.ks if k not in (best, before)}
        rebased[before] = [-r for r in self.paired[best]]
        rebased[best] = []
        for k, ratios in rebased.items():
            self.paired[k] = deque(ratios, maxlen=PAIRED_PROBES)
        self.recent.clear()
        return line

    def report(self) -> RangeReport:
        gains = {k: g[0] for k in self.ks if k != self.in_force and (g := self.gain(k)) is not None}
        return RangeReport(self.low, self.high, self.in_force, self.configured, self.steps,
                           {k: len(self.paired[k]) for k in self.ks if k != self.in_force}, gains)

    def summary(self, gains: dict | None = None, reference: int | None = None) -> str:
        reference = self.in_force if reference is None else reference
        if gains is None:
            gains = {k: g for k in self.ks if k != reference and (g := self.gain(k)) is not None}
        shown = ", ".join(f"k={k} {gains[k][0]:.2f}x" if k in gains else f"k={k} ({len(self.paired[k])} probes)"
                          for k in self.ks if k != reference)
        if not gains and self.bounded_by is not None:
            return (f"{self.name}: k={self.in_force}, as {self.bounded_by.name} in flight measured (too few probes of "
                    f"its own yet: {shown})")
        if not gains and self.in_force == self.configured:
            return f"{self.name}: k={self.in_force}, the profile's (too few probes yet: {shown})"
        return f"{self.name}: k={self.in_force} (against k={reference}: {shown})"


class MeasuredK:
    """Per range of batch sizes, the k decode steps measure fastest; fills vLLM's batch size -> k lookup."""

    def __init__(self, configured_lookup: list[int], max_num_seqs: int, ks: list[int], probe_share: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.acceptance = AcceptanceByPosition(max(ks))
        self.ranges = [RangeChoice(low, high, ks, configured_lookup[low], probe_share, self.acceptance)
                       for low, high in batch_ranges(max_num_seqs)]
        self._by_size = {size: r for r in self.ranges for size in range(r.low, r.high + 1)}
        self.lookup = list(configured_lookup)
        self.clock = clock
        self._summarized_at = clock()
        self._reported_at: float | None = None
        for r in self.ranges:
            self._fill(r)

    def _fill(self, r: RangeChoice) -> None:
        self.lookup[r.low: r.high + 1] = [r.k()] * (r.high - r.low + 1)

    def _bound_unmeasured(self) -> list[str]:
        """k does not grow with the batch size: each range its own probes have not measured takes the profile's k,
        but no more than the nearest measured range below it chose and no less than the nearest above it (the
        profile's, where those two disagree with the rule). Returns a log line per change."""
        lines = []
        for i, r in enumerate(self.ranges):
            if r.measured:
                continue
            below = next((m for m in reversed(self.ranges[:i]) if m.measured), None)
            above = next((m for m in self.ranges[i + 1:] if m.measured), None)
            k, by = r.configured, None
            if below is not None and above is not None and below.in_force < above.in_force:
                pass  # measurements against the rule: this range's own probes will tell
            elif below is not None and k > below.in_force:
                k, by = below.in_force, below
            elif above is not None and k < above.in_force:
                k, by = above.in_force, above
            before = r.in_force
            if r.bound(k, by):
                self._fill(r)
                why = (f"{by.name} in flight measured k={k}, and k does not grow with the batch size" if by else
                       "the profile's again: the measured ranges around it no longer bound it")
                lines.append(f"kimi-eagle: measured k: {r.name} in flight: k {before} -> {k} (too few probes of its "
                             f"own yet; {why})")
        return lines

    def count_draft(self, drafted: int, accepted: int) -> None:
        """One request's verified draft (vLLM's own count, `Scheduler.make_spec_decoding_stats`)."""
        self.acceptance.add(drafted, accepted)

    def observe(self, batch_size: int, verified_k: int, scheduled_k: int, seconds: float) -> None:
        """A decode step (no prefill in it) of `batch_size` requests that verified `verified_k` draft tokens each
        and scheduled `scheduled_k` for the next: counted when both are the same k of the step's range."""
        choice = self._by_size.get(batch_size)
        if choice is None or verified_k != scheduled_k or scheduled_k != choice.k():
            return
        if line := choice.observe(scheduled_k, batch_size, seconds):
            logger.info(line)
            self._reported_at = None  # the API server hears of a change at once
        if choice.k() != scheduled_k:  # a probe began or ended, or the k in force changed
            self._fill(choice)
            for line in self._bound_unmeasured():
                logger.info(line)
                self._reported_at = None
        if self.clock() - self._summarized_at >= SUMMARY_EVERY_S:
            self._summarized_at = self.clock()
            logger.info("kimi-eagle: measured k in force: %s", self.summary())

    def probing_no_draft(self, batch_size: int) -> bool:
        """Whether this batch size's range is probing k = 0."""
        choice = self._by_size.get(batch_size)
        return choice is not None and choice.probing == 0

    def observe_step(self, step: DecodeStep, now: float) -> None:
        self.observe(step.batch_size, step.verified_k, step.scheduled_k, now - step.started)

    def summary(self) -> str:
        return "; ".join(r.summary() for r in self.ranges if r.steps) or "no decode step measured yet"

    def report_due(self) -> bool:
        return self._reported_at is None or self.clock() - self._reported_at >= REPORT_EVERY_S

    def report(self) -> list[RangeReport]:
        """Every range's state, for the API server (`attach_report`); the next is due in REPORT_EVERY_S."""
        self._reported_at = self.clock()
        return [r.report() for r in self.ranges]


@dataclass(frozen=True)
class RangeReport:
    """One range of batch sizes as the engine last measured it."""

    low: int
    high: int
    k: int  # in force
    configured: int  # the profile's
    steps: int  # decode steps measured
    probes: dict[int, int]  # other k -> paired probes that count
    speed_ratio: dict[int, float]  # other k -> its tokens/s over the k in force's, where probes suffice

    @property
    def batch_sizes(self) -> str:
        return batch_sizes_name(self.low, self.high)


def attach_report(record, reports: list[RangeReport]) -> None:
    """Append `reports` to a spec-decoding record the engine core sends this step (see REPORT_MARKER)."""
    values = [REPORT_MARKER, len(reports)]
    for r in reports:
        values += [r.low, r.high, r.k, r.configured, r.steps, len(r.probes)]
        for k, probes in r.probes.items():
            values += [k, probes, round(1000 * r.speed_ratio[k]) if k in r.speed_ratio else -1]
    record.num_draft_tokens_per_pos = list(record.num_draft_tokens_per_pos) + values


def read_report(record) -> list[RangeReport] | None:
    """The report `attach_report` appended to `record`; None when it carries none."""
    values = record.num_draft_tokens_per_pos
    if REPORT_MARKER not in values:
        return None
    it = iter(values[values.index(REPORT_MARKER) + 1:])
    reports = []
    for _ in range(next(it)):
        low, high, k, configured, steps, others = (next(it) for _ in range(6))
        probes, ratios = {}, {}
        for _ in range(others):
            other, count, milli = next(it), next(it), next(it)
            probes[other] = count
            if milli >= 0:
                ratios[other] = milli / 1000
        reports.append(RangeReport(low, high, k, configured, steps, probes, ratios))
    return reports


class Gauges:
    """`/metrics` series of the measured k, per range of batch sizes (label `batch_sizes`), in the API server."""

    def __init__(self) -> None:
        from prometheus_client import Gauge

        ranges = ["batch_sizes"]
        self.k = Gauge("kimi_eagle:measured_k", "Draft tokens per step in force for this range of batch sizes, as "
                       "the engine measured it (kimi_eagle:measured_k_configured: the profile's)", ranges,
                       multiprocess_mode="max")
        self.configured = Gauge("kimi_eagle:measured_k_configured", "The profile's draft tokens per step for this "
                                "range of batch sizes", ranges, multiprocess_mode="max")
        self.steps = Gauge("kimi_eagle:measured_k_steps", "Decode steps of this range the engine has timed", ranges,
                           multiprocess_mode="max")
        self.probes = Gauge("kimi_eagle:measured_k_probes", "Paired probes of another k that count towards the "
                            "choice (the last few)", [*ranges, "k"], multiprocess_mode="max")
        self.speed_ratio = Gauge("kimi_eagle:measured_k_speed_ratio", "Tokens per second of another k over the k in "
                                 "force's, as measured (present once its probes suffice)", [*ranges, "k"],
                                 multiprocess_mode="max")

    def set(self, reports: list[RangeReport]) -> None:
        for r in reports:
            self.k.labels(r.batch_sizes).set(r.k)
            self.configured.labels(r.batch_sizes).set(r.configured)
            self.steps.labels(r.batch_sizes).set(r.steps)
            self.probes.labels(r.batch_sizes, str(r.k)).set(0)
            self.speed_ratio.labels(r.batch_sizes, str(r.k)).set(1.0)  # the reference
            for k, probes in r.probes.items():
                self.probes.labels(r.batch_sizes, str(k)).set(probes)
                if k in r.speed_ratio:
                    self.speed_ratio.labels(r.batch_sizes, str(k)).set(r.speed_ratio[k])
                else:  # not (yet) measured against the k in force: no figure rather than a stale one
                    with contextlib.suppress(KeyError):
                        self.speed_ratio.remove(r.batch_sizes, str(k))
@dataclass(frozen=True)
class DecodeStep:
    batch_size: int
    verified_k: int
    scheduled_k: int
    started: float


def decode_step(output, started: float) -> DecodeStep | None:
    """The step `output` schedules, when it is a decode step in which every request verifies the same number of
    draft tokens; None for a step with a prefill (its cost is the prompt's, not k's) or mixed drafts."""
    batch = len(output.num_scheduled_tokens)
    spec = output.scheduled_spec_decode_tokens
    lengths = {len(ids) for ids in spec.values()}
    if not batch or output.scheduled_new_reqs or len(spec) not in (0, batch) or len(lengths) > 1:
        return None
    verified = lengths.pop() if lengths else 0
    if output.total_num_scheduled_tokens != batch * (1 + verified):
        return None
    return DecodeStep(batch, verified, output.num_spec_tokens_to_schedule, started)


def for_scheduler(scheduler) -> MeasuredK | None:
    """The measured k of an engine's scheduler, or None (and why, in the log) where the profile's k stays."""
    if not envs.measured_k():
        logger.info("kimi-eagle: measured k off (%s=0): the profile's draft tokens per batch size stay",
                    envs.MEASURED_K.name)
        return None
    from vllm.platforms import current_platform

    config = scheduler.vllm_config
    max_num_seqs = scheduler.scheduler_config.max_num_seqs
    k = scheduler.num_spec_tokens
    schedule = config.speculative_config.num_speculative_tokens_per_batch_size
    if current_platform.is_cpu() or config.model_config.enforce_eager:
        ks = candidate_ks(k)
    elif schedule:
        ks = sorted({int(entry[2]) for entry in schedule})  # the ks vLLM prepared CUDA graphs for
    else:
        logger.info("kimi-eagle: measured k off: with CUDA graphs it chooses among the ks of a "
                    "`num_speculative_tokens_per_batch_size` schedule (vLLM prepares graphs for those), and this "
                    "profile has none")
        return None
    configured = list(scheduler.dynamic_sd_lookup or [k] * (max_num_seqs + 1))
    measured = MeasuredK(configured, max_num_seqs, ks, envs.measured_k_probe_share())
    logger.info("kimi-eagle: measured k on: per range of batch sizes (%s) the engine picks k among %s from its "
                "decode steps' times and its drafts' acceptance, starting from the profile's (%s); at most %.0f%% of a "
                "range's steps probe another k; %s=0 keeps the profile's",
                ", ".join(r.name for r in measured.ranges), ks,
                ", ".join(f"{r.name}: {r.configured}" for r in measured.ranges),
                100 * envs.measured_k_probe_share(), envs.MEASURED_K.name)
    return measured
