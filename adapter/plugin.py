"""The `vllm.general_plugins` entry point. vLLM calls it in every process it starts (API server, engine
core, workers), possibly more than once per process, so everything here is idempotent."""

from __future__ import annotations

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from adapter import cpu_fixes

    cpu_fixes.apply()
