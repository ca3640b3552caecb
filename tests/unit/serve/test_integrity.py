"""A target or draft changed on disk (truncated, a dtype edited in the header, a shard missing, pickles only) is
refused by the pre-flight of `kimi-eagle serve` with the file's name, before any engine starts."""


from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.integrity import check_weight_folder
from kimi_eagle.serve.preflight import preflight
from kimi_eagle.serve.profile import load_profile
from tests.helpers.cli import REPO, exit_message

WEIGHTS = "model.safetensors"


def copy_pair(tmp_path: Path) -> tuple[Path, Path]:
    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(TARGET_DIR, target)
    shutil.copytree(DRAFT_DIR, draft)
    return target, draft


def _header(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return length, json.loads(raw[8:8 + length]), raw[8 + length:]


def truncate(path: Path, keep_fraction: float = 0.6) -> None:
    """What an interrupted copy or download leaves."""
    with open(path, "r+b") as f:
        f.truncate(int(path.stat().st_size * keep_fraction))


FLOATS = {"F32": 4, "F16": 2, "BF16": 2}


OTHER_SIZE = {4: "F16", 2: "F32"}  # a float dtype of another width: the byte spans no longer match


SAME_SIZE_INT = {4: "I32", 2: "I16"}  # an integer dtype of the same width: the spans still match


def relabel_first_weight(path: Path, same_size_int: bool = False) -> str:
    """Change one weight's dtype in the header and nothing else (the header keeps its length). Returns the new one."""
    length, header, data = _header(path)
    name = next(n for n, e in header.items() if n.endswith(".weight") and e.get("dtype") in FLOATS)
    width = FLOATS[header[name]["dtype"]]
    header[name]["dtype"] = SAME_SIZE_INT[width] if same_size_int else OTHER_SIZE[width]
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= length
    path.write_bytes(struct.pack("<Q", length) + encoded.ljust(length, b" ") + data)
    return header[name]["dtype"]


def garble_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[8:40] = b"\x00" * 32
    path.write_bytes(bytes(raw))


def pickle_only(folder: Path) -> None:
    import torch
    from safetensors.torch import load_file

    torch.save(load_file(folder / WEIGHTS), folder / "pytorch_model.bin")
    (folder / WEIGHTS).unlink()


def sharded_with_a_missing_shard(folder: Path) -> None:
    _, header, _ = _header(folder / WEIGHTS)
    names = [n for n in header if n != "__metadata__"]
    (folder / WEIGHTS).rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, n in enumerate(names)}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


Damage = Callable[[Path], None]


# (which folder, what happened to it, words the refusal must contain)
CASES: dict[str, tuple[str, Damage, tuple[str, ...]]] = {
    "target-truncated": ("target", lambda d: truncate(d / WEIGHTS), ("truncated", "missing")),
    "draft-truncated": ("draft", lambda d: truncate(d / WEIGHTS), ("truncated", "missing")),
    "draft-truncated-in-header": ("draft", lambda d: truncate(d / WEIGHTS, 0.0001), ("truncated",)),
    "target-dtype-edited": ("target", lambda d: relabel_first_weight(d / WEIGHTS), ("inconsistent header", "spans")),
    "draft-dtype-edited": ("draft", lambda d: relabel_first_weight(d / WEIGHTS), ("inconsistent header", "spans")),
    "target-float-relabelled-int": ("target", lambda d: relabel_first_weight(d / WEIGHTS, same_size_int=True),
                                    ("stored as I", "quantization_config")),
    "target-header-garbled": ("target", lambda d: garble_header(d / WEIGHTS), ("not a readable safetensors",)),
    "draft-pickle-only": ("draft", pickle_only, ("pickle", "pytorch_model.bin")),
    "target-shard-missing": ("target", sharded_with_a_missing_shard, ("missing", "model-00002-of-00002")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_weights_are_refused_by_the_preflight(tmp_path: Path, case: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    which, damage, words = CASES[case]
    target, draft = copy_pair(tmp_path)
    damaged = target if which == "target" else draft
    damage(damaged)
    problems = check_weight_folder(damaged)
    assert problems and all(w in problems[0].render() for w in words), [p.render() for p in problems]
    command = build_command(load_profile("tiny-cpu"), target=str(target), draft=str(draft))
    assert preflight(command) is False
    err = capsys.readouterr().err
    assert str(damaged) in err and all(w in err for w in words), err
    assert "Traceback" not in err


@pytest.mark.parametrize("case", ["draft-truncated", "draft-dtype-edited"])
def test_doctor_checks_report_a_damaged_draft_as_a_refusal(tmp_path: Path, case: str) -> None:
    """`kimi-eagle doctor` reads d2t/t2d and every weight: a damaged file is a finding, not a SafetensorError."""
    from kimi_eagle.checks import Severity, run_static_checks

    _, damage, _ = CASES[case]
    target, draft = copy_pair(tmp_path)
    damage(draft)
    refusals = [f for f in run_static_checks(draft, target) if f.severity == Severity.REFUSAL]
    assert "weights-unreadable" in {f.code for f in refusals}, refusals


def test_untouched_pair_passes_the_weight_checks() -> None:
    assert check_weight_folder(TARGET_DIR) == [] and check_weight_folder(DRAFT_DIR) == []


@pytest.mark.parametrize("case", ["target-truncated", "draft-dtype-edited"])
def test_serve_refuses_damaged_weights_before_starting_an_engine(tmp_path: Path, case: str) -> None:
    """Through the real command line: exit 2 with the file named, no traceback, nothing listening afterwards."""
    which, damage, words = CASES[case]
    target, draft = copy_pair(tmp_path)
    damage(target if which == "target" else draft)
    done = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "serve", "--target", str(target), "--draft",
                           str(draft), "--dry-run"], capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2, exit_message(done, 2)
    assert all(w in done.stderr for w in words), f"the refusal names {words}: got {done.stderr[-600:]!r}"
    assert "Traceback" not in done.stderr

