"""The machine a benchmark ran on, as its results record it, and the compile cache its servers start with."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import psutil

from kimi_eagle.bench.result import Machine
from kimi_eagle.cpu_kernels import kernel_report, this_cpu


def machine_now(load_before: tuple[float, float, float]) -> Machine:
    """This machine at the end of a run; `load_before` is os.getloadavg() when it began."""
    isa = this_cpu()
    kernels = kernel_report(isa)
    return Machine(cpu_model=isa.model, isa=isa.name, vllm_kernels=kernels.kernel_build if kernels else None,
                   cpus=os.cpu_count() or 0,
                   memory_gib=round(psutil.virtual_memory().total / 2**30, 1),
                   load_average_before=list(load_before), load_average_after=list(os.getloadavg()),
                   vllm_version=_version("vllm"), torch_version=_version("torch"))


def torch_compile_cache() -> Path:
    """The torch.compile cache of the vLLM servers started from this process (`VLLM_CACHE_ROOT`, vLLM's default)."""
    return Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "torch_compile_cache"


def compile_cache_note() -> str:
    """Cold starts are faster when vLLM's torch.compile cache already holds the graphs: say which case this was."""
    cache = torch_compile_cache()
    files = sum(1 for p in cache.rglob("*") if p.is_file()) if cache.is_dir() else 0
    state = "warm (for the configurations compiled before)" if files else "empty"
    shown = f"~/{cache.relative_to(Path.home())}" if cache.is_relative_to(Path.home()) else str(cache)
    return (f"vLLM's torch.compile cache ({shown}) held {files} files when the run began: the cold starts here are "
            f"process starts with a {state} compile cache")


def _version(module: str) -> str | None:
    for dist in (module, f"{module}-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
