"""vLLM's saved compile result is reused on this CPU, and only for the capture it was traced with.

A start whose capture differs (one aux layer instead of three) must trace again: that is
`tests/e2e/test_guards.py::test_target_without_aux_capture_is_named_at_the_first_step`, which fails when the graph
traced for three layers is loaded for it. Every key compiles into one inductor cache (`adapter/compile_cache.py`):
kernels are found by their own content, so a new key reuses what another compiled."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_eagle.adapter.compile_cache import SHARED_INDUCTOR_CACHE
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.server import EXACT_PROFILE, Server, greedy_ids

pytestmark = pytest.mark.e2e
LOADED = "[backbone] Directly load AOT compilation"


def test_a_second_start_loads_the_compiled_target_and_answers_the_same(spec_server: Server, tmp_path) -> None:
    # The session's server has traced (or loaded) the profile's graphs and saved them; the same profile again:
    reference = greedy_ids(spec_server.url, spec_server.model, max_tokens=32)
    command = build_command(load_profile(EXACT_PROFILE), port=free_port())
    log = tmp_path / "second.log"
    with running_server(command, log_path=log, timeout_s=600) as ready_s:
        again = greedy_ids(command.url, command.served_model_name, max_tokens=32)
    text = log.read_text()
    assert LOADED in text, "the target was traced again instead of loaded"
    # Where it loaded from: the key's inductor cache is the one every key compiles into, with the kernels in it.
    key_dir = Path(text.split(LOADED + " from path ", 1)[1].split()[0]).parents[1]
    inductor = key_dir / "inductor_cache"
    assert inductor.is_symlink() and inductor.resolve().name == SHARED_INDUCTOR_CACHE, f"{inductor} is not shared"
    assert any(inductor.rglob("*.so")), f"no compiled kernel in {inductor.resolve()}"
    assert again == reference  # the loaded graph computes what the traced one did
    print(f"\nsecond start of {EXACT_PROFILE}: healthy after {ready_s:.0f}s "
          f"(the session's first: {spec_server.ready_s:.0f}s)")
