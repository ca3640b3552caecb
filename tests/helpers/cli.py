"""The project as its users run it: `kimi-eagle` in a child process, from the checkout's root."""

from __future__ import annotations

import os
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
