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
from kimi_eagle.adapter import compat

logger = logging.getLogger("vllm.kimi_eagle")

REPEAT_WARNING_S = 60.0


class AcceptanceWatch:
    def __init__(self, window_drafts: int, min_rate: float, collapsed_gauge, rate_gauge) -> None:
        self.window_drafts = window_drafts
        self.min_rate = min_rate
        self._steps: deque[tuple[int, int, int]] = deque()
        self._drafts = self._draft_tokens = self._accepted = 0
        self._collapsed_gauge, self._rate_gauge = collapsed_gauge, rate_gauge
        self._last_warning = float("-inf")

    def observe(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self._steps.append((num_drafts, num_draft_tokens, num_accepted_tokens))
        self._drafts += num_drafts
        self._draft_tokens += num_draft_tokens
        self._accepted += num_accepted_tokens
        while self._steps and self._drafts - self._steps[0][0] >= self.window_drafts:
            drafts, tokens, accepted = self._steps.popleft()
            self._drafts -= drafts
            self._draft_tokens -= tokens
            self._accepted -= accepted
        if self._drafts < self.window_drafts or self._draft_tokens == 0:
            return
        rate = self._accepted / self._draft_tokens
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
                self._accepted, self._draft_tokens, 100 * rate, self._drafts, 1 + self._accepted / self._drafts)


def install() -> bool:
    """Wrap vLLM's `SpecDecodingProm.observe`, which runs in the API server process for every step."""
    if not compat.supported("acceptance alarm"):
        return False
    from prometheus_client import Gauge
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    original = SpecDecodingProm.observe
    if getattr(original, "_kimi_eagle_watch", None):
        return True
    # multiprocess_mode matters only when vLLM runs several API server processes (shared metrics directory).
    collapsed = Gauge("kimi_eagle:spec_decode_acceptance_collapsed",
                      "1 when accepted/drafted tokens fell below the alarm rate over the last window of drafts",
                      multiprocess_mode="max")
    rate = Gauge("kimi_eagle:spec_decode_window_acceptance_rate",
                 "Accepted / drafted tokens over the last window of drafts", multiprocess_mode="max")
    watch = AcceptanceWatch(envs.alarm_window_drafts(), envs.alarm_min_rate(), collapsed, rate)

    def observe(self, spec_decoding_stats, engine_idx: int = 0):
        original(self, spec_decoding_stats, engine_idx)
        if self.spec_decoding_enabled:
            watch.observe(spec_decoding_stats.num_drafts, spec_decoding_stats.num_draft_tokens,
                          spec_decoding_stats.num_accepted_tokens)

    observe._kimi_eagle_watch = watch
    SpecDecodingProm.observe = observe
    return True
