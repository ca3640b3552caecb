"""Locust entry point: `locust -f loadtest/locustfile.py --host URL ...` (web UI, headless, CSV, --processes,
--master/--worker all work) or `kimi-eagle loadtest`, which runs this file headless and reads the results."""

from __future__ import annotations

from locust import events

from kimi_eagle.loadtest.session import add_options, on_init
from kimi_eagle.loadtest.user import OpenAIUser

__all__ = ["OpenAIUser"]  # Locust runs every User class found in this module


@events.init_command_line_parser.add_listener
def _add_options(parser, **_kwargs) -> None:
    add_options(parser)


@events.init.add_listener
def _on_init(environment, **_kwargs) -> None:
    on_init(environment)
