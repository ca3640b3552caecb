"""The order the suite's scopes reach the workers: the longest first, so that neither worker ends with minutes of
work while the other idles (tests/conftest.py; `make test` turns xdist's own reorder, most tests first, off)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import _longest_first, scope_rank
from tests.helpers.cli import REPO


def test_the_shared_servers_then_the_long_folders_then_the_unit_tests() -> None:
    assert scope_rank("exact", Path("tests/e2e/test_ab.py")) == scope_rank("default", Path("tests/e2e/x.py")) == 0
    assert scope_rank(None, Path("tests/upstream/test_vllm_own_tests.py")) == 1
    assert scope_rank(None, Path("tests/e2e/test_bench.py")) == scope_rank("serve-cli", Path("tests/e2e/s.py")) == 1
    assert scope_rank("v2-path", Path("tests/unit/adapter/test_guards_on_model_runner_v2.py")) == 2


def test_the_session_runs_in_that_order(request: pytest.FixtureRequest) -> None:
    ranks = [_longest_first(item) for item in request.session.items]
    assert ranks == sorted(ranks), "the session's items are in the order the workers get them"


def test_make_test_keeps_that_order() -> None:
    recipe = (REPO / "Makefile").read_text().split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert "--dist loadgroup --no-loadscope-reorder" in recipe, recipe
