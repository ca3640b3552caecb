"""`doctor --probe`: the draft's step-0 agreement with the target for the configured aux ids and alternatives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tests.broken_drafts as bd
from doctor.probe import ProbeError, probe_aux_ids
from kimi_eagle.cli import main


@pytest.fixture(scope="module")
def probe():
    return probe_aux_ids(bd.SOURCE_DRAFT, bd.SOURCE_TARGET)


def test_configured_ids_fit_the_trained_draft_best(probe) -> None:
    labels = [v.label for v in probe.variants]
    assert labels[0] == "configured" and probe.variants[0].ids == [2, 4, 6]
    assert {"shifted -1", "default (2, L//2, L-3)", "one layer repeated"} <= set(labels)
    assert probe.verdict == "configured ids fit best"
    others = max(v.agreement for v in probe.variants[1:])
    assert probe.variants[0].agreement > others
    assert probe.findings() == []


def test_wrong_ids_are_caught(tmp_path: Path) -> None:
    config, tensors = bd.read_draft()
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]  # the draft was trained on [2, 4, 6]
    result = probe_aux_ids(bd.write_draft(tmp_path / "shifted", config, tensors), bd.SOURCE_TARGET)
    assert result.verdict == "other ids fit better"
    best = max(result.variants, key=lambda v: v.agreement)
    assert best.ids == [2, 4, 6] and best.label == "shifted +1"
    assert [f.code for f in result.findings()] == ["probe-ids-not-best"]


def test_user_prompts_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\n\nThe function returns\n")
    code = main(["doctor", str(bd.SOURCE_DRAFT), "--target", str(bd.SOURCE_TARGET), "--probe",
                 "--prompts", str(prompts), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == report["exit_code"]
    assert report["probe"]["prompts"] == 2 and report["probe"]["variants"][0]["label"] == "configured"


def test_probe_refuses_a_target_too_big_for_this_machine(tmp_path: Path) -> None:
    target = bd.kimi_target(tmp_path / "kimi")
    with pytest.raises(ProbeError, match="too big"):
        probe_aux_ids(bd.kimi_draft(tmp_path / "draft", [2, 30, 58]), target)
