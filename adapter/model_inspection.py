"""vLLM's inspection of a model class, in the process that asks for it, on a CPU.

vLLM 0.32 learns what a lazily registered architecture supports (pipeline parallel, EAGLE-3, multimodal, ...) by
importing its module in a child Python (`vllm/model_executor/models/registry.py: _run_in_subprocess`), "to avoid
initializing CUDA" in the caller, and caches the answer under `VLLM_CACHE_ROOT/modelinfos`. Each child imports vLLM
anew: on one core of the 2-core machine that is about 20 s per architecture, so a first start of the tiny pair spent
40 s there (Kimi-K2.5 and the EAGLE-3 draft), and `kimi-eagle serve`'s pre-flight check paid it again beside the
server. A CPU platform has no CUDA to spare: there the same function runs in the caller, where the imports are
already made (0.4 s for Kimi-K2.5). The answer and its cache are vLLM's own; only where it is computed changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kimi_eagle.adapter import compat, surface

_T = TypeVar("_T")


def _in_this_process(fn: Callable[[], _T]) -> _T:
    return fn()


def install() -> bool:
    """On a CPU, inspect model classes in the calling process; True when installed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not compat.supported():
        return False
    # `inspect_model_cls` looks it up in the module at each call.
    surface.wrap("vllm.model_executor.models.registry", "_run_in_subprocess", lambda _: _in_this_process)
    return True
