"""A profile's core binding, kept inside the CPUs the server may use.

A profile can name the cores vLLM binds its worker's OpenMP threads to (`VLLM_CPU_OMP_THREADS_BIND`, "0-1": both
cores of a 2-core machine; `bench configs` measures such a layout). vLLM binds exactly what it is told, also cores
outside the share the server was started in (`taskset`, a container's cpuset, a job scheduler's slice; vLLM's own
"auto" stays inside it): the worker's threads then spin on cores that other work owns, and both crawl (a second
server started beside a loaded one on 2 cores, both bound to "0-1", was not ready after 600 s). So a binding is
narrowed to the allowed CPUs before vLLM starts, and the server's log says so.
"""

from __future__ import annotations

import os

BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
UNBOUND = {"", "auto", "nobind"}


class CpuBindingError(ValueError):
    """A worker's binding has none of the CPUs the server may use."""


def parse_cpus(text: str) -> list[int]:
    """vLLM's CPU list form, "0-3,8": the ids in order."""
    cpus: list[int] = []
    for part in text.split(","):
        first, _, last = part.strip().partition("-")
        cpus += range(int(first), int(last or first) + 1)
    return cpus


def format_cpus(cpus: list[int]) -> str:
    return ",".join(map(str, cpus))


def fit_to_allowed(env: dict[str, str], allowed: set[int] | None = None) -> tuple[dict[str, str], str | None]:
    """`env` with its binding inside `allowed` (this process's affinity by default), and a line saying what changed
    (None: nothing did). One worker's list (no "|") with none of the allowed CPUs gets all of them."""
    mask = env.get(BIND_ENV, "").strip()
    if mask in UNBOUND:
        return env, None
    allowed = allowed if allowed is not None else os.sched_getaffinity(0)
    try:
        ranks = [parse_cpus(rank) for rank in mask.split("|")]
    except ValueError:
        raise CpuBindingError(f"{BIND_ENV}={mask!r} is not a CPU list (form: 0-3,8, one list per worker separated "
                              "by |)") from None
    if all(set(rank) <= allowed for rank in ranks):
        return env, None
    fitted = [[cpu for cpu in rank if cpu in allowed] for rank in ranks]
    if len(fitted) == 1 and not fitted[0]:
        fitted = [sorted(allowed)]
    for i, rank in enumerate(fitted):
        if not rank:
            raise CpuBindingError(f"{BIND_ENV}={mask!r}: worker {i} is bound to none of the CPUs this server may use "
                                  f"({format_cpus(sorted(allowed))}): bind each worker to cores inside that set")
    fitted_mask = "|".join(map(format_cpus, fitted))
    note = (f"kimi-eagle: {BIND_ENV}={mask} names CPUs outside those this server may use "
            f"({format_cpus(sorted(allowed))}): bound to {fitted_mask}")
    return {**env, BIND_ENV: fitted_mask}, note
