"""Start vLLM's own OpenAI-compatible server for a profile, wait until it answers, stop it cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

import requests

from kimi_eagle.processes import interrupts_deferred, sigterm_as_keyboard_interrupt
from kimi_eagle.serve.command import ServeCommand
from kimi_eagle.serve.cpu_binding import CpuBindingError, fit_to_allowed
from kimi_eagle.serve.server_log import describe_failure


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message names the root cause its log gave."""


def start(command: ServeCommand, log_path: Path | None = None, append: bool = False,
          echo: bool = False, held: bool = False) -> subprocess.Popen:
    """Start the server in the background, its output to `log_path` (added to the end with `append`: a restart),
    and with `echo` to our stderr as well, as it comes; with `held` too, from `process.tee.show()` on (what came
    before is shown then)."""
    build_fixture_weights(command)
    try:
        env, binding_note = fit_to_allowed({**os.environ, **command.env})
    except CpuBindingError as exc:
        raise ServerStartError(str(exc)) from None
    out = open(log_path, "a" if append else "w") if log_path else None  # noqa: SIM115 - owned by the child process
    if binding_note:
        for stream in (out, sys.stderr if echo else None):
            if stream:
                print(binding_note, file=stream, flush=True)
    # A new session, so that one signal reaches the API server and every engine process it started.
    process = subprocess.Popen(command.argv, env=env, stdout=subprocess.PIPE if echo else out,
                               stderr=subprocess.STDOUT if out or echo else None, start_new_session=True,
                               text=echo, errors="replace" if echo else None)
    if echo:
        # Kept on the process, so that a failed start is explained only once its last lines are in the log.
        process.tee = _Tee(process.stdout, out, held=held)
        process.tee.start()
    return process


def build_fixture_weights(command: ServeCommand) -> None:
    """The real-width fixture pair's weights are built on first use, before the first engine that loads them."""
    from kimi_eagle.fixtures.real_width import build_for

    build_for(command.target, command.draft)


class _Tee(threading.Thread):
    """The server's output to its log as it comes, and to our stderr unless held: a server stopped by a refusal of
    the checks that ran while it started printed nothing the user should read."""

    def __init__(self, lines: Iterator[str], log: TextIO | None, held: bool) -> None:
        super().__init__(daemon=True)
        self.lines, self.log = lines, log
        self._lock = threading.Lock()
        self._held: list[str] | None = [] if held else None

    def show(self) -> None:
        """Echo the output from now on, what was held first."""
        with self._lock:
            if self._held is not None:
                sys.stderr.writelines(self._held)
                self._held = None

    def run(self) -> None:
        for line in self.lines:
            with self._lock:
                if self._held is None:
                    sys.stderr.write(line)
                else:
                    self._held.append(line)
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
        if self.log is not None:
            self.log.close()


@contextmanager
def started(command: ServeCommand, log_path: Path | None = None, append: bool = False, echo: bool = False,
            held: bool = False) -> Iterator[subprocess.Popen]:
    """The server process for the duration of the block, stopped at its end whatever ends it. An interrupt that
    lands while the process is being started takes effect once its handle is held, so it cannot orphan the server
    (which runs in a session of its own and would not get the signal)."""
    process = None
    try:
        with interrupts_deferred():
            process = start(command, log_path, append, echo, held)
        yield process
    finally:
        if process is not None:
            stop(process)


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float, log_path: Path | None = None,
                 api_key: str | None = None) -> float:
    """Poll /health until it answers 200; fail fast if the process exits. Returns the seconds waited."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            if hasattr(process, "tee"):
                process.tee.join(timeout=10)
            raise ServerStartError(f"vLLM exited with code {process.returncode} before it was ready; "
                                   f"{describe_failure(log_path, api_key)}")
        try:
            if requests.get(f"{url}/health", timeout=2, headers=headers).status_code == 200:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise ServerStartError(f"vLLM did not answer {url}/health within {timeout_s:.0f}s; "
                           f"{describe_failure(log_path, api_key)}")


def stop(process: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGINT -> wait -> SIGKILL, to the whole process group (API server, engine core, workers)."""
    if process.poll() is not None:
        return
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGKILL, 5)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def serve_in_foreground(command: ServeCommand, engine: str, ready_timeout_s: float, ready_note: str = "",
                        check_while_starting: Callable[[], str | None] | None = None,
                        started_at: float | None = None) -> int:
    """Start the server, print the URL when it answers, and stay until it exits or Ctrl-C / SIGTERM, which stop
    every process it started. Raises ServerStartError when it does not come up.

    `check_while_starting` runs once the server is started: it returns why the server must not run, or None. Its
    seconds overlap the server's own imports, which load nothing; the server's output is held until it has passed,
    and a refusal stops the server (raised as ServerStartError with that message). `Ready in` counts from
    `started_at` (`time.perf_counter()` when the command began; default: now)."""
    # Counted from after the check while starting, a warm start on one core printed "Ready in 20s" 33 s after the
    # command: the seconds a user waits include the pre-flight checks and that check.
    t0 = time.perf_counter() if started_at is None else started_at
    print(f"Starting {engine}: {command.printable()}", file=sys.stderr, flush=True)
    # Its output goes to the terminal as it comes, and to a log that a failed start is explained from.
    log = Path(tempfile.mkstemp(prefix="kimi-eagle-serve-", suffix=".log")[1])
    # The server runs in its own session, so a signal reaches only us: SIGTERM takes the same clean stop as Ctrl-C.
    try:
        with sigterm_as_keyboard_interrupt(), \
                started(command, log, echo=True, held=check_while_starting is not None) as process:
            try:
                if check_while_starting is not None:
                    refusal = check_while_starting()
                    if refusal is not None:
                        raise ServerStartError(refusal)  # `started` stops the server on the way out
                    process.tee.show()
                wait_healthy(process, command.url, ready_timeout_s, log, api_key=command.api_key)
                print(f"Ready in {time.perf_counter() - t0:.0f}s: {command.url}/v1  model: "
                      f"{command.served_model_name}{ready_note}", flush=True)
                process.wait()
                return _exited_while_serving(process, log, command.api_key)
            except KeyboardInterrupt:
                print(f"\nStopping {engine} ...", file=sys.stderr, flush=True)
                return 0
    except KeyboardInterrupt:  # it landed while the process was being started: `started` has stopped it
        print(f"\nStopped {engine} (interrupted while starting)", file=sys.stderr, flush=True)
        return 0


def _exited_while_serving(process: subprocess.Popen, log: Path, api_key: str | None) -> int:
    """A server that stops by itself stopped for a reason: vLLM's API server exits once its engine died (with code
    0 on some paths), and its last words, "EngineCore encountered an issue", hide the engine's error above them."""
    process.tee.join(timeout=10)  # the log is complete only once the tee has drained the pipe
    print(f"vLLM exited with code {process.returncode} while serving; {describe_failure(log, api_key)}",
          file=sys.stderr, flush=True)
    return process.returncode or 1


@contextmanager
def running_server(command: ServeCommand, log_path: Path | None = None, timeout_s: float = 300) -> Iterator[float]:
    """Run the server for the duration of the block; yields the seconds it took to become healthy."""
    with started(command, log_path) as process:
        yield wait_healthy(process, command.url, timeout_s, log_path, command.api_key)
