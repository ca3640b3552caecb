"""A loud alarm when speculation stops paying: acceptance near zero over a window of drafts.

In the SGLang deployment this project grew out of, the only symptom of a crippled draft was an acceptance
figure meaning "nothing accepted", and nobody was told. vLLM's Prometheus logger sees every step's
speculative-decoding stats in the API server process; this watch reads the same stats there, keeps a window
of at least `KIMI_EAGLE_ALARM_WINDOW_DRAFTS` drafts, and when accepted / drafted tokens falls below
`KIMI_EAGLE_ALARM_MIN_RATE` it logs a warning and sets `kimi_eagle:spec_decode_acceptance_collapsed` to 1.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from kimi_eagle import envs
from kimi_eagle.adapter import compat, measured_k, surface

logger = logging.getLogger("vllm.kimi_eagle")

REPEAT_WARNING_S = 60.0


class AcceptanceWindow:
    """Accepted / drafted tokens over the most recent steps that hold at least `window_drafts` drafts.

    The acceptance alarm (API server) and the draft fail-safe (engine core) judge the same figure over the same
    kind of window; this is that window, once."""

    def __init__(self, window_drafts: int) -> None:
        self.window_drafts = window_drafts
        self.clear()

    def clear(self) -> None:
        self._steps: deque[tuple[int, int, int]] = deque()
        self.drafts = self.draft_tokens = self.accepted = 0

    def add(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self._steps.append((num_drafts, num_draft_tokens, num_accepted_tokens))
        self.drafts += num_drafts
        self.draft_tokens += num_draft_tokens
        self.accepted += num_accepted_tokens
        while self._steps and self.drafts - self._steps[0][0] >= self.window_drafts:
            drafts, tokens, accepted = self._steps.popleft()
            self.drafts -= drafts
            self.draft_tokens -= tokens
            self.accepted -= accepted

    def rate(self) -> float | None:
        """Accepted / drafted tokens, or None while the window holds fewer than `window_drafts` drafts."""
        if self.drafts < self.window_drafts or self.draft_tokens == 0:
            return None
        return self.accepted / self.draft_tokens

    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / self.drafts if self.drafts else 1.0


class AcceptanceWatch:
    def __init__(self, window_drafts: int, min_rate: float, collapsed_gauge, rate_gauge) -> None:
        self.window = AcceptanceWindow(window_drafts)
        self.min_rate = min_rate
        self._collapsed_gauge, self._rate_gauge = collapsed_gauge, rate_gauge
        self._last_warning = float("-inf")

    def observe(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        w = self.window
        w.add(num_drafts, num_draft_tokens, num_accepted_tokens)
        if (rate := w.rate()) is None:
            return
        self._rate_gauge.set(rate)
        collapsed = rate < self.min_rate
        self._collapsed_gauge.set(1 if collapsed else 0)
        if collapsed and time.monotonic() - self._last_warning > REPEAT_WARNING_S:
            self._last_warning = time.monotonic()
            logger.warning(
                "kimi-eagle: ACCEPTANCE COLLAPSE: %d of %d drafted tokens accepted (%.1f%%) over the last %d drafts "
                "(mean acceptance length %.2f): the draft is not helping, and every step pays for it. Typical causes: "
                "a draft that is untrained or partly loaded, aux layer ids the draft was not trained on, a draft "
                "for another target. Run `kimi-eagle doctor DRAFT --target TARGET --probe`.",
                w.accepted, w.draft_tokens, 100 * rate, w.drafts, w.mean_acceptance_length())


_METRICS = "vllm.v1.spec_decode.metrics"


def install() -> bool:
    """Wrap vLLM's spec-decoding loggers, which run in the API server process for every step's stats."""
    if not compat.supported():
        return False
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    if hasattr(SpecDecodingProm.observe, surface.ORIGINAL):
        return True  # the gauges are registered once per process
    from prometheus_client import Gauge

    # multiprocess_mode matters only when vLLM runs several API server processes (shared metrics directory).
    collapsed = Gauge("kimi_eagle:spec_decode_acceptance_collapsed",
                      "1 when accepted/drafted tokens fell below the alarm rate over the last window of drafts",
                      multiprocess_mode="max")
    rate = Gauge("kimi_eagle:spec_decode_window_acceptance_rate",
                 "Accepted / drafted tokens over the last window of drafts", multiprocess_mode="max")
    bypassed = Gauge("kimi_eagle:draft_bypassed",
                     "1 while the engine serves without drafting because the draft's acceptance collapsed "
                     "(the draft fail-safe); 0 while it drafts", multiprocess_mode="max")
    watch = AcceptanceWatch(envs.alarm_window_drafts(), envs.alarm_min_rate(), collapsed, rate)
    measured = measured_k.Gauges()

    # A record with no drafts is the draft fail-safe's word that the engine bypasses its draft (vLLM itself sends
    # none for a step without drafts): it sets the gauge and is kept from vLLM's own figures. One that carries the
    # measured k's report comes from an engine that drafts.
    def prometheus(original):
        def observe(self, spec_decoding_stats, engine_idx: int = 0):
            if (reports := measured_k.read_report(spec_decoding_stats)) is not None:
                measured.set(reports)
            if spec_decoding_stats.num_drafts == 0:
                bypassed.set(0 if reports is not None else 1)
                return
            bypassed.set(0)
            original(self, spec_decoding_stats, engine_idx)
            if self.spec_decoding_enabled:
                watch.observe(spec_decoding_stats.num_drafts, spec_decoding_stats.num_draft_tokens,
                              spec_decoding_stats.num_accepted_tokens)

        return observe

    def logging_(original):
        def observe(self, spec_decoding_stats):
            if spec_decoding_stats.num_drafts:
                original(self, spec_decoding_stats)

        return observe

    surface.wrap(_METRICS, "SpecDecodingProm.observe", prometheus)
    surface.wrap(_METRICS, "SpecDecodingLogging.observe", logging_)
    return True
