"""Read what a checkpoint folder holds without reading its data: config.json and safetensors headers.

A Kimi-K2.5 target is 64 shards and about 554 GB: everything about it comes from `config.json`, the
`model.safetensors.index.json` weight map and the 8-byte-length-prefixed JSON header of each shard.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INDEX_NAME = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the format's own limit
# Weight files that are pickles: never loaded here (unpickling runs code from the file), only named.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Bytes per element of each safetensors dtype (the format's own table).
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_DTYPES = frozenset({"F8_E4M3", "F8_E5M2", "F16", "BF16", "F32", "F64"})


class CheckpointError(ValueError):
    """A folder that cannot be read as a checkpoint; the message names the file and the fix."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' names: BF16, F32, I64, BOOL, ...
    file: Path


@dataclass
class Checkpoint:
    folder: Path
    config: dict
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    other_weight_files: list[Path] = field(default_factory=list)  # .bin / .pt: not checked


def read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder} has no config.json: give the folder of a saved checkpoint")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def read_raw_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(the header's length in bytes, the header as JSON: name -> dtype, shape, data_offsets, and `__metadata__`)
    of one .safetensors file, read from its first bytes only."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {length} is not plausible: not a safetensors file?")
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object")
    return length, header


def tensor_entries(header: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tensors of a raw header, without its `__metadata__`."""
    return {name: entry for name, entry in header.items() if name != "__metadata__"}


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensor table of one .safetensors file, read from its header only."""
    _, header = read_raw_header(path)
    return {name: TensorInfo(name, tuple(entry["shape"]), entry["dtype"], path)
            for name, entry in tensor_entries(header).items()}


def shard_names(index: Path) -> list[str]:
    """The shard files an index's weight map names, each once."""
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} has no usable weight_map ({exc})") from None


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        files = [folder / name for name in shard_names(index)]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise CheckpointError(f"{index} names {len(missing)} missing shard(s), e.g. {missing[0]}: "
                                  "the download is incomplete")
        return files
    return sorted(folder.glob("*.safetensors"))


def open_checkpoint(folder: Path) -> Checkpoint:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    checkpoint = Checkpoint(folder=folder, config=read_config(folder))
    for path in safetensors_files(folder):
        checkpoint.tensors.update(read_header(path))
    checkpoint.other_weight_files = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    return checkpoint


def load_numpy(info: TensorInfo):
    """One integer or boolean tensor as a numpy array (d2t, t2d): no torch needed."""
    from safetensors import safe_open

    with safe_open(str(info.file), framework="numpy") as f:
        return f.get_tensor(info.name)


def load_torch(info: TensorInfo):
    """One tensor through torch (bf16 weights). Imported here: the checks must not need torch to import."""
    from safetensors import safe_open

    with safe_open(str(info.file), framework="pt") as f:
        return f.get_tensor(info.name)
