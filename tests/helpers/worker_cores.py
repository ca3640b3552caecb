"""Each pytest-xdist worker on cores of its own, a worker that replaces a crashed one included.

Two engines on the same cores slow each other by far more than they gain: each worker's OpenMP threads spin on
every core, and on the 2-core machine a server started beside a loaded one was not ready after 600 s, where it
starts in 27 s on one core of its own. So each worker (and every server it starts: children inherit the affinity,
and serve binds a profile's cores inside it) takes one of `PYTEST_XDIST_WORKER_COUNT` shares of the CPUs.

A share is a slot that a worker holds by an exclusive `flock` on a file of this run's (a folder named by the xdist
controller's pid: every worker, a replacement too, is its child), for as long as it lives: when
a worker dies (a test that crashes the interpreter), the kernel releases its lock and the worker xdist starts in its
place, named gwN with N >= the worker count, takes the share it left. Naming the share by the worker's number gave
that replacement an empty list of CPUs: `sched_setaffinity` raised EINVAL and the whole run ended (INTERNALERROR)."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import warnings
from pathlib import Path

_held: list[int] = []  # the slot's file descriptor, open (and locked) until this process ends


def slots_dir(controller_pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"kimi-eagle-worker-cores-{controller_pid}"


def share(cpus: list[int], slot: int, count: int) -> list[int]:
    """Slot `slot` of `count` shares of `cpus`: equal shares, the last taking what is left over."""
    size = len(cpus) // count
    return cpus[slot * size:] if slot == count - 1 else cpus[slot * size:(slot + 1) * size]


def claim_slot(directory: Path, count: int, preferred: int) -> int | None:
    """Lock the first free slot of `count`, `preferred` first; None when every slot is held."""
    directory.mkdir(parents=True, exist_ok=True)
    for slot in [preferred % count, *(s for s in range(count) if s != preferred % count)]:
        fd = os.open(directory / f"slot-{slot}", os.O_RDWR | os.O_CREAT, 0o600)  # not inherited by children
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held.append(fd)
        return slot
    return None


def give_this_worker_cores_of_its_own() -> list[int] | None:
    """In an xdist worker, bind this process to its share of the CPUs and return it; None where nothing is split
    (no xdist, one worker, fewer CPUs than workers)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    if worker is None or count < 2 or len(cpus) < count:
        return None
    slot = claim_slot(slots_dir(os.getppid()), count, int(worker.removeprefix("gw")))
    if slot is None:  # a process that outlived its worker holds its lock: share rather than stop the run
        warnings.warn(f"xdist worker {worker}: every one of the {count} core shares is held; it runs on all of "
                      f"{cpus}", stacklevel=1)
        return None
    mine = share(cpus, slot, count)
    os.sched_setaffinity(0, mine)
    return mine


def remove_slots() -> None:
    """In the controller, once the run ends: its workers' slot files."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        shutil.rmtree(slots_dir(os.getpid()), ignore_errors=True)
