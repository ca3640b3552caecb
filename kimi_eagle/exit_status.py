"""The exit status of a refused command and the one line that says why: shared by every subcommand, so that none
imports the `kimi-eagle` program (`kimi_eagle.cli`), which imports them all."""

from __future__ import annotations

import sys

EXIT_REFUSED = 2  # bad input or a refused start: the message says what and how to fix it (argparse's own code)


def fail(command: str, message: str) -> int:
    """One line on stderr that names the subcommand and the problem; returns the exit status to give."""
    print(f"kimi-eagle {command}: {message}", file=sys.stderr)
    return EXIT_REFUSED
