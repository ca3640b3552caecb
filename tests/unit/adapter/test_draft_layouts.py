"""The published draft layouts besides speculators: the MLA draft (SpecForge's flat layout) and EAGLE-3.1's flags.
Each engine's verdict on the shipped drafts, and each way an engine would run them wrongly, as a finding."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch

import tests.helpers.broken_drafts as bd
from kimi_eagle.adapter import surface
from kimi_eagle.checks import Severity, diagnose, refusal_message, run_static_checks
from kimi_eagle.checks.layout import draft_spec
from kimi_eagle.fixtures.pair_spec import EAGLE31_DRAFT_DIR, MLA_DRAFT_DIR, TARGET_DIR
from kimi_eagle.serve.sglang import ViewError, make_draft_view

R, W, I = Severity.REFUSAL, Severity.WARNING, Severity.INFO  # noqa: E741 - severity initials

# MLA fault -> (code, severity, engine)
EXPECTED = {
    "mla_v3_class_name": ("mla-architecture", R, "sglang"),
    "mla_llama_class": ("mla-architecture", R, "all"),
    "mla_speculators_format": ("mla-speculators-format", R, "vllm"),
    "mla_no_q_lora": ("mla-q-lora-rank", R, "all"),
    "mla_norm_before_fc": ("option-ignored", R, "vllm"),
    "mla_eagle31_flags": ("option-unsupported", R, "sglang"),
    "mla_typo_key": ("unloaded-tensor", R, "all"),
    "mla_no_kv_b": ("unfilled-parameter", R, "all"),
    "mla_kv_rank_other": ("tensor-shape", R, "all"),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mla-broken")


def test_every_mla_fault_has_an_expectation() -> None:
    assert set(EXPECTED) == set(bd.MLA_FAULTS)


def test_the_reader_names_each_layout() -> None:
    def layout(folder: Path) -> str:
        return draft_spec(json.loads((folder / "config.json").read_text())).layout

    assert layout(bd.SOURCE_DRAFT) == "speculators"
    assert layout(MLA_DRAFT_DIR) == "mla"
    assert layout(EAGLE31_DRAFT_DIR) == "speculators+eagle3.1"
    spec = draft_spec(json.loads((MLA_DRAFT_DIR / "config.json").read_text()))
    assert spec.mla.kv_lora_rank == 512 and spec.mla.qk_head_dim == 96 and spec.eagle_config_ids == [2, 4, 6]


def test_both_engines_load_the_mla_draft_as_it_is() -> None:
    diagnosis = diagnose(MLA_DRAFT_DIR, TARGET_DIR)
    serious = [f for f in diagnosis.findings if f.severity > I]
    assert not serious, refusal_message(serious) or serious
    assert diagnosis.engines["vllm"].verdict == "loads as is"
    assert diagnosis.engines["sglang"].verdict == "loads as is"
    assert diagnosis.layout.startswith("mla: flat SpecForge/EAGLE config (Eagle3DeepseekV2ForCausalLM)")
    assert "(MLA attention)" in diagnosis.layout and "weights midlayer.*" in diagnosis.layout
    # the plugin's fix is what lets vLLM start it: said, not hidden
    assert any(f.code == "mla-model-type" for f in diagnosis.findings)


def test_the_eagle31_draft_loads_in_vllm_and_sglang_is_told_it_would_ignore_the_flags() -> None:
    diagnosis = diagnose(EAGLE31_DRAFT_DIR, TARGET_DIR)
    assert diagnosis.engines["vllm"].verdict == "loads as is"
    assert "EAGLE-3.1 flags fc_norm, norm_output" in diagnosis.layout
    sglang = {f.code: f for f in diagnosis.findings if f.applies_to("sglang") and f.severity == R}
    assert set(sglang) == {"option-unsupported", "unloaded-tensor"}  # the flags ignored, fc_norm.* dropped
    assert "fc_norm=true, norm_output=true" in sglang["option-unsupported"].found
    assert "fc_norm.0.weight" in sglang["unloaded-tensor"].found


@pytest.mark.parametrize("fault", sorted(EXPECTED))
def test_mla_fault_is_reported(fault: str, built: Path) -> None:
    baseline = {(f.code, f.severity, f.engine) for f in run_static_checks(MLA_DRAFT_DIR, TARGET_DIR)}
    findings = run_static_checks(bd.build(fault, built), TARGET_DIR)
    new = [f for f in findings if (f.code, f.severity, f.engine) not in baseline]
    code, severity, engine = EXPECTED[fault]
    reported = [f"{f.severity.name} {f.engine} {f.code}: {f.found}" for f in findings]
    assert bd.reported_engines(new, code, severity) == engine, reported
    if engine in ("all", "vllm"):
        message = refusal_message(findings, engine="vllm")
        assert f"[{code}]" in message and "Fix:" in message


def test_a_kimi_k2_model_type_needs_no_plugin_fix(built: Path) -> None:
    config, tensors = bd.read_draft(MLA_DRAFT_DIR)
    config["model_type"] = "kimi_k2"
    findings = run_static_checks(bd.write_draft(built / "kimi_k2", config, tensors), TARGET_DIR)
    assert not [f for f in findings if f.severity > I] and not any(f.code == "mla-model-type" for f in findings)


def test_sglang_reads_the_mla_draft_as_it_is_and_gets_a_view_for_vllms_class_name(built: Path) -> None:
    assert make_draft_view(str(MLA_DRAFT_DIR)).made is False
    renamed = make_draft_view(str(bd.build("mla_v3_class_name", built)), built / "v3-view")
    assert renamed.made
    view = json.loads((Path(renamed.path) / "config.json").read_text())
    assert view["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and view["kv_lora_rank"] == 512
    assert (Path(renamed.path) / "model.safetensors").is_symlink()
    with pytest.raises(ViewError, match="fc_norm, norm_output"):
        make_draft_view(str(EAGLE31_DRAFT_DIR))
    with pytest.raises(ViewError, match="fc_norm, norm_output"):
        make_draft_view(str(bd.build("mla_eagle31_flags", built)))


def test_vllm_would_turn_a_deepseek_v3_draft_config_into_an_mtp_head_and_the_plugin_stops_it() -> None:
    from transformers import DeepseekV3Config
    from vllm.config.speculative import SpeculativeConfig

    from kimi_eagle.adapter import mla_draft

    def config(architecture: str) -> DeepseekV3Config:
        return DeepseekV3Config(architectures=[architecture], num_hidden_layers=1)

    upstream = surface.original_of(SpeculativeConfig.hf_config_override)
    assert upstream(config("Eagle3DeepseekV2ForCausalLM")).architectures == ["DeepSeekMTPModel"]
    mla_draft.keep_eagle3_configs_apart_from_mtp()
    kept = SpeculativeConfig.hf_config_override(config("Eagle3DeepseekV2ForCausalLM"))
    assert kept.model_type == "deepseek_v3" and kept.architectures == ["Eagle3DeepseekV2ForCausalLM"]
    assert SpeculativeConfig.hf_config_override(config("DeepseekV3ForCausalLM")).architectures == ["DeepSeekMTPModel"]
    # the draft ModelConfig holds this function and is pickled into the engine process by reference
    assert pickle.loads(pickle.dumps(SpeculativeConfig.hf_config_override)) is SpeculativeConfig.hf_config_override


def test_the_torch_mla_layer_computes_what_transformers_deepseek_v3_attention_computes() -> None:
    """The MLA draft is trained with `kimi_eagle.draft_model`; vLLM serves transformers' DeepSeek-V3 math."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from kimi_eagle.draft_model import MLADraftLayer
    from kimi_eagle.fixtures.pair_spec import MLA_DRAFT_LAYER_CONFIG

    torch.manual_seed(0)
    c = MLA_DRAFT_LAYER_CONFIG
    layer = MLADraftLayer(c, c["rms_norm_eps"])
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.05)
    hf_config = DeepseekV3Config(**{k: v for k, v in c.items() if k != "model_type"}, attn_implementation="eager")
    attention = hf.DeepseekV3Attention(hf_config, 0)
    width = 2 * c["hidden_size"]  # EAGLE-3's first layer reads [embedding, hidden]
    attention.q_a_proj = torch.nn.Linear(width, c["q_lora_rank"], bias=False)
    attention.kv_a_proj_with_mqa = torch.nn.Linear(width, c["kv_lora_rank"] + c["qk_rope_head_dim"], bias=False)
    state = {k.removeprefix("self_attn."): v for k, v in layer.state_dict().items() if k.startswith("self_attn.")}
    attention.load_state_dict(state)
    x, positions = torch.randn(1, 10, width), torch.arange(10)
    mask = torch.full((10, 10), float("-inf")).triu(1)[None, None]
    reference, _ = attention(x, hf.DeepseekV3RotaryEmbedding(hf_config)(x, positions[None]), mask)
    q, k, v = layer.qkv(x, positions, c["rope_parameters"]["rope_theta"])
    out = ((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 + mask).softmax(-1) @ v
    mine = layer.self_attn.o_proj(out.transpose(1, 2).reshape(1, 10, -1))
    assert torch.allclose(mine, reference, atol=1e-6)
