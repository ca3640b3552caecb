"""vLLM's saved compile result is reused on this CPU, and only for the capture it was traced with.

A second start that loads the target's graph and answers as the start that compiled it:
`tests/e2e/test_bench.py::test_quick_startup_benchmark_times_a_first_and_a_second_start`. A start whose capture
differs (one aux layer instead of three) must trace again: that is
`tests/e2e/test_guards.py::test_target_without_aux_capture_is_named_at_the_first_step`, which fails when the graph
traced for three layers is loaded for it. Every key compiles into one inductor cache (`adapter/compile_cache.py`):
kernels are found by their own content, so a new key reuses what another compiled."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kimi_eagle.adapter.compile_cache import SHARED_INDUCTOR_CACHE
from kimi_eagle.bench.startup import LOADED_MARK
from tests.helpers.server import Server

pytestmark = pytest.mark.e2e
# vLLM's line for the target's graph: saved where the session compiled it, loaded (the start-up bench's mark) where
# an earlier run had.
TARGET_GRAPH = re.compile(rf"(?:\[backbone\] saved AOT compiled function to|{re.escape(LOADED_MARK)} from path) (\S+)")


def test_the_session_servers_key_compiles_into_the_shared_inductor_cache(spec_server: Server) -> None:
    found = TARGET_GRAPH.search(spec_server.log.read_text())
    assert found, f"{spec_server.log} shows no compiled target graph, saved or loaded"
    key_dir = Path(found[1]).parents[1]  # .../torch_aot_compile/KEY/rank_0_0/model
    inductor = key_dir / "inductor_cache"
    assert inductor.is_symlink() and inductor.resolve().name == SHARED_INDUCTOR_CACHE, f"{inductor} is not shared"
    assert any(inductor.rglob("*.so")), f"no compiled kernel in {inductor.resolve()}"
