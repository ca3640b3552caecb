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


def test_no_interrupt_means_nothing_is_raised_and_the_handlers_are_put_back() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupts_deferred():
        inside = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    assert inside[0] is inside[1] and inside[0] not in before  # both deferred by one handler inside the block
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_server_interrupted_while_starting_is_stopped_not_orphaned(sig: signal.Signals, monkeypatch) -> None:
    import subprocess
    import sys

    from kimi_eagle.serve import launch
    from kimi_eagle.serve.command import ServeCommand

    # A child in a session of its own, as vLLM runs: the signal reaches only us, so only we can stop it.
    command = ServeCommand(argv=[sys.executable, "-c", "import time; time.sleep(120)"], env={},
                           url="http://127.0.0.1:9", served_model_name="none", target="none", draft=None)
    children: list[subprocess.Popen] = []
    real_start = launch.start

    def start_then_interrupted(*args, **kwargs) -> subprocess.Popen:
        children.append(real_start(*args, **kwargs))
        os.kill(os.getpid(), sig)  # lands right after the fork, before the caller holds the handle
        time.sleep(0.2)
        return children[-1]

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    monkeypatch.setattr(launch, "start", start_then_interrupted)
    try:
        with sigterm_as_keyboard_interrupt(), pytest.raises(KeyboardInterrupt), launch.started(command):
            pytest.fail("the block must not run: the interrupt came first")
        assert len(children) == 1
        assert children[0].poll() is not None, "the server outlived the interrupt"
    finally:
        signal.signal(signal.SIGINT, inherited)
        for p in children:
            if p.poll() is None:
                p.kill()


def test_vllms_processes_collect_garbage_less_often_from_their_first_import() -> None:
    """The API server runs serve/vllm_server.py as its main module; each engine core and worker that vLLM spawns
    imports it again first, as `__mp_main__` (multiprocessing's spawn, for a `-m` main module), before torch."""
    import subprocess
    import sys

    from kimi_eagle.processes import GC_YOUNGEST_THRESHOLD
    from kimi_eagle.serve.command import VLLM_SERVER

    probe = ("import gc, runpy, sys\n"
             f"runpy.run_module({VLLM_SERVER!r}, run_name='__mp_main__', alter_sys=True)\n"
             "print(gc.get_threshold(), 'torch' in sys.modules, 'vllm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [f"({GC_YOUNGEST_THRESHOLD},", "10,", "10)", "False", "False"], \
        f"expected the threshold set and nothing heavy imported yet; got {done.stdout}"


def test_the_kimi_eagle_program_collects_garbage_less_often(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from kimi_eagle import cli
    from kimi_eagle.processes import GC_YOUNGEST_THRESHOLD

    seen: list[tuple[int, int, int]] = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(gc.get_threshold()) or 0)
    saved = gc.get_threshold()
    try:
        assert cli.run() == 0
    finally:
        gc.set_threshold(*saved)
    assert seen == [(GC_YOUNGEST_THRESHOLD, saved[1], saved[2])], "main() ran with the collector's defaults"


def test_what_is_loaded_is_frozen_and_young_garbage_collected_first() -> None:
    import gc
    import weakref

    from kimi_eagle.processes import freeze_what_is_loaded

    class Node:
        pass

    garbage = Node()
    garbage.itself = garbage  # a cycle: only the collector frees it
    garbage_alive = weakref.ref(garbage)
    del garbage
    loaded = [[]]
    try:
        freeze_what_is_loaded()
        assert garbage_alive() is None, "garbage of the young generations was frozen for good, not collected"
        assert not any(o is loaded for o in gc.get_objects()), "an object held at the freeze is still collected"
        later = [[]]
        assert any(o is later for o in gc.get_objects()), "an object made after the freeze is not collected"
    finally:
        gc.unfreeze()
