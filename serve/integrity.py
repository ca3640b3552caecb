"""Are a checkpoint's weight files whole? Read before the engine starts, so that a truncated or re-labelled file is
refused with its name instead of failing minutes into loading (or, worse, loading as garbage).

The safetensors library does the format checks (`safe_open` maps the file and validates its header: JSON, dtype,
shape and offsets that cover the file exactly); this module adds what it does not say: which file, how many bytes
are missing, and what to do. Pickle weights (.bin/.pt/.pth/.ckpt/.pkl) are never loaded by kimi-eagle: a folder that
holds only those is refused, since unpickling runs code from the file.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from kimi_eagle.checks.checkpoint import (
    FLOAT_DTYPES,
    INDEX_NAME,
    PICKLE_SUFFIXES,
    CheckpointError,
    header_length,
    indexed_shards,
    read_config,
    read_header,
    span_problem,
)

# Integer tensors a float checkpoint may hold on purpose: the EAGLE-3 vocabulary maps.
INTEGER_NAMES = ("d2t", "t2d")


class WeightFileProblem(BaseModel):
    """One reason a checkpoint folder must not be served."""

    path: str = Field(description="The file (or folder) at fault.")
    problem: str = Field(description="What is wrong, with the numbers.")
    fix: str = Field(description="What to do about it.")

    def render(self) -> str:
        return f"{self.path}: {self.problem}. Fix: {self.fix}"


def _tensors(path: Path) -> dict | None:
    try:
        return read_header(path)
    except (CheckpointError, OSError):
        return None


def _expected_size(path: Path) -> tuple[int, int] | None:
    """(bytes the header says the file has, bytes it has), or None when the header itself is unreadable."""
    tensors = _tensors(path)
    if tensors is None or any(t.span is None for t in tensors.values()):
        return None
    return max((t.span[1] for t in tensors.values()), default=8 + header_length(path)), path.stat().st_size


def _mislabelled_tensor(path: Path) -> str | None:
    """The first tensor whose byte span does not match its dtype and shape (a changed dtype in the header)."""
    for info in (_tensors(path) or {}).values():
        if problem := span_problem(info):
            return problem
    return None


def check_safetensors_file(path: Path) -> WeightFileProblem | None:
    """None when `safe_open` accepts the file; else what is wrong with it, as precisely as the header allows."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            f.keys()
        return None
    except (SafetensorError, OSError) as exc:
        library_says = str(exc)
    fix = "copy or download the file again (compare its size and checksum with the source), or re-export it"
    sizes = _expected_size(path)
    if sizes is not None and sizes[1] < sizes[0]:
        return WeightFileProblem(path=str(path), fix=fix, problem=(
            f"truncated: the header describes {sizes[0]} bytes, the file has {sizes[1]} "
            f"({sizes[0] - sizes[1]} missing)"))
    if sizes is not None and sizes[1] > sizes[0]:
        return WeightFileProblem(path=str(path), fix=fix, problem=(
            f"{sizes[1] - sizes[0]} unexpected bytes after the last tensor (the header describes {sizes[0]})"))
    length = header_length(path)
    if length is not None and 8 + length > path.stat().st_size:
        return WeightFileProblem(path=str(path), fix=fix, problem=(
            f"truncated inside its header: the header alone needs {8 + length} bytes, the file has "
            f"{path.stat().st_size}"))
    mislabelled = _mislabelled_tensor(path)
    if mislabelled:
        return WeightFileProblem(path=str(path), problem=f"inconsistent header: {mislabelled}",
                                 fix="the header was edited or the file was written by a broken exporter: re-export it")
    return WeightFileProblem(path=str(path), fix=fix,
                             problem=f"not a readable safetensors file (safetensors: {library_says})")


def _integer_weights(path: Path, config: dict) -> WeightFileProblem | None:
    """A float model whose weight is stored as an integer type: the engine would cast it into garbage."""
    if config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config"):
        return None  # quantized checkpoints hold packed integers on purpose
    for name, info in read_header(path).items():
        if name.rsplit(".", 1)[-1] in INTEGER_NAMES:
            continue
        if name.endswith((".weight", ".bias")) and info.dtype not in FLOAT_DTYPES:
            return WeightFileProblem(path=str(path), problem=(
                f"{name} is stored as {info.dtype} in a checkpoint without a quantization_config"),
                fix="re-export the weights in a float dtype (BF16/F16/F32)")
    return None


def _weight_files(folder: Path) -> tuple[list[Path], list[WeightFileProblem]]:
    index = folder / INDEX_NAME
    if not index.is_file():
        return sorted(folder.glob("*.safetensors")), []
    try:
        files, missing = indexed_shards(index)
    except CheckpointError as exc:
        return [], [WeightFileProblem(path=str(index), problem=str(exc).removeprefix(f"{index} has "),
                                      fix="copy or download the index file again")]
    problems = [WeightFileProblem(path=str(index), problem=f"names {len(missing)} shard(s) that are missing, e.g. "
                                  f"{missing[0]}", fix="the copy or download is incomplete: fetch the missing shards")
                ] if missing else []
    return files, problems


def check_weight_folder(folder: str | Path) -> list[WeightFileProblem]:
    """Every reason the checkpoint in `folder` cannot be loaded whole from safetensors. A reference that is not a
    local folder (a hub name) is not checked here: the engine downloads and verifies it."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    files, problems = _weight_files(folder)
    if not files and not problems:
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        problem = (f"no .safetensors weights, only pickle files ({', '.join(pickles)})" if pickles
                   else "no .safetensors weights")
        return [WeightFileProblem(path=str(folder), problem=problem, fix=(
            "convert the checkpoint to safetensors (kimi-eagle never unpickles weights: loading a pickle runs "
            "code from the file)" if pickles else "give the folder that holds the model's .safetensors files"))]
    try:
        config = read_config(folder)
    except CheckpointError:
        config = {}  # the config checks report this; here only the weights matter
    for path in files:
        problem = check_safetensors_file(path)
        if problem is None:
            problem = _integer_weights(path, config)
        if problem is not None:
            problems.append(problem)
    return problems
