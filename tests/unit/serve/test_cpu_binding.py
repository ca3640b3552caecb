"""A profile's core binding is kept inside the CPUs the server may use (serve/cpu_binding.py)."""

from __future__ import annotations

import pytest

from kimi_eagle.serve.cpu_binding import BIND_ENV, CpuBindingError, fit_to_allowed, parse_cpus


def test_cpu_lists_read_as_vllm_writes_them() -> None:
    assert parse_cpus("0-3,8") == [0, 1, 2, 3, 8] and parse_cpus("5") == [5]


@pytest.mark.parametrize(("mask", "allowed", "expected"), [
    ("0-1", {1}, "1"),              # a taskset share of one core: the binding shrinks to it
    ("0-1", {0, 1, 2, 3}, None),    # inside: left as the profile says
    ("0-1", {2, 3}, "2,3"),         # none of it allowed: the whole share
    ("0-1|2-3", {1, 3}, "1|3"),     # one list per worker, each narrowed
    ("auto", {1}, None),            # vLLM's own auto binding stays inside the share already
])
def test_a_binding_is_narrowed_to_the_allowed_cpus(mask: str, allowed: set[int], expected: str | None) -> None:
    env, note = fit_to_allowed({BIND_ENV: mask, "OTHER": "kept"}, allowed)
    assert env[BIND_ENV] == (expected or mask), f"{mask} inside {allowed}: expected {expected or mask}, got {env}"
    assert env["OTHER"] == "kept"
    assert (note is None) == (expected is None), f"a changed binding is said, an unchanged one is not: {note!r}"
    if note:
        assert mask in note and expected in note


def test_a_worker_left_without_cpus_is_refused_by_name() -> None:
    with pytest.raises(CpuBindingError, match=r"worker 1 is bound to none of the CPUs .*\(0,1\)"):
        fit_to_allowed({BIND_ENV: "0|2"}, {0, 1})
    with pytest.raises(CpuBindingError, match="not a CPU list"):
        fit_to_allowed({BIND_ENV: "zero-one"}, {0, 1})
