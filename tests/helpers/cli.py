"""The project as its users run it: `kimi-eagle` in a child process, from the checkout's root."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # the checkout
DATA = REPO / "tests" / "data"
CLI = [sys.executable, "-m", "kimi_eagle.cli"]


def run_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`kimi-eagle ARGS`, its output captured as text; `env` is added to ours."""
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def run_cli_here(capfd: pytest.CaptureFixture[str], *args: str, env: dict[str, str] | None = None
                 ) -> subprocess.CompletedProcess:
    """`kimi-eagle ARGS` by its `main`, in this process, with what `run_cli` gives: for the commands that check with
    vLLM's own code (a dry run), because a child imports vLLM again each time, 9-10 s on one core, and this process
    once. Where the console script and the process's own exit are what is tested, `run_cli` and the e2e tests."""
    from kimi_eagle.cli import main

    capfd.readouterr()  # what came before is not this command's
    with mock.patch.dict(os.environ, env or {}), contextlib.chdir(REPO):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's own exits: --help, a bad flag
            code = exc.code if isinstance(exc.code, int) else 1
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess([*CLI, *args], code, out, err)


def exit_message(done: subprocess.CompletedProcess, expected: int = 0) -> str:
    """An assertion message for a child that exited other than `expected`: its first line says what ran, what exit was
    expected and what came, with the last line the child wrote (pytest's one-line summary shows that line), then the
    end of its output."""
    args = [str(a) for a in done.args]
    command = shlex.join(["kimi-eagle", *args[len(CLI):]] if args[:len(CLI)] == CLI else args)
    output = (done.stdout or "") + (done.stderr or "")
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "(no output)")
    return f"`{command}` exited {done.returncode}, expected {expected}: {last}\n{output[-3000:]}"
