"""On a CPU, the engine core runs on its worker's cores.

vLLM's CPU layout binds each worker's OpenMP threads to its cores and reserves the rest "for the scheduler process"
(`vllm/utils/ompmultiprocessing.py`), but binds nothing else: the engine core, which busy-waits on the worker's
replies (`SpinCondition`, 1 s of `sched_yield` after each read), floats over every core with the API server and the
clients. On the 2-core machine this project is measured on, that made throughput at 4-16 requests in flight
bimodal: the same server gave 2,400 or 310 tokens/s at 16 in flight from one sample to the next (the engine core
spinning on the API server's core). Pinned to the worker's cores, where it only ever waits for that worker, it
leaves the reserved cores to the API server, and throughput at 4-16 in flight is steady at its high mode.

`KIMI_EAGLE_CPU_LAYOUT=vllm` keeps vLLM's own layout.
"""

from __future__ import annotations

import contextlib
import logging
import os

from kimi_eagle import envs
from kimi_eagle.adapter import compat, surface

logger = logging.getLogger("vllm.kimi_eagle")


def worker_cores(vllm_config) -> set[int]:
    """The cores vLLM binds this engine's workers' OpenMP threads to (empty: it binds none)."""
    from vllm.utils.ompmultiprocessing import OMPProcessManager

    manager = OMPProcessManager(vllm_config)
    if manager.skip_setup:
        return set()
    return {cpu for cpus in manager.cpu_lists for cpu in cpus}


def has_worker_processes(vllm_config) -> bool:
    """Whether this engine's workers run in processes of their own, whose cores vLLM binds."""
    return vllm_config.parallel_config.distributed_executor_backend == "mp"


def pin_process(cores: set[int]) -> None:
    """Every thread of this process onto `cores` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        # A thread that ended meanwhile is gone; one we may not move keeps its mask.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.sched_setaffinity(int(tid), cores)


def install() -> bool:
    if envs.cpu_layout() != "shared":
        return False
    if not compat.supported():
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    def make(original):
        def run_busy_loop(self):
            # Here every thread of the engine core exists and its workers are bound: what vLLM reserved stays free.
            if not has_worker_processes(self.vllm_config):
                return original(self)
            cores = worker_cores(self.vllm_config) & os.sched_getaffinity(0)
            if cores:
                pin_process(cores)
                logger.info("kimi-eagle: engine core pinned to its workers' cores %s (the others stay for the API "
                            "server; %s=vllm keeps vLLM's layout)", sorted(cores), envs.CPU_LAYOUT.name)
            return original(self)

        return run_busy_loop

    surface.wrap("vllm.v1.engine.core", "EngineCoreProc.run_busy_loop", make)
    return True
