"""Child processes that see Ctrl-C as they would in a terminal."""

from __future__ import annotations

import signal


def ctrl_c_as_in_a_terminal() -> None:
    """`preexec_fn` for a child that a test interrupts with SIGINT. A background job (`make test &`, some CI
    runners) starts with SIGINT ignored; children inherit that, and Python then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
