"""Read what a checkpoint folder holds without reading its data: config.json and safetensors headers.

A Kimi-K2.5 target is 64 shards and about 554 GB: everything about it comes from `config.json`, the
`model.safetensors.index.json` weight map and the 8-byte-length-prefixed JSON header of each shard.
"""

from __future__ import annotations

import json
import re
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
    span: tuple[int, int] | None = None  # where its bytes lie in the file (begin, end), when the header says


@dataclass
class Checkpoint:
    folder: Path
    config: dict
    # name -> the copy the engine keeps: with the same name in several files, the one read last (`read_order`)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    other_weight_files: list[Path] = field(default_factory=list)  # .bin / .pt: not checked
    # name -> every copy, in reading order, of each name stored in more than one of the files the engine reads
    copies: dict[str, list[TensorInfo]] = field(default_factory=dict)
    weight_map: dict[str, str] | None = None  # the index's name -> file, when the folder has an index


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


def _span(data_start: int, entry: dict[str, Any]) -> tuple[int, int] | None:
    offsets = entry.get("data_offsets")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
        return None  # the weight-file checks name a broken header; the span is only needed to compare copies
    return data_start + offsets[0], data_start + offsets[1]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensor table of one .safetensors file, read from its header only."""
    length, header = read_raw_header(path)
    return {name: TensorInfo(name, tuple(entry["shape"]), entry["dtype"], path, _span(8 + length, entry))
            for name, entry in tensor_entries(header).items()}


def read_weight_map(index: Path) -> dict[str, str]:
    """An index's weight map: tensor name -> the file the index puts it in."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not an object of file names")
        return weight_map
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} has no usable weight_map ({exc})") from None


def shard_names(index: Path) -> list[str]:
    """The shard files an index's weight map names, each once."""
    return sorted(set(read_weight_map(index).values()))


def read_order(path: Path) -> list[int | str]:
    """vLLM 0.32's order of reading a checkpoint's files: by file name, runs of digits compared as numbers
    (`_natural_sort_key`, applied by `safetensors_weights_iterator` in model_loader/weight_utils.py)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def safetensors_files(folder: Path) -> list[Path]:
    """The files vLLM 0.32 reads, in the order it reads them: with an index, the files it names (vLLM drops the
    others, `filter_duplicate_safetensors_files`); without one, every *.safetensors of the folder."""
    index = folder / INDEX_NAME
    if index.is_file():
        files = [folder / name for name in shard_names(index)]
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise CheckpointError(f"{index} names {len(missing)} missing shard(s), e.g. {missing[0]}: "
                                  "the download is incomplete")
        return sorted(files, key=read_order)
    return sorted(folder.glob("*.safetensors"), key=read_order)


def open_checkpoint(folder: Path) -> Checkpoint:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder")
    checkpoint = Checkpoint(folder=folder, config=read_config(folder))
    index = folder / INDEX_NAME
    if index.is_file():
        checkpoint.weight_map = read_weight_map(index)
    for path in safetensors_files(folder):
        for name, info in read_header(path).items():
            if name in checkpoint.tensors:
                checkpoint.copies.setdefault(name, [checkpoint.tensors[name]]).append(info)
            # vLLM loads every copy it reads, each over the one before: the copy read last is the one served
            checkpoint.tensors[name] = info
    checkpoint.other_weight_files = sorted(p for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    return checkpoint


CHUNK_BYTES = 16 * 1024 * 1024


def same_bytes(a: TensorInfo, b: TensorInfo) -> bool:
    """True when two copies of a tensor hold the same dtype, shape and bytes; read in chunks (a draft's embedding
    can be gigabytes). False when either cannot be read whole: nothing proves them identical then."""
    if (a.dtype, a.shape) != (b.dtype, b.shape) or a.span is None or b.span is None:
        return False
    size = a.span[1] - a.span[0]
    if size != b.span[1] - b.span[0]:
        return False
    try:
        with open(a.file, "rb") as fa, open(b.file, "rb") as fb:
            fa.seek(a.span[0])
            fb.seek(b.span[0])
            left = size
            while left:
                n = min(CHUNK_BYTES, left)
                chunk = fa.read(n)
                if len(chunk) != n or chunk != fb.read(n):
                    return False
                left -= n
    except OSError:
        return False
    return True


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
