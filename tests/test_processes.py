"""kimi_eagle.processes: the interrupt handling every command that starts processes relies on."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kimi_eagle.processes import interrupts_deferred, sigterm_as_keyboard_interrupt


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_while_starting_a_process_lands_after_the_start(sig: signal.Signals) -> None:
    # Ctrl-C as in a terminal, whatever disposition this test process inherited (a background job ignores SIGINT).
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        started = False
        with sigterm_as_keyboard_interrupt(), pytest.raises(KeyboardInterrupt), interrupts_deferred():
            os.kill(os.getpid(), sig)
            time.sleep(0.2)  # without the deferral the interrupt is raised here, before the start is recorded
            started = True
        assert started
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers are put back
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_no_interrupt_means_nothing_is_raised() -> None:
    with interrupts_deferred():
        pass
