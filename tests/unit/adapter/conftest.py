"""Fixtures for the plugin's unit tests."""

from __future__ import annotations

import logging

import pytest


@pytest.fixture(autouse=True)
def _plugin_logs_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin logs under "vllm.kimi_eagle", and caplog listens at the root logger. vLLM's logging setup, which
    runs once per process when a test first makes vLLM configure its loggers, stops propagation at "vllm": then the
    warnings these tests assert reached vLLM's handler only, and the tests passed or failed with the test order."""
    monkeypatch.setattr(logging.getLogger("vllm"), "propagate", True)
