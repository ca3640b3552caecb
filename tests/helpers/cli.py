"""The project as its users run it: `kimi-eagle` in a child process, from the checkout's root."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())  # the checkout
DATA = REPO / "tests" / "data"
CLI = [sys.executable, "-m", "kimi_eagle.cli"]


def run_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`kimi-eagle ARGS`, its output captured as text; `env` is added to ours."""
    return subprocess.run([*CLI, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def exit_message(done: subprocess.CompletedProcess, expected: int = 0) -> str:
    """An assertion message for a child that exited other than `expected`: its first line says what ran, what exit was
    expected and what came, with the last line the child wrote (pytest's one-line summary shows that line), then the
    end of its output."""
    args = [str(a) for a in done.args]
    command = shlex.join(["kimi-eagle", *args[len(CLI):]] if args[:len(CLI)] == CLI else args)
    output = (done.stdout or "") + (done.stderr or "")
    last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "(no output)")
    return f"`{command}` exited {done.returncode}, expected {expected}: {last}\n{output[-3000:]}"
