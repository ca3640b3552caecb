"""Result files are written whole or not at all: a temporary file in the same folder, then a rename."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Write `data` to `path` so that a reader sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_model(path: Path, model: BaseModel) -> Path:
    return write_atomic(path, model.model_dump_json(indent=2) + "\n")


def write_jsonl(path: Path, rows: Iterable[BaseModel | dict]) -> Path:
    lines = [r.model_dump_json() if isinstance(r, BaseModel) else json.dumps(r) for r in rows]
    return write_atomic(path, "".join(line + "\n" for line in lines))
