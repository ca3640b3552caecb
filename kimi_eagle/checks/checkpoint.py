"""The one reader of a checkpoint folder: config.json, the `model.safetensors.index.json` weight map, the
8-byte-length-prefixed JSON header of each safetensors file, and a tensor's bytes where a check needs its values.
Used by the checks, doctor, serve's pre-flight (serve/integrity.py) and the plugin alike.

A Kimi-K2.5 target is 64 shards and 595 GB: everything about it comes from its config, index and headers, and no
value of it is read. A draft's values are read with plain reads, piece by piece where the tensor is large.
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
    """A folder that cannot be read as a checkpoint: the message names the file and the problem, `fix` what to do."""

    def __init__(self, message: str, fix: str = "check the folder: give the folder of a complete saved checkpoint"):
        super().__init__(message)
        self.fix = fix


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
        raise CheckpointError(f"{folder} has no config.json: give the folder of a saved checkpoint",
                              fix="give the folder of a saved checkpoint")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a JSON {type(config).__name__}, not an object")
    return config


def header_length(path: Path) -> int | None:
    """The length of a .safetensors file's JSON header, as its first 8 bytes say; None when it has fewer."""
    with open(path, "rb") as f:
        prefix = f.read(8)
    return struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else None


def read_raw_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(the header's length in bytes, the header as JSON: name -> dtype, shape, data_offsets, and `__metadata__`)
    of one .safetensors file, read from its first bytes only."""
    length = header_length(path)
    if length is None:
        raise CheckpointError(f"{path} is too short to be a safetensors file")
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{path}: header length {length} is not plausible: not a safetensors file?")
    with open(path, "rb") as f:
        f.seek(8)
        raw = f.read(length)
    if len(raw) < length:
        raise CheckpointError(f"{path}: truncated inside its header (the header alone needs {8 + length} bytes, the "
                              f"file has {8 + len(raw)})", fix="copy or download the file again")
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
    if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
        return None  # the weight-file checks name a broken header; the span is only needed to compare copies
    return data_start + offsets[0], data_start + offsets[1]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensor table of one .safetensors file, read from its header only."""
    length, header = read_raw_header(path)
    tensors = {}
    for name, entry in tensor_entries(header).items():
        try:
            tensors[name] = TensorInfo(name, tuple(map(int, entry["shape"])), str(entry["dtype"]), path,
                                       _span(8 + length, entry))
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: the header's entry for {name} is not a tensor's (dtype, shape, "
                                  "data_offsets)", fix="the file was written by a broken exporter: re-export it") \
                from None
    return tensors


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


def indexed_shards(index: Path, weight_map: dict[str, str] | None = None) -> tuple[list[Path], list[str]]:
    """(the files an index names that are in its folder, the names of those that are not). `weight_map`: the
    index's, when the caller has read it (a Kimi-K2.5 index is 20 MB of JSON)."""
    names = sorted(set((read_weight_map(index) if weight_map is None else weight_map).values()))
    return [index.parent / n for n in names if (index.parent / n).is_file()], \
        [n for n in names if not (index.parent / n).is_file()]


def missing_shards_error(index: Path, missing: list[str]) -> CheckpointError:
    shown = ", ".join(missing[:4]) + (f" ... and {len(missing) - 4} more" if len(missing) > 4 else "")
    return CheckpointError(f"{index} names {len(missing)} shard file(s) that are not in {index.parent}: {shown}",
                           fix="the copy or download is incomplete: fetch the missing shard(s) (or, if the index "
                               "is the stale one, the index of these shards)")


def read_order(path: Path) -> list[int | str]:
    """vLLM 0.32's order of reading a checkpoint's files: by file name, runs of digits compared as numbers
    (`_natural_sort_key`, applied by `safetensors_weights_iterator` in model_loader/weight_utils.py)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def safetensors_files(folder: Path, weight_map: dict[str, str] | None = None) -> list[Path]:
    """The files vLLM 0.32 reads, in the order it reads them: with an index, the files it names (vLLM drops the
    others, `filter_duplicate_safetensors_files`); without one, every *.safetensors of the folder."""
    index = folder / INDEX_NAME
    if index.is_file():
        files, missing = indexed_shards(index, weight_map)
        if missing:
            raise missing_shards_error(index, missing)
        return sorted(files, key=read_order)
    return sorted(folder.glob("*.safetensors"), key=read_order)


def open_checkpoint(folder: Path) -> Checkpoint:
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder", fix="give the path of the checkpoint's folder")
    checkpoint = Checkpoint(folder=folder, config=read_config(folder))
    index = folder / INDEX_NAME
    if index.is_file():
        checkpoint.weight_map = read_weight_map(index)
    for path in safetensors_files(folder, checkpoint.weight_map):
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


# numpy's names of the safetensors dtypes it has (BF16 and F8 have none: torch reads those)
NUMPY_DTYPES = {"BOOL": "?", "U8": "u1", "I8": "i1", "I16": "<i2", "U16": "<u2", "I32": "<i4", "U32": "<u4",
                "I64": "<i8", "U64": "<u8", "F16": "<f2", "F32": "<f4", "F64": "<f8"}
TORCH_DTYPES = {"BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
                "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
                "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
READ_BYTES = 32 * 1024 * 1024  # the most `iter_chunks` holds at once


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def span_problem(info: TensorInfo) -> str | None:
    """What makes a header's entry unreadable as it stands (a dtype edited, offsets that do not fit), or None."""
    itemsize = DTYPE_BYTES.get(info.dtype)
    if itemsize is None:
        return f"{info.name} has dtype {info.dtype!r}, which safetensors does not know"
    if info.span is None:
        return f"{info.name} has no valid data_offsets"
    begin, end = info.span
    if end - begin != numel(info.shape) * itemsize:
        return (f"{info.name} is labelled {info.dtype} {list(info.shape)} ({numel(info.shape) * itemsize} bytes) but "
                f"spans {end - begin} bytes")
    return None


def data_span(info: TensorInfo) -> tuple[int, int]:
    """Where `info`'s bytes lie in its file, checked against its dtype, shape and the file's size: the checks
    safetensors' `safe_open` makes, named for this tensor."""
    if problem := span_problem(info):
        raise CheckpointError(f"inconsistent header: {problem}")
    begin, end = info.span
    size = info.file.stat().st_size
    if end > size:
        raise CheckpointError(f"truncated: {info.name} ends at byte {end}, the file has {size}")
    return begin, end


def iter_chunks(info: TensorInfo, max_bytes: int = READ_BYTES):
    """`info`'s bytes, read from its file in pieces of whole elements (at most `max_bytes`), each a numpy uint8
    array over one buffer that the next piece overwrites. Plain reads, not a memory map: a 2.3 GB embedding scanned
    this way never counts in the process's memory."""
    import numpy as np

    begin, end = data_span(info)
    itemsize = DTYPE_BYTES[info.dtype]
    step = max(itemsize, max_bytes // itemsize * itemsize)
    buffer = np.empty(min(step, end - begin), dtype=np.uint8)
    with open(info.file, "rb", buffering=0) as f:
        f.seek(begin)
        while begin < end:
            piece = buffer[: min(step, end - begin)]
            if f.readinto(piece) != len(piece):
                raise CheckpointError(f"truncated: {info.name} is cut short at byte {f.tell()}")
            begin += len(piece)
            yield piece


def _read_whole(info: TensorInfo):
    import numpy as np

    begin, end = data_span(info)
    data = np.empty(end - begin, dtype=np.uint8)
    with open(info.file, "rb", buffering=0) as f:
        f.seek(begin)
        if f.readinto(data) != len(data):
            raise CheckpointError(f"truncated: {info.name} is cut short")
    return data


def load_numpy(info: TensorInfo):
    """One tensor of a dtype numpy has (d2t, t2d) as a numpy array: no torch needed."""
    if info.dtype not in NUMPY_DTYPES:
        raise CheckpointError(f"{info.name}: numpy has no {info.dtype}")
    return _read_whole(info).view(NUMPY_DTYPES[info.dtype]).reshape(info.shape)


def torch_view(info: TensorInfo, raw):
    """A piece of `info`'s bytes (from `iter_chunks`) as a flat torch tensor of its dtype, sharing the memory."""
    import torch

    return torch.from_numpy(raw).view(getattr(torch, TORCH_DTYPES[info.dtype]))


def load_torch(info: TensorInfo):
    """One tensor, whole, through torch (bf16 weights). Imported here: the checks must not need torch to import."""
    return torch_view(info, _read_whole(info)).reshape(info.shape)
