"""Shared fixtures. Real vLLM servers are started once per session and shared by every test that needs one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.server import EXACT_PROFILE, Server

# Real responses of a real SGLang 0.5.23 server (its README says how they were recorded), carried by the project.
RECORDINGS_DIR = Path(__file__).resolve().parent / "data" / "sglang-0.5.23-cpu"




def _serve(tmp_dir: Path, name: str, env: dict[str, str] | None = None, **overrides) -> Iterator[Server]:
    command = build_command(load_profile(EXACT_PROFILE), port=free_port(), **overrides)
    command.env.update(env or {})
    log = tmp_dir / f"{name}.log"
    with running_server(command, log_path=log, timeout_s=600) as ready_s:
        yield Server(url=command.url, model=command.served_model_name, log=log, ready_s=ready_s)


@pytest.fixture(scope="session")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The exactness profile: tiny Kimi-K2.5 target + trained EAGLE-3 draft, k=3, float32."""
    yield from _serve(tmp_path_factory.mktemp("spec"), "spec")


@pytest.fixture(scope="module")
def sampling_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The exactness profile with the draft fail-safe off, for the tests of speculative sampling at T=1. At T=1 this
    tiny target accepts about 4% of drafted tokens, below the fail-safe's 5%: on the shared server the fail-safe
    would rightly bypass the draft within the first of them, the next would sample the target alone and pass without
    testing speculation, and every later test on that server would inherit a bypassed draft. Module-scoped: it
    stops when the T=1 tests are done."""
    yield from _serve(tmp_path_factory.mktemp("sampling"), "sampling", env={"KIMI_EAGLE_BYPASS": "0"})


@pytest.fixture(scope="session")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same target without speculation."""
    yield from _serve(tmp_path_factory.mktemp("plain"), "plain", no_draft=True)


@pytest.fixture(scope="session")
def sglang_recordings() -> Path:
    if not RECORDINGS_DIR.is_dir():
        pytest.fail(f"the SGLang recordings are missing: expected {RECORDINGS_DIR} (part of the checkout)")
    return RECORDINGS_DIR
