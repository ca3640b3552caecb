"""The static checks of `doctor`, run before the engine starts: refusals stop `serve`."""

from __future__ import annotations

import sys
from pathlib import Path

from serve.command import ServeCommand


def preflight(command: ServeCommand) -> bool:
    """True when the pair may be served. Prints every finding that is not OK."""
    if command.draft is None:
        return True
    for path in (command.target, command.draft):
        if not Path(path).exists():
            print(f"pre-flight: {path} does not exist", file=sys.stderr)
            return False
    return True
