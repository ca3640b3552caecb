"""The acceptance alarm's window (`AcceptanceWatch`), fed step by step as vLLM's Prometheus logger feeds it."""


from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, Gauge

from kimi_eagle.adapter import acceptance_alarm
from kimi_eagle.adapter.acceptance_alarm import AcceptanceWatch

K = 3


class Gauges:
    """The two gauges, on a registry of their own, read as a scrape of /metrics would read them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.collapsed_gauge = Gauge("collapsed", "test", registry=self.registry)
        self.rate_gauge = Gauge("rate", "test", registry=self.registry)

    @property
    def collapsed(self) -> float | None:
        return self.registry.get_sample_value("collapsed")

    @property
    def rate(self) -> float | None:
        return self.registry.get_sample_value("rate")


@pytest.fixture
def watch() -> tuple[AcceptanceWatch, Gauges]:
    g = Gauges()
    return AcceptanceWatch(window_drafts=100, min_rate=0.05, collapsed_gauge=g.collapsed_gauge,
                           rate_gauge=g.rate_gauge), g


def feed(w: AcceptanceWatch, steps: int, drafts: int, accepted_per_draft: float) -> None:
    for _ in range(steps):
        w.observe(drafts, drafts * K, round(drafts * accepted_per_draft))


def test_nothing_is_judged_before_the_window_is_full(watch, caplog: pytest.LogCaptureFixture) -> None:
    w, g = watch
    feed(w, 9, 10, 0.0)  # 90 drafts, nothing accepted: not yet a window
    assert g.collapsed == 0 and g.rate == 0 and "COLLAPSE" not in caplog.text


def test_a_collapse_sets_the_gauge_and_warns_once_a_minute(watch, caplog: pytest.LogCaptureFixture,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    w, g = watch
    now = [1000.0]
    monkeypatch.setattr(acceptance_alarm.time, "monotonic", lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="vllm.kimi_eagle"):
        feed(w, 10, 10, 0.1)  # 1 of 30 draft tokens per 10 drafts: 3.3% < 5%
        assert g.collapsed == 1 and g.rate == pytest.approx(10 / 300)
        now[0] += 30
        feed(w, 1, 10, 0.1)   # half a minute later: no second warning
        now[0] += 40
        feed(w, 1, 10, 0.1)   # 70 s after the first: warned again
    warnings = [r.getMessage() for r in caplog.records if "ACCEPTANCE COLLAPSE" in r.getMessage()]
    assert len(warnings) == 2
    assert "10 of 300 drafted tokens accepted (3.3%) over the last 100 drafts" in warnings[0]
    assert "kimi-eagle doctor" in warnings[0]


def test_the_window_slides_and_recovery_clears_the_gauge(watch) -> None:
    w, g = watch
    feed(w, 10, 10, 0.0)
    assert g.collapsed == 1 and g.rate == 0
    feed(w, 10, 10, 2.0)  # a whole window of 2 of 3 accepted: the bad steps have left the window
    assert g.collapsed == 0 and g.rate == pytest.approx(2 / 3)

