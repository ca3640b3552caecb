"""Issue 34 in the pre-flight of `kimi-eagle serve`: a tensor stored in two of the files vLLM reads stops the serve
before any engine starts (the target's from its headers alone); a draft's identical copies are only a warning.
Also that vLLM 0.32's own loading code keeps the copy the checks say it keeps."""


from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kimi_eagle.checks.checkpoint import open_checkpoint
from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR
from kimi_eagle.serve.command import ServeCommand
from kimi_eagle.serve.preflight import preflight
from tests.helpers.cli import REPO, exit_message
from tests.helpers.sharded import SHARDS, shard_with_copy

FC = "fc.weight"
TARGET_NORM = "language_model.model.norm.weight"


def command(target: Path = TARGET_DIR, draft: Path | None = DRAFT_DIR) -> ServeCommand:
    return ServeCommand(argv=[], env={}, url="http://127.0.0.1:1", served_model_name="t", target=str(target),
                        draft=str(draft) if draft else None)


def test_preflight_refuses_a_draft_with_different_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = shard_with_copy(DRAFT_DIR, tmp_path / "draft", FC, differ=True)
    assert preflight(command(draft=draft)) is False
    err = capsys.readouterr().err
    assert "[conflicting-copies]" in err and f"{FC} in {SHARDS[0]} and {SHARDS[1]}" in err
    assert f"vLLM keeps the copy in {SHARDS[1]}" in err and "Fix: remove the stale shard" in err
    assert "Traceback" not in err


def test_preflight_warns_of_identical_draft_copies_and_serves(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    draft = shard_with_copy(DRAFT_DIR, tmp_path / "draft", FC, differ=False)
    assert preflight(command(draft=draft)) is True
    assert "pre-flight warning [identical-copies]" in capsys.readouterr().err


@pytest.mark.parametrize("with_draft", [True, False])
def test_preflight_refuses_a_target_stored_twice_even_when_identical(
        tmp_path: Path, with_draft: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """No target data is read: identical bytes cannot be proven, so the target's duplicate is a refusal, with a
    draft or serving the target alone."""
    target = shard_with_copy(TARGET_DIR, tmp_path / "target", TARGET_NORM, differ=False)
    assert preflight(command(target=target, draft=DRAFT_DIR if with_draft else None)) is False
    err = capsys.readouterr().err
    assert "[conflicting-copies]" in err and "stored in more than one target file" in err
    assert f"{TARGET_NORM} in {SHARDS[0]} and {SHARDS[1]}" in err
    assert ("refuses this EAGLE-3 draft" if with_draft else "refuses this target") in err


def test_vllm_keeps_the_copy_read_last(tmp_path: Path) -> None:
    """vLLM 0.32's file filter and safetensors iterator, collected by name as the EAGLE-3 classes' load_weights do
    (`model_weights[name] = loaded_weight`): the copy served is the one `open_checkpoint` keeps, from model-10, which
    sorts before model-9 as text."""
    from vllm.model_executor.model_loader.weight_utils import (
        filter_duplicate_safetensors_files,
        safetensors_weights_iterator,
    )

    draft = shard_with_copy(DRAFT_DIR, tmp_path / "draft", FC, differ=True,
                            files=("model-9.safetensors", "model-10.safetensors"))
    files = filter_duplicate_safetensors_files([str(p) for p in sorted(draft.glob("*.safetensors"))], str(draft),
                                               "model.safetensors.index.json")
    served = dict(safetensors_weights_iterator(files, use_tqdm_on_load=False))
    kept = open_checkpoint(draft).tensors[FC].file
    assert kept.name == "model-10.safetensors"
    assert torch.equal(served[FC], load_file(kept)[FC])
    assert not torch.equal(served[FC], load_file(draft / "model-9.safetensors")[FC])


def test_serve_refuses_before_starting_an_engine(tmp_path: Path) -> None:
    """Through the real command line: exit 2, the tensor and the files named, no traceback."""
    draft = shard_with_copy(DRAFT_DIR, tmp_path / "draft", FC, differ=True)
    done = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "serve", "--draft", str(draft), "--dry-run"],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2, exit_message(done, 2)
    assert "[conflicting-copies]" in done.stderr and f"{FC} in {SHARDS[0]} and {SHARDS[1]}" in done.stderr
    assert "pre-flight found problems" in done.stderr and "Traceback" not in done.stderr
