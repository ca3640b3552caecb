"""The static draft checks: one broken draft per fault, built from the fixture draft, and the finding it must give."""


from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tests.helpers.broken_drafts as bd
from kimi_eagle.checks import Finding, Severity, diagnose, refusal_message, run_static_checks
from tests.helpers.cli import REPO

R, W, I = Severity.REFUSAL, Severity.WARNING, Severity.INFO  # noqa: E741 - severity initials


# fault -> (code, severity, engine) the checks must report for it
EXPECTED = {
    "model_prefix": ("unloaded-tensor", R, "vllm"),
    "decoder_prefix": ("unloaded-tensor", R, "all"),
    "typo_key": ("unloaded-tensor", R, "all"),
    "stray_bias": ("unloaded-tensor", R, "all"),
    "both_layouts": ("duplicate-tensor", R, "all"),
    "no_fc": ("unfilled-parameter", R, "all"),
    "no_down_proj": ("unfilled-parameter", R, "all"),
    "no_embeddings": ("shared-from-target", I, "all"),
    "no_lm_head": ("unshareable-missing", R, "vllm"),
    "fc_one_layer": ("fc-width", R, "all"),
    "target_hidden_other": ("hidden-size", R, "all"),
    "qkv_narrow": ("qkv-width", R, "all"),
    "lm_head_rows": ("lm-head-rows", R, "all"),
    "aux_out_of_range": ("aux-ids-range", R, "all"),
    "aux_duplicated": ("aux-ids-duplicate", R, "all"),
    "aux_two_ids": ("aux-ids-count", R, "all"),
    "aux_missing": ("aux-ids-missing", W, "all"),
    "aux_ids_strings": ("aux-ids-type", R, "all"),
    "aux_in_eagle_config": ("aux-ids-unread", R, "vllm"),
    "d2t_short": ("d2t-length", R, "all"),
    "d2t_out_of_range": ("d2t-range", R, "all"),
    "t2d_short": ("t2d-length", R, "all"),
    "t2d_disagrees": ("t2d-mismatch", R, "all"),
    "no_vocab_mapping": ("vocab-mapping-missing", R, "all"),
    "verifier_other_name": ("verifier-mismatch", W, "all"),
    "norm_before_residual": ("option-unsupported", R, "sglang"),
    "norm_before_residual_unset": ("norm-before-residual-default", W, "vllm"),
    "trained_embeddings": ("embedding-overridden", W, "sglang"),
    "mistral_layer": ("layer-type", R, "all"),
    "nan_in_fc": ("weight-nonfinite", R, "all"),
    "zero_o_proj": ("weight-zero", R, "all"),
    "mixed_dtypes": ("weight-dtype-mixed", W, "all"),
    "fresh_init": ("looks-untrained", W, "all"),
    "one_matrix_untrained": ("matrix-untrained", W, "all"),
    "fc_aux_input_unused": ("fc-aux-input-unused", W, "all"),
    "aux_ids_disagree": ("aux-ids-disagree", W, "all"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("broken")


@pytest.fixture(scope="module")
def baseline() -> list[Finding]:
    return run_static_checks(bd.SOURCE_DRAFT, bd.SOURCE_TARGET)


def _codes(findings: list[Finding]) -> set[tuple[str, Severity, str]]:
    return {(f.code, f.severity, f.engine) for f in findings}


def test_every_fault_has_an_expectation() -> None:
    assert set(EXPECTED) == set(bd.FAULTS) - {"midlayer_layout"}
    assert len({code for code, severity, _ in EXPECTED.values() if severity > I}) >= 12


def test_fixture_draft_is_clean(baseline: list[Finding]) -> None:
    serious = [f for f in baseline if f.severity > I]
    assert not serious, refusal_message(serious) or serious


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_fault_is_reported(fault: str, built: Path, baseline: list[Finding]) -> None:
    findings = run_static_checks(bd.build(fault, built), bd.SOURCE_TARGET)
    code, severity, engine = EXPECTED[fault]
    new = [f for f in findings if (f.code, f.severity, f.engine) not in _codes(baseline)]
    reported = [f"{f.severity.name} {f.engine} {f.code}: {f.found}" for f in findings]
    assert bd.reported_engines(new, code, severity) == engine, reported
    if severity == R and engine in ("all", "vllm"):
        message = refusal_message(findings)
        assert f"[{code}]" in message and "Fix:" in message


def test_both_key_layouts_are_accepted(built: Path, baseline: list[Finding]) -> None:
    findings = run_static_checks(bd.build("midlayer_layout", built), bd.SOURCE_TARGET)
    assert _codes(findings) == _codes(baseline)


def test_all_faults_of_a_draft_are_reported_at_once(built: Path) -> None:
    config, tensors = bd.read_draft()
    bd.FAULTS["no_fc"](config, tensors)
    bd.FAULTS["aux_out_of_range"](config, tensors)
    bd.FAULTS["d2t_out_of_range"](config, tensors)
    findings = run_static_checks(bd.write_draft(built / "three_faults", config, tensors), bd.SOURCE_TARGET)
    codes = {f.code for f in findings if f.severity == R}
    assert {"unfilled-parameter", "aux-ids-range", "d2t-range"} <= codes


def test_wrong_prefix_says_which_prefix_to_drop(built: Path) -> None:
    findings = run_static_checks(bd.build("model_prefix", built), bd.SOURCE_TARGET)
    unloaded = next(f for f in findings if f.code == "unloaded-tensor")
    assert "drop the 'model.' prefix" in unloaded.fix
    assert "model.layers.0.mlp.down_proj.weight" in unloaded.found


def test_missing_aux_ids_name_the_ids_vllm_will_use(built: Path) -> None:
    finding = next(f for f in run_static_checks(bd.build("aux_missing", built), bd.SOURCE_TARGET)
                   if f.code == "aux-ids-missing")
    assert "(2, 3, 3)" in finding.expected  # (2, L//2, L-3) for the fixture's 6 layers


def test_silently_dropped_bias_is_called_silent(built: Path) -> None:
    finding = next(f for f in run_static_checks(bd.build("stray_bias", built), bd.SOURCE_TARGET)
                   if f.code == "unloaded-tensor" and f.engine == "vllm")
    assert "dropped silently" in finding.found


def test_sglang_view_is_clean_for_sglang(built: Path) -> None:
    diagnosis = diagnose(bd.sglang_view(built), bd.SOURCE_TARGET)
    assert not [f for f in diagnosis.findings if f.severity > I and f.applies_to("sglang")], diagnosis.findings
    assert diagnosis.aux_ids["sglang"] == diagnosis.aux_ids["declared"]
    assert all(row.engines["sglang"].status in ("loaded", "consumed") for row in diagnosis.coverage if row.key)


def test_the_served_sglang_view_is_clean_for_both_engines(tmp_path: Path) -> None:
    """The view `kimi-eagle` really writes for SGLang (serve/sglang.py), checked as SGLang and vLLM read it."""
    from kimi_eagle.serve.sglang import make_draft_view

    view = make_draft_view(str(bd.SOURCE_DRAFT), tmp_path / "view", target=str(bd.SOURCE_TARGET))
    diagnosis = diagnose(Path(view.path), bd.SOURCE_TARGET)
    assert not [f for f in diagnosis.findings if f.severity > I], diagnosis.findings
    assert diagnosis.aux_ids["sglang"] == diagnosis.aux_ids["vllm"] == [2, 4, 6]


def test_no_target_still_checks_the_draft(built: Path) -> None:
    findings = run_static_checks(bd.build("no_fc", built), None)
    assert {"no-target", "unfilled-parameter"} <= {f.code for f in findings}


def test_unreadable_draft_is_a_refusal_not_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    findings = run_static_checks(tmp_path, None)
    assert [f.code for f in findings] == ["draft-unreadable"]
    assert "not valid JSON" in findings[0].found


def test_refusal_message_is_empty_without_refusals(baseline: list[Finding]) -> None:
    assert refusal_message(baseline) == ""


def test_importing_the_checks_imports_neither_torch_nor_vllm() -> None:
    code = "import sys, kimi_eagle.checks; print('torch' in sys.modules, 'vllm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout.split()
    assert out == ["False", "False"]


# --- trained or not ---------------------------------------------------------------------------------------------
def test_trained_fixture_draft_is_trained() -> None:
    trained = diagnose(bd.SOURCE_DRAFT, bd.SOURCE_TARGET).trained
    assert trained.verdict == "trained", trained
    assert any(m.spike_ratio >= 1.5 for m in trained.matrices)


def test_fresh_init_looks_untrained(built: Path) -> None:
    trained = diagnose(bd.build("fresh_init", built), bd.SOURCE_TARGET).trained
    assert trained.verdict == "looks untrained", trained
    assert all(abs(m.spike_ratio - 1) < 0.15 and abs(m.std / m.init_std - 1) < 0.05 for m in trained.matrices)


# --- a Kimi-K2.5-sized target: headers only -----------------------------------------------------------------
@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bd.kimi_target(tmp_path_factory.mktemp("kimi") / "Kimi-K2.5")


def test_kimi_target_is_read_from_headers_only(kimi: Path, tmp_path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    shard = next(kimi.glob("*.safetensors"))
    with pytest.raises(SafetensorError):  # no data behind the header: reading any value would fail
        safe_open(str(shard), framework="numpy")
    diagnosis = diagnose(bd.kimi_draft(tmp_path / "draft", [2, 30, 58]), kimi, check_values=False)
    assert not [f for f in diagnosis.findings if f.severity > I and f.applies_to("vllm")], diagnosis.findings
    assert diagnosis.aux_ids["vllm"] == [2, 30, 58]


@pytest.mark.parametrize(("aux_ids", "fc_states", "code"), [
    ([2, 30, 62], 3, "aux-ids-range"),  # 61 layers: 0..61 are valid
    ([2, 30, 58], 1, "fc-width"),  # one 7168-wide state instead of three (21504)
    ([2, 30, 58, 60], 3, "aux-ids-count"),
])
def test_kimi_faults(kimi: Path, tmp_path: Path, aux_ids: list[int], fc_states: int, code: str) -> None:
    findings = diagnose(bd.kimi_draft(tmp_path / "draft", aux_ids, fc_states), kimi, check_values=False).findings
    assert code in {f.code for f in findings if f.severity == R}


def test_kimi_default_ids_when_missing(kimi: Path, tmp_path: Path) -> None:
    draft = bd.kimi_draft(tmp_path / "draft", [])
    finding = next(f for f in diagnose(draft, kimi, check_values=False).findings if f.code == "aux-ids-missing")
    assert "(2, 30, 58)" in finding.expected


def test_truncated_draft_shard_is_a_refusal(tmp_path: Path) -> None:
    """The Kimi-sized draft's big shard has a header and no data: reading its values must fail cleanly."""
    findings = run_static_checks(bd.kimi_draft(tmp_path / "draft", [2, 30, 58]), None)
    assert "weights-unreadable" in {f.code for f in findings if f.severity == R}



def test_per_matrix_warnings_name_the_matrix_the_aux_layer_and_each_engines_ids(built: Path) -> None:
    def found(fault: str, code: str) -> Finding:
        return next(f for f in run_static_checks(bd.build(fault, built), bd.SOURCE_TARGET) if f.code == code)

    untrained = found("one_matrix_untrained", "matrix-untrained")
    assert untrained.title == "layers.0.mlp.down_proj.weight looks untrained"
    assert "7 of the draft's 8" in untrained.found
    unused = found("fc_aux_input_unused", "fc-aux-input-unused")
    assert unused.title == "fc ignores its input from target layer 4 (columns 256-511)"
    disagree = found("aux_ids_disagree", "aux-ids-disagree")
    assert "[2, 4, 6] under the top level" in disagree.found and "[1, 3, 5] under the top-level eagle_config" in \
        disagree.found
    assert "vLLM 0.32 captures [2, 4, 6]" in disagree.expected


def test_the_diagnosis_names_the_layout(built: Path) -> None:
    assert diagnose(bd.SOURCE_DRAFT, bd.SOURCE_TARGET, check_values=False).layout == (
        "speculators: speculators (speculators_model_type eagle3, transformer_layer_config); llama layer; "
        "weights layers.N.*; ids at the top level")
    assert "weights midlayer.*" in diagnose(bd.build("midlayer_layout", built), None, check_values=False).layout
    flat = diagnose(bd.sglang_view(built / "flat"), bd.SOURCE_TARGET, check_values=False).layout
    assert flat.startswith("specforge: flat SpecForge/EAGLE config (LlamaForCausalLMEagle3)")
    assert "ids under eagle_config" in flat


def test_each_engine_gets_a_verdict_on_the_draft_as_it_is_on_disk(built: Path) -> None:
    shipped = diagnose(bd.SOURCE_DRAFT, bd.SOURCE_TARGET).engines
    assert shipped["vllm"].verdict == "loads as is" and not shipped["vllm"].fixes
    assert shipped["sglang"].verdict.startswith("does not load it as is (SGLang reads flat configs only")
    assert shipped["sglang"].verdict.endswith("through that view it loads")

    view = diagnose(bd.sglang_view(built), bd.SOURCE_TARGET).engines
    assert view["sglang"].verdict == "loads as is"

    ids_unread = diagnose(bd.build("aux_in_eagle_config", built), bd.SOURCE_TARGET).engines
    assert ids_unread["vllm"].verdict.startswith("refuses or fails: vLLM does not read where the aux ids are written")
    assert ids_unread["vllm"].problems == ["aux-ids-unread"] and ids_unread["vllm"].fixes

    no_fc = diagnose(bd.build("no_fc", built), bd.SOURCE_TARGET).engines
    for engine in ("vllm", "sglang"):
        assert "refuses or fails" in no_fc[engine].verdict
        assert [p for p in no_fc[engine].unfilled if p.endswith("fc.weight")]

    prefixed = diagnose(bd.build("model_prefix", built), bd.SOURCE_TARGET).engines
    assert prefixed["sglang"].dropped == [] and prefixed["vllm"].load_errors + prefixed["vllm"].dropped
