"""`doctor --probe` without a server: the draft's step-0 agreement with the target for the configured aux ids and
alternatives, and the probe's verdicts."""


from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

import tests.helpers.broken_drafts as bd
from kimi_eagle.acceptance import Acceptance
from kimi_eagle.checks import Severity
from kimi_eagle.cli import main
from kimi_eagle.doctor.engine_probe import EngineProbe, acceptance_table
from kimi_eagle.doctor.probe import ProbeError, probe_aux_ids
from kimi_eagle.processes import free_port


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
    code = main(["doctor", str(bd.SOURCE_DRAFT), "--target", str(bd.SOURCE_TARGET), "--agreement-only",
                 "--prompts", str(prompts), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == report["exit_code"]
    assert report["probe"]["prompts"] == 2 and report["probe"]["variants"][0]["label"] == "configured"
    assert report["engine_probe"] is None  # --agreement-only starts no server


def test_probe_refuses_a_target_too_big_for_this_machine(tmp_path: Path) -> None:
    target = bd.kimi_target(tmp_path / "kimi")
    with pytest.raises(ProbeError, match="too big"):
        probe_aux_ids(bd.kimi_draft(tmp_path / "draft", [2, 30, 58]), target)


def test_a_target_too_big_for_this_machine_skips_both_parts_and_says_why(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    target, draft = bd.kimi_target(tmp_path / "kimi"), bd.kimi_draft(tmp_path / "draft", [2, 30, 58])
    code = main(["doctor", str(draft), "--target", str(target), "--probe", "--json"])
    report = json.loads(capsys.readouterr().out)  # one JSON document: no engine was started, nothing else printed
    assert code == report["exit_code"]
    assert report["probe"] is None
    assert "too big" in report["engine_probe"]["skipped"] and "--probe-url" in report["engine_probe"]["skipped_fix"]
    skipped = {f["code"]: f for f in report["findings"] if f["code"].endswith("skipped")}
    assert set(skipped) == {"probe-skipped", "engine-probe-skipped"}
    assert all(f["severity"] == 0 and "too big" in f["found"] for f in skipped.values())


def test_a_draft_refused_for_vllm_starts_no_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    draft = bd.build("zero_o_proj", tmp_path)  # refused (weight-zero) but loadable: the step-0 probe runs
    assert main(["doctor", str(draft), "--target", str(bd.SOURCE_TARGET), "--probe", "--json"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["probe"]["variants"]
    assert "refuse" in report["engine_probe"]["skipped"] and report["engine_probe"]["acceptance"] is None


def test_contradicting_probe_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    target = str(bd.SOURCE_TARGET)
    assert main(["doctor", str(bd.SOURCE_DRAFT), "--target", target, "--agreement-only",
                 "--probe-url", "http://127.0.0.1:1"]) == 2
    assert "--agreement-only runs no vLLM server" in capsys.readouterr().err
    assert main(["doctor", str(bd.SOURCE_DRAFT), "--target", target, "--probe-url", "http://127.0.0.1:1",
                 "--probe-profile", "tiny-cpu"]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert main(["doctor", str(bd.SOURCE_DRAFT), "--probe-url", "http://127.0.0.1:1"]) == 2  # implies --probe
    assert "--probe needs --target" in capsys.readouterr().err


def test_an_unreadable_prompts_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.txt"
    assert main(["doctor", str(bd.SOURCE_DRAFT), "--target", str(bd.SOURCE_TARGET), "--probe",
                 "--prompts", str(missing)]) == 2
    assert f"cannot read the prompts file {missing}" in capsys.readouterr().err


def test_a_probe_url_with_no_server_behind_it_names_the_url(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\n")
    assert main(["doctor", str(bd.SOURCE_DRAFT), "--target", str(bd.SOURCE_TARGET), "--probe-url", url,
                 "--prompts", str(prompts)]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach {url}/" in err and "is the server running" in err


def test_an_unknown_probe_profile_lists_the_known_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\n")
    assert main(["doctor", str(bd.SOURCE_DRAFT), "--target", str(bd.SOURCE_TARGET), "--probe-profile", "no-such",
                 "--prompts", str(prompts)]) == 2
    assert "no profile 'no-such': known profiles are" in capsys.readouterr().err


def _acceptance(rate: float, per_position: list[float]) -> Acceptance:
    drafts, k = 100, len(per_position)
    accepted = round(rate * drafts * k)
    return Acceptance(speculation="on", source="vLLM counters", num_verify_steps=drafts, num_draft_tokens=drafts * k,
                      num_accepted_tokens=accepted, num_speculative_tokens=k, acceptance_rate=rate,
                      mean_acceptance_length=1 + accepted / drafts, per_position_acceptance_rate=per_position)


def test_acceptance_near_zero_is_a_warning_and_a_good_one_is_not() -> None:
    """The original failure: the engine ran the draft and accepted almost nothing, without a word."""
    collapsed = EngineProbe(prompts=16, max_tokens=64, acceptance=_acceptance(0.02, [0.05, 0.01, 0.0]))
    [finding] = collapsed.findings()
    assert finding.code == "engine-acceptance-low" and finding.severity == Severity.WARNING
    assert "2.0%" in finding.found and "1.06" in finding.found
    assert EngineProbe(prompts=16, max_tokens=64, acceptance=_acceptance(0.8, [0.9, 0.8, 0.7])).findings() == []


def test_acceptance_table_shows_the_mean_length_and_each_position() -> None:
    result = EngineProbe(server="given (--probe-url)", url="http://127.0.0.1:8000", prompts=16, max_tokens=64,
                         completion_tokens=1024, seconds_generating=3.0, acceptance=_acceptance(0.8, [0.9, 0.8, 0.7]))
    console = Console(record=True, width=200)
    console.print(acceptance_table(result))
    text = console.export_text()  # and clears the recording
    assert "mean acceptance length" in text and "3.40" in text and "k=3" in text
    assert all(rate in text for rate in ("90.0%", "80.0%", "70.0%")) and "position 3" in text
    console.print(acceptance_table(EngineProbe(skipped="the target has 1000B parameters")))
    text = console.export_text()
    assert "skipped" in text and "1000B" in text

