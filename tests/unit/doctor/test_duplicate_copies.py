"""Issue 34: a tensor stored in two of the files vLLM reads is loaded twice, and the copy read last is served. The
checks name it: a refusal when the copies differ (or, for the target, cannot be compared), a warning when the draft's
copies are identical. Real sharded safetensors checkpoints, built from the shipped fixture pair."""


from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import tests.helpers.broken_drafts as bd
from kimi_eagle.checks import Severity, diagnose
from kimi_eagle.checks.checkpoint import open_checkpoint, read_header, read_order
from kimi_eagle.cli import main
from tests.helpers.sharded import SHARDS, shard_with_copy

FC = "fc.weight"
TARGET_NORM = "language_model.model.norm.weight"


def doctor_json(draft: Path, target: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = main(["doctor", str(draft), "--target", str(target), "--json"])
    return code, json.loads(capsys.readouterr().out)


def by_code(report: dict, code: str) -> dict:
    return next(f for f in report["findings"] if f["code"] == code)


def test_read_order_is_vllms_natural_order() -> None:
    names = ["model-10.safetensors", "model-9.safetensors", "model-00002-of-00002.safetensors",
             "model-00001-of-00002.safetensors"]
    assert [n for n in sorted(names, key=lambda n: read_order(Path(n)))] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model-9.safetensors",
        "model-10.safetensors"]


def test_the_checkpoint_keeps_the_copy_vllm_reads_last(tmp_path: Path) -> None:
    """model-10 is read after model-9 (digits as numbers), though it sorts before it as text."""
    draft = shard_with_copy(bd.SOURCE_DRAFT, tmp_path / "draft", FC, differ=True,
                            files=("model-9.safetensors", "model-10.safetensors"))
    checkpoint = open_checkpoint(draft)
    assert [c.file.name for c in checkpoint.copies[FC]] == ["model-9.safetensors", "model-10.safetensors"]
    assert checkpoint.tensors[FC].file.name == "model-10.safetensors"
    assert list(checkpoint.copies) == [FC]


def test_doctor_refuses_different_copies_and_names_tensor_files_and_fix(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = shard_with_copy(bd.SOURCE_DRAFT, tmp_path / "draft", FC, differ=True)
    code, report = doctor_json(draft, bd.SOURCE_TARGET, capsys)
    assert code == 2
    f = by_code(report, "conflicting-copies")
    assert f["severity"] == Severity.REFUSAL and "draft file" in f["title"] and "different values" in f["title"]
    assert f"{FC} in {SHARDS[0]} and {SHARDS[1]}" in f["found"]
    assert f"vLLM keeps the copy in {SHARDS[1]}, read last; the bytes differ" in f["found"]
    assert "every *.safetensors file of the folder, as it has no index" in f["expected"]
    assert "remove the stale shard" in f["fix"] and "model.safetensors.index.json" in f["fix"]
    assert "identical-copies" not in {x["code"] for x in report["findings"]}


def test_doctor_warns_of_identical_copies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = shard_with_copy(bd.SOURCE_DRAFT, tmp_path / "draft", FC, differ=False)
    code, report = doctor_json(draft, bd.SOURCE_TARGET, capsys)
    assert code == 1
    f = by_code(report, "identical-copies")
    assert f["severity"] == Severity.WARNING and f"{FC} in {SHARDS[0]} and {SHARDS[1]}" in f["found"]
    assert "conflicting-copies" not in {x["code"] for x in report["findings"]}


def test_doctor_text_report_names_the_refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = shard_with_copy(bd.SOURCE_DRAFT, tmp_path / "draft", FC, differ=True)
    assert main(["doctor", str(draft), "--target", str(bd.SOURCE_TARGET)]) == 2
    out = capsys.readouterr().out
    assert "conflicting-copies" in out and "refusals" in out


def test_with_an_index_every_file_it_names_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM reads every tensor of each file the index names, whatever file the index maps a name to."""
    draft = shard_with_copy(bd.SOURCE_DRAFT, tmp_path / "draft", FC, differ=True, index=True)
    code, report = doctor_json(draft, bd.SOURCE_TARGET, capsys)
    assert code == 2
    f = by_code(report, "conflicting-copies")
    assert f"the index maps it to {SHARDS[0]}" in f["found"] and "the files its index names" in f["expected"]
    assert "re-save the file that should not hold the tensor without it" in f["fix"]


def test_a_stale_file_the_index_leaves_out_is_not_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fix the refusal offers works: with an index naming one file per tensor, vLLM skips the stale shard."""
    draft = shard_with_copy(bd.SOURCE_DRAFT, tmp_path / "draft", FC, differ=True)
    names = {n: SHARDS[0] for n in read_header(draft / SHARDS[0])}
    (draft / SHARDS[1]).rename(draft / "stale.safetensors")
    rest = {k: v for k, v in load_file(draft / "stale.safetensors").items() if k not in names}
    save_file(rest, draft / SHARDS[1])
    names.update(dict.fromkeys(rest, SHARDS[1]))
    (draft / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": names}))
    code, report = doctor_json(draft, bd.SOURCE_TARGET, capsys)
    assert code == 0, [f for f in report["findings"] if f["severity"]]


@pytest.mark.parametrize("differ", [True, False])
def test_a_target_stored_twice_is_refused_from_its_headers(tmp_path: Path, differ: bool) -> None:
    """The target's data is not read, so even byte-identical copies cannot be told from a stale one."""
    target = shard_with_copy(bd.SOURCE_TARGET, tmp_path / "target", TARGET_NORM, differ=differ)
    refusals = [f for f in diagnose(bd.SOURCE_DRAFT, target).findings if f.code == "conflicting-copies"]
    assert len(refusals) == 1 and refusals[0].severity == Severity.REFUSAL
    assert "target file" in refusals[0].title and "different values" not in refusals[0].title
    assert f"{TARGET_NORM} in {SHARDS[0]} and {SHARDS[1]}" in refusals[0].found
    assert "same dtype and shape, values not read" in refusals[0].found


def test_the_target_check_reads_headers_only(tmp_path: Path) -> None:
    """Header-only target shards (no data behind the headers): reading a value would fail, the refusal does not."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text((bd.SOURCE_TARGET / "config.json").read_text())
    header = {n: (i.dtype, i.shape) for n, i in read_header(bd.SOURCE_TARGET / "model.safetensors").items()}
    names = sorted(header)
    bd.write_header_only(target / SHARDS[0], {n: header[n] for n in names[::2]})
    bd.write_header_only(target / SHARDS[1], {n: header[n] for n in [*names[1::2], names[0]]})
    findings = diagnose(bd.SOURCE_DRAFT, target, check_values=False).findings
    refusal = next(f for f in findings if f.code == "conflicting-copies")
    assert names[0] in refusal.found and "values not read" in refusal.found


def test_a_damaged_copy_is_not_called_identical(tmp_path: Path) -> None:
    """A copy that cannot be read whole proves nothing: refused, not waved through as a duplicate."""
    draft = shard_with_copy(bd.SOURCE_DRAFT, tmp_path / "draft", FC, differ=False)
    path = draft / SHARDS[1]
    with open(path, "r+b") as f:
        f.truncate(read_header(path)[FC].span[0] + 1)  # the second copy's bytes cut after the first
    codes = {f.code for f in diagnose(draft, bd.SOURCE_TARGET).findings if f.severity == Severity.REFUSAL}
    assert "identical-copies" not in codes and "conflicting-copies" in codes
