"""`kimi-eagle doctor` (exit status, tables, JSON) and the pre-flight that stops `serve` on refusals."""


from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.helpers.broken_drafts as bd
from kimi_eagle.cli import main
from kimi_eagle.cpu_kernels import kernel_report
from kimi_eagle.serve.command import ServeCommand
from kimi_eagle.serve.preflight import preflight


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("doctor")


def doctor(*args: str | Path) -> int:
    return main(["doctor", *map(str, args)])


def test_fixture_pair_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(bd.SOURCE_DRAFT, "--target", bd.SOURCE_TARGET) == 0
    out = capsys.readouterr().out
    for title in ("Findings", "Key coverage", "vLLM 0.32", "SGLang 0.5.23", "Weight health", "Trained or not?"):
        assert title in out
    machine = kernel_report()
    assert f"vLLM CPU kernels {machine.kernel_build} (built for {machine.built_for}" in " ".join(out.split())
    assert f": {machine.isa};" in out
    assert "qkv_proj.weight [q]" in out  # shard ids survive rich's markup


def test_warning_exits_1(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(bd.build("aux_missing", built), "--target", bd.SOURCE_TARGET) == 1
    assert "aux-ids-missing" in capsys.readouterr().out


def test_refusal_exits_2_and_names_the_fix(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(bd.build("no_down_proj", built), "--target", bd.SOURCE_TARGET) == 2
    assert "unfilled-parameter" in capsys.readouterr().out


def test_engine_filter(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = bd.build("norm_before_residual", built)  # refused for SGLang only
    assert doctor(draft, "--target", bd.SOURCE_TARGET, "--engine", "vllm") == 0
    assert doctor(draft, "--target", bd.SOURCE_TARGET, "--engine", "sglang") == 2
    capsys.readouterr()


def test_json_report(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(bd.build("stray_bias", built), "--target", bd.SOURCE_TARGET, "--json") == 2
    report = json.loads(capsys.readouterr().out)
    assert report["exit_code"] == 2
    machine = kernel_report().as_dict()  # {"isa": "AVX2", "kernel_build": "_C_AVX2", ...}
    assert {k: report["machine"][k] for k in ("cpu", "isa", "kernel_build", "built_for")} == {
        k: machine[k] for k in ("cpu", "isa", "kernel_build", "built_for")}
    unloaded = [f for f in report["findings"] if f["code"] == "unloaded-tensor"]
    assert {f["engine"] for f in unloaded} == {"vllm", "sglang"} and unloaded[0]["severity"] == 2
    row = next(r for r in report["coverage"] if r["key"] == "layers.0.self_attn.q_proj.bias")
    assert row["engines"]["vllm"]["status"] == "dropped"
    assert report["trained"]["verdict"] in ("trained", "looks untrained", "unclear")


def test_probe_needs_a_target(capsys: pytest.CaptureFixture[str]) -> None:
    assert doctor(bd.SOURCE_DRAFT, "--probe") == 2
    assert "--probe needs --target" in capsys.readouterr().err


def _command(draft: Path, target: Path = bd.SOURCE_TARGET) -> ServeCommand:
    return ServeCommand(argv=[], env={}, url="http://127.0.0.1:1", served_model_name="t", target=str(target),
                        draft=str(draft))


def test_preflight_passes_the_fixture_pair() -> None:
    assert preflight(_command(bd.SOURCE_DRAFT)) is True


def test_preflight_refuses_and_says_why(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert preflight(_command(bd.build("aux_out_of_range", built))) is False
    err = capsys.readouterr().err
    assert "[aux-ids-range]" in err and "Fix:" in err


def test_preflight_warns_but_serves(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert preflight(_command(bd.build("aux_missing", built))) is True
    assert "pre-flight warning [aux-ids-missing]" in capsys.readouterr().err


def test_preflight_ignores_sglang_only_refusals(built: Path) -> None:
    assert preflight(_command(bd.build("norm_before_residual", built))) is True


@pytest.mark.parametrize("role", ["target", "draft"])
def test_preflight_refuses_a_model_path_that_is_not_there_by_name(role: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM would take it for a hub name and fail after start-up with a message that names neither."""
    missing = tmp_path / "no-such-checkpoint"
    command = _command(missing) if role == "draft" else _command(bd.SOURCE_DRAFT, target=missing)
    assert preflight(command) is False
    err = capsys.readouterr().err
    assert f"the {role} {missing} does not exist" in err and f"--{role} DIR" in err


def test_preflight_refuses_a_home_relative_path_vllm_would_not_expand(capsys: pytest.CaptureFixture[str]) -> None:
    command = _command(Path("~/no-such-draft"))
    assert preflight(command) is False
    assert "the draft ~/no-such-draft does not exist" in capsys.readouterr().err


def test_preflight_refuses_a_file_given_for_a_checkpoint_folder(capsys: pytest.CaptureFixture[str]) -> None:
    command = _command(bd.SOURCE_DRAFT, target=bd.SOURCE_TARGET / "config.json")
    command.draft = None
    assert preflight(command) is False
    assert "is a file, not a checkpoint folder" in capsys.readouterr().err


def test_preflight_lets_hub_names_through_to_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    assert preflight(_command(Path("lightseekorg/kimi-k2.5-eagle3"))) is True
    assert "vLLM downloads it" in capsys.readouterr().err


def test_preflight_without_draft_is_a_no_op() -> None:
    command = _command(bd.SOURCE_DRAFT)
    command.draft = None
    assert preflight(command) is True

