"""The static checks of `doctor`, run before the engine starts: refusals stop `serve`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from serve.command import ServeCommand
from serve.integrity import check_weight_folder

HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as vLLM resolves from a model hub


def weights_are_whole(command: ServeCommand) -> bool:
    """True when the weight files of the target and the draft can be loaded whole. A truncated or re-labelled file
    is refused here, by name, instead of failing minutes into loading (or loading as garbage)."""
    problems = [p for folder in (command.target, command.draft) if folder for p in check_weight_folder(folder)]
    if problems:
        print("pre-flight: the weights on disk cannot be loaded whole, so no engine was started:\n"
              + "\n".join(f"- {p.render()}" for p in problems), file=sys.stderr)
    return not problems


def preflight(command: ServeCommand) -> bool:
    """True when the pair may be served. Prints every finding that is not OK (warnings and refusals for vLLM)."""
    from adapter.checks import Severity, refusal_message, run_static_checks

    if not weights_are_whole(command):
        return False
    if command.draft is None:
        return True
    draft = Path(command.draft)
    if not draft.exists():
        if HUB_NAME.fullmatch(command.draft):
            print(f"pre-flight: {command.draft} is not a local folder: vLLM downloads it; the draft checks are "
                  "skipped (run `kimi-eagle doctor` on the downloaded folder)", file=sys.stderr)
            return True
        print(f"pre-flight: the draft {draft} does not exist", file=sys.stderr)
        return False
    target = Path(command.target)
    if not target.is_dir():
        # a hub name: vLLM downloads it; the checks against it need the files here
        print(f"pre-flight: {command.target} is not a local folder: the checks against the target are skipped",
              file=sys.stderr)
    findings = [f for f in run_static_checks(draft, target if target.is_dir() else None) if f.applies_to("vllm")]
    for f in findings:
        if f.severity == Severity.WARNING:
            print(f"pre-flight warning [{f.code}] {f.title}: found {f.found}; expected {f.expected}. Fix: {f.fix}",
                  file=sys.stderr)
    message = refusal_message(findings, engine="vllm")
    if message:
        print(message, file=sys.stderr)
        return False
    return True
