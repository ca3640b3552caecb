"""Sharded copies of the fixture checkpoints in which one tensor is stored twice (issue 34): real safetensors files,
written with the safetensors library from the shipped model.safetensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from kimi_eagle.checks.checkpoint import INDEX_NAME

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def shard_with_copy(source: Path, out: Path, name: str, *, differ: bool, index: bool = False,
                    files: tuple[str, str] = SHARDS) -> Path:
    """`source` (config, tokenizer, one model.safetensors) split into the two `files`, with `name` in both: the
    second file's copy scaled by 0.5 (`differ`) or byte for byte the first's. `index` writes an index naming both
    files, which maps `name` to the first."""
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(source / "model.safetensors")
    names = sorted(tensors)
    halves = ({n: tensors[n] for n in names[::2]}, {n: tensors[n] for n in names[1::2]})
    copy = tensors[name] * 0.5 if differ else tensors[name]
    halves[0][name], halves[1][name] = tensors[name], copy
    for file, half in zip(files, halves):
        save_file({k: v.contiguous() for k, v in half.items()}, out / file, metadata={"format": "pt"})
    if index:
        weight_map = {**dict.fromkeys(halves[1], files[1]), **dict.fromkeys(halves[0], files[0])}
        (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out
