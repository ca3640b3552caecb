"""The number of draft tokens, chosen where the engine serves: per range of batch sizes, from what steps cost here.

A profile's `num_speculative_tokens_per_batch_size` was measured on one machine; on another the same k can cost (an
AVX2-only EPYC ran the default profile's k = 4 at 4 streams at 0.78-0.86x the target alone, BENCHMARKS.md). Inside
vLLM's scheduler, where both model runners pass, this measures each decode step (its wall time from `schedule` to
the end of `update_from_output`, and the tokens it produced) and keeps, per range of batch sizes (1, 2, 3-4, 5-8,
...), a sliding window of tokens per second for each k. The profile's k holds a range until a probe of another k,
a few consecutive steps at a bounded share of the range's steps, measures it faster by more than the hysteresis;
k = 0 is the target alone's rate (on Model Runner V1 a step without drafts runs as a plain step: `draft_bypass`).
A range that has seen too few steps keeps the profile's k and the periodic summary says so.

The choice is written where vLLM reads it each step, `Scheduler.dynamic_sd_lookup` (batch size -> k); the draft
fail-safe, when it has bypassed the draft, puts zeros there instead and this waits.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kimi_eagle import envs

logger = logging.getLogger("vllm.kimi_eagle")

WINDOW_STEPS = 48  # steps per k in a range's window: old enough measurements leave it
MIN_STEPS = 12  # steps of a k before its rate counts
PROBE_STEPS = 12  # consecutive steps of a probe (the first after a change of k is not counted: it verifies the old k)
HYSTERESIS = 0.04  # a probed k replaces the one in force only when faster by more than this
SUMMARY_EVERY_S = 60.0


def batch_ranges(max_num_seqs: int) -> list[tuple[int, int]]:
    """1, 2, 3-4, 5-8, ... up to `max_num_seqs`."""
    ranges, low = [], 1
    while low <= max_num_seqs:
        high = min(max(low, 2 * low - 2) if low > 2 else low, max_num_seqs)
        ranges.append((low, high))
        low = high + 1
    return ranges


def candidate_ks(num_speculative_tokens: int) -> list[int]:
    """0 (the target alone), 1, 2 and the configured k, with the powers of two between."""
    ks = {0, 1, 2, num_speculative_tokens}
    ks |= {2 ** p for p in range(num_speculative_tokens.bit_length()) if 2 ** p <= num_speculative_tokens}
    return sorted(k for k in ks if k <= num_speculative_tokens)


@dataclass
class Rate:
    """Tokens per second of one k in one range, over its last `WINDOW_STEPS` steps."""

    steps: deque = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))

    def add(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))

    @property
    def count(self) -> int:
        return len(self.steps)

    def tokens_per_s(self) -> float | None:
        if self.count < MIN_STEPS:
            return None
        seconds = sum(s for _, s in self.steps)
        return sum(t for t, _ in self.steps) / seconds if seconds > 0 else None


class RangeChoice:
    """k for one range of batch sizes: the one in force, and the probes that may replace it."""

    def __init__(self, low: int, high: int, ks: list[int], configured: int, probe_share: float) -> None:
        self.low, self.high = low, high
        self.ks = ks
        self.configured = configured
        self.in_force = configured
        self.rates = {k: Rate() for k in ks}
        self.probe_share = probe_share
        self.probing: int | None = None
        self.probe_left = 0
        self.steps = self.probe_total = 0
        self._next = 0  # round robin over the other ks

    @property
    def name(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"

    def k(self) -> int:
        return self.in_force if self.probing is None else self.probing

    def observe(self, k: int, tokens: int, seconds: float) -> str | None:
        """One decode step that verified k draft tokens per request and scheduled k again. Returns a log line when
        the k in force changed."""
        if k not in self.rates:
            return None
        self.rates[k].add(tokens, seconds)
        self.steps += 1
        if self.probing is not None:
            self.probe_total += 1
            self.probe_left -= 1
            if self.probe_left <= 0:
                return self._end_probe()
        elif self.probe_total + PROBE_STEPS <= self.probe_share * (self.steps + PROBE_STEPS):
            self._start_probe()
        return None

    def _start_probe(self) -> None:
        others = [k for k in self.ks if k != self.in_force]
        if not others:
            return
        # The least measured first, then round robin, so every k's window stays fresh.
        others.sort(key=lambda k: (self.rates[k].count >= MIN_STEPS, (k - self._next) % (max(self.ks) + 1)))
        self.probing = others[0]
        self._next = self.probing + 1
        self.probe_left = PROBE_STEPS

    def _end_probe(self) -> str | None:
        probed, self.probing = self.probing, None
        now, challenger = self.rates[self.in_force].tokens_per_s(), self.rates[probed].tokens_per_s()
        if now is None or challenger is None or challenger <= now * (1 + HYSTERESIS):
            return None
        before, self.in_force = self.in_force, probed
        return (f"kimi-eagle: measured k: {self.name} in flight: k {before} -> {probed} ({challenger:.0f} tokens/s "
                f"at k={probed} against {now:.0f} at k={before}, over the last {self.rates[probed].count} and "
                f"{self.rates[before].count} decode steps; {self.summary()})")

    def summary(self) -> str:
        rates = ", ".join(f"k={k} {r:.0f}" if (r := self.rates[k].tokens_per_s()) is not None
                          else f"k={k} ({self.rates[k].count} steps)" for k in self.ks)
        if self.rates[self.in_force].tokens_per_s() is None and self.in_force == self.configured:
            return f"{self.name}: k={self.in_force}, the profile's (too few steps measured: {rates})"
        return f"{self.name}: k={self.in_force} (tokens/s {rates})"


class MeasuredK:
    """Per range of batch sizes, the k decode steps measure fastest; fills vLLM's batch size -> k lookup."""

    def __init__(self, configured_lookup: list[int], max_num_seqs: int, ks: list[int], probe_share: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ranges = [RangeChoice(low, high, ks, configured_lookup[low], probe_share)
                       for low, high in batch_ranges(max_num_seqs)]
        self._by_size = {size: r for r in self.ranges for size in range(r.low, r.high + 1)}
        self.lookup = list(configured_lookup)
        self.clock = clock
        self._summarized_at = clock()
        self._fill()

    def _fill(self) -> None:
        for r in self.ranges:
            self.lookup[r.low: r.high + 1] = [r.k()] * (r.high - r.low + 1)

    def observe(self, batch_size: int, verified_k: int, scheduled_k: int, tokens: int, seconds: float) -> None:
        """A decode step (no prefill in it) of `batch_size` requests that verified `verified_k` draft tokens each
        and scheduled `scheduled_k` for the next: counted when both are the same k of the step's range."""
        choice = self._by_size.get(batch_size)
        if choice is None or verified_k != scheduled_k or scheduled_k != choice.k():
            return
        if line := choice.observe(scheduled_k, tokens, seconds):
            logger.info(line)
        self._fill()
        if self.clock() - self._summarized_at >= SUMMARY_EVERY_S:
            self._summarized_at = self.clock()
            logger.info("kimi-eagle: measured k in force: %s", self.summary())

    def observe_step(self, step: DecodeStep, model_runner_output, now: float) -> None:
        tokens = sum(len(ids) for ids in model_runner_output.sampled_token_ids)
        self.observe(step.batch_size, step.verified_k, step.scheduled_k, tokens, now - step.started)

    def summary(self) -> str:
        return "; ".join(r.summary() for r in self.ranges if r.steps) or "no decode step measured yet"


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
    logger.info("kimi-eagle: measured k on: per range of batch sizes (%s) the engine picks k among %s from its decode "
                "steps' tokens per second, starting from the profile's (%s); at most %.0f%% of a range's steps probe "
                "another k; %s=0 keeps the profile's", ", ".join(r.name for r in measured.ranges), ks,
                ", ".join(f"{r.name}: {r.configured}" for r in measured.ranges),
                100 * envs.measured_k_probe_share(), envs.MEASURED_K.name)
    return measured
