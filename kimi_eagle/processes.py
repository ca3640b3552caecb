"""What every command that starts processes needs: a free local port, SIGTERM handled like Ctrl-C, and a garbage
collector tuned for processes that import torch and vLLM.

The servers and Locust processes we start run in sessions of their own, so a signal sent to us never reaches them;
we stop them ourselves, on the same path for Ctrl-C and for `kill`."""

from __future__ import annotations

import gc
import signal
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

# CPython collects its youngest generation every 700 new container objects, and every hundredth collection is a
# full one once the heap has grown by a quarter: importing torch and vLLM, millions of objects and no garbage, scans
# the whole growing heap nine times. With this threshold, on one core of the 2-core machine (AMD EPYC, three imports
# each), the API server's imports took 4.8-4.9 s instead of 5.9-6.1 s, the engine core's 5.0-5.1 s instead of
# 6.3-6.4 s; 100,000 gained no more. The older generations keep their defaults: garbage that lives longer is still
# collected as often as before.
GC_YOUNGEST_THRESHOLD = 10_000


def collect_garbage_less_often() -> None:
    """Raise the garbage collector's threshold for new objects in this process (the older generations keep theirs)."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNGEST_THRESHOLD, older, oldest)


def freeze_what_is_loaded() -> None:
    """Move the objects this process holds now out of the collector's generations, as vLLM does once an engine has
    started (`freeze_gc_heap`), but before it loads anything: vLLM collects the whole heap after loading each model,
    after its warm-up and before that freeze, six full collections of about 700,000 objects in an engine core (the
    imported modules, for the most part), 0.36 s each on one core. Frozen, each took about 0.05 s, and a warm start
    of the default profile answered /health in 14.6 s instead of 17.6 s with the threshold alone (the median of five
    starts each, alternated; the same memory). The young generations are collected first, so that their garbage is
    not kept for good."""
    gc.collect(1)
    gc.freeze()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def sigterm_as_keyboard_interrupt() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt, so the caller's Ctrl-C path stops what it started."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def interrupt(_signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Ctrl-C or SIGTERM inside the block takes effect when it ends. Around starting a child process: an interrupt
    that lands inside `subprocess.Popen`, after the fork, would otherwise lose the handle of a child that keeps
    running (and, for Locust, later writes results that look complete)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []

    def remember(signum: int, _frame: FrameType | None) -> None:
        pending.append(signum)

    previous = {s: signal.signal(s, remember) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    for signum in pending:  # delivered now, to whatever handles it outside the block
        signal.raise_signal(signum)
