"""What a server's log says about why it did not start: the root cause, not the last frames of a traceback.

vLLM's engine runs in child processes (`EngineCore`, `Worker`) whose log lines carry the process name and level,
e.g. `(Worker pid=3296) ERROR 12-01 01:07:01 [multiproc_executor.py:1063] ValueError: Available memory on node 0
...`. When one of them fails, the API server's own traceback follows and ends in `RuntimeError: Engine core
initialization failed. See root cause above.`: the last lines of the log are the least informative ones."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from kimi_eagle.serve.redact import redact_text, secrets_in

# `(Worker pid=12) ERROR 12-01 01:07:01 [file.py:10] message` (the level, date and time are fixed-width words).
_ENGINE_ERROR = re.compile(r"^\((?P<process>[\w.-]+) pid=\d+\) ERROR \S+ \S+ \[[^\]]*\] ?(?P<message>.*)$")
# The closing line of a traceback: `ValueError: ...`, `torch.OutOfMemoryError: ...`, `AssertionError`.
_EXCEPTION = re.compile(r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit)(?::\s.*)?$")


def root_cause(lines: Iterable[str]) -> str | None:
    """The first exception an engine process logged, named with its process; else the first error line an engine
    process logged; else the last exception of a traceback printed without a process prefix (the API server's
    own); None when the log holds none of these."""
    first_engine_error = last_plain_exception = None
    for line in lines:
        line = line.rstrip()
        logged = _ENGINE_ERROR.match(line)
        if logged is None:
            if _EXCEPTION.match(line):
                last_plain_exception = line
            continue
        message = logged["message"].strip()
        if _EXCEPTION.match(message):
            return f"{message} (in vLLM's {logged['process']} process)"
        if first_engine_error is None and message and not message.startswith(("Traceback", "File ")):
            first_engine_error = f"{message} (in vLLM's {logged['process']} process)"
    return first_engine_error or last_plain_exception


def describe_failure(log_path: Path | None, api_key: str | None, tail_lines: int = 12) -> str:
    """The root cause, then where the whole log is; the log's last lines only when no root cause was found. Every
    secret redacted: vLLM prints its arguments and, on some errors, request headers, and this text goes into
    exceptions, terminals and CI logs."""
    if log_path is None or not log_path.exists():
        return ""
    lines = log_path.read_text(errors="replace").splitlines()
    cause = root_cause(lines)
    text = (f"root cause: {cause}\nthe whole log: {log_path}" if cause else
            f"no error line in its log ({log_path}); its last lines:\n" + "\n".join(lines[-tail_lines:]))
    return redact_text(text, [api_key or "", *secrets_in()])
