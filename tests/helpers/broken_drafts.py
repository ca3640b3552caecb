"""Build broken variants of the fixture draft (one fault each) and header-only Kimi-K2.5-sized checkpoints.

Each fault is a function that edits a copy of the draft's config and tensors; `build(name, out)` writes the
result as a speculators-format folder. A fault takes its sizes from the config and the tensors, so that the same
fault applies to a draft of Kimi-K2.5's real width (tests/helpers/real_kimi.py). Header-only checkpoints carry
real shapes with no data behind them: anything that tries to read their values fails, so a check that passes on
them read headers only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kimi_eagle.fixtures.pair_spec import (
    DRAFT_DIR,
    DRAFT_VOCAB_SIZE,
    HIDDEN,
    MLA_DRAFT_DIR,
    TARGET_DIR,
)

SOURCE_DRAFT = DRAFT_DIR
SOURCE_MLA_DRAFT = MLA_DRAFT_DIR
SOURCE_TARGET = TARGET_DIR

Tensors = dict[str, torch.Tensor]
Fault = Callable[[dict, Tensors], None]
FAULTS: dict[str, Fault] = {}
MLA_FAULTS: dict[str, Fault] = {}  # faults of the MLA draft (a flat SpecForge-layout checkpoint)


def fault(fn: Fault) -> Fault:
    FAULTS[fn.__name__] = fn
    return fn


def mla_fault(fn: Fault) -> Fault:
    MLA_FAULTS[fn.__name__] = fn
    return fn


def reported_engines(findings: list, code: str, severity) -> str:
    """'all' when `code` at `severity` is reported for both engines (as one finding or one per engine), else the one
    engine, or ''."""
    hit = {e for f in findings if (f.code, f.severity) == (code, severity) for e in ("vllm", "sglang")
           if f.applies_to(e)}
    return "all" if hit == {"vllm", "sglang"} else next(iter(hit), "")


def read_draft(folder: Path = SOURCE_DRAFT) -> tuple[dict, Tensors]:
    return json.loads((folder / "config.json").read_text()), load_file(folder / "model.safetensors")


def write_draft(out: Path, config: dict, tensors: Tensors) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def build(name: str, out: Path) -> Path:
    mla = name in MLA_FAULTS
    config, tensors = read_draft(SOURCE_MLA_DRAFT if mla else SOURCE_DRAFT)
    (MLA_FAULTS if mla else FAULTS)[name](config, tensors)
    return write_draft(out / name, config, tensors)


def specforge_copy(out: Path) -> Path:
    """The shipped draft as SpecForge publishes drafts (AQ-MedAI/Kimi-K25-eagle3, lightseekorg/kimi-k2.5-eagle3):
    a flat Llama config, the aux ids only under `eagle_config`, the layer's weights under `midlayer.*`."""
    from kimi_eagle.serve.sglang import sglang_draft_config

    config, tensors = read_draft()
    target_text = json.loads((SOURCE_TARGET / "config.json").read_text())["text_config"]
    flat, _ = sglang_draft_config(config, target_text)
    _rename(tensors, "layers.0.", "midlayer.")
    return write_draft(out, flat, tensors)


def draft_without(out: Path, *tensor_names: str) -> Path:
    """The shipped draft with these tensors left out of its checkpoint."""
    config, tensors = read_draft()
    return write_draft(out, config, {k: v for k, v in tensors.items() if k not in tensor_names})


def _hidden(config: dict) -> int:
    """The draft's hidden size (the target's too, for these drafts): faults read it from the config, so that each
    applies at any width (tests/helpers/real_kimi.py applies them to a Kimi-K2.5-wide draft)."""
    return (config.get("transformer_layer_config") or config)["hidden_size"]


def _rename(tensors: Tensors, old: str, new: str) -> None:
    for key in [k for k in tensors if k.startswith(old)]:
        tensors[new + key.removeprefix(old)] = tensors.pop(key)


# --- keys -------------------------------------------------------------------------------------------------
@fault
def model_prefix(config: dict, t: Tensors) -> None:
    _rename(t, "layers.0.", "model.layers.0.")


@fault
def decoder_prefix(config: dict, t: Tensors) -> None:
    _rename(t, "layers.0.", "decoder.layers.0.")


@fault
def typo_key(config: dict, t: Tensors) -> None:
    t["layers.0.mlp.dwon_proj.weight"] = t.pop("layers.0.mlp.down_proj.weight")


@fault
def stray_bias(config: dict, t: Tensors) -> None:
    t["layers.0.self_attn.q_proj.bias"] = torch.zeros(t["layers.0.self_attn.q_proj.weight"].shape[0])


@fault
def midlayer_layout(config: dict, t: Tensors) -> None:
    _rename(t, "layers.0.", "midlayer.")


@fault
def both_layouts(config: dict, t: Tensors) -> None:
    t["midlayer.mlp.down_proj.weight"] = t["layers.0.mlp.down_proj.weight"].clone()


@fault
def no_fc(config: dict, t: Tensors) -> None:
    del t["fc.weight"]


@fault
def no_down_proj(config: dict, t: Tensors) -> None:
    del t["layers.0.mlp.down_proj.weight"]


@fault
def no_embeddings(config: dict, t: Tensors) -> None:
    del t["embed_tokens.weight"]


@fault
def no_lm_head(config: dict, t: Tensors) -> None:
    del t["lm_head.weight"]


# --- shapes -----------------------------------------------------------------------------------------------
@fault
def fc_one_layer(config: dict, t: Tensors) -> None:
    """What SGLang's Kimi-K2.5 class fed the draft: one 7168-wide state instead of three (here 256 of 768)."""
    t["fc.weight"] = t["fc.weight"][:, :_hidden(config)].clone()


@fault
def target_hidden_other(config: dict, t: Tensors) -> None:
    config["target_hidden_size"] = 2 * _hidden(config)


@fault
def qkv_narrow(config: dict, t: Tensors) -> None:
    t["layers.0.self_attn.q_proj.weight"] = t["layers.0.self_attn.q_proj.weight"][:, :_hidden(config)].clone()


@fault
def lm_head_rows(config: dict, t: Tensors) -> None:
    t["lm_head.weight"] = t["lm_head.weight"][:1000].clone()


# --- aux ids ----------------------------------------------------------------------------------------------
@fault
def aux_out_of_range(config: dict, t: Tensors) -> None:
    """The last id past the target's layers (the fixture's 6, Kimi-K2.5's 61)."""
    config["eagle_aux_hidden_state_layer_ids"] = [*config["eagle_aux_hidden_state_layer_ids"][:-1], 99]


@fault
def aux_duplicated(config: dict, t: Tensors) -> None:
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4, 4]


@fault
def aux_two_ids(config: dict, t: Tensors) -> None:
    config["eagle_aux_hidden_state_layer_ids"] = [2, 4]


@fault
def aux_missing(config: dict, t: Tensors) -> None:
    del config["eagle_aux_hidden_state_layer_ids"]


@fault
def aux_ids_strings(config: dict, t: Tensors) -> None:
    """Ids written as JSON strings: vLLM's target compares each layer's int index with them and captures nothing."""
    config["eagle_aux_hidden_state_layer_ids"] = [str(i) for i in config["eagle_aux_hidden_state_layer_ids"]]


@fault
def aux_in_eagle_config(config: dict, t: Tensors) -> None:
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": config.pop("eagle_aux_hidden_state_layer_ids")}


# --- vocabulary -------------------------------------------------------------------------------------------
@fault
def d2t_short(config: dict, t: Tensors) -> None:
    t["d2t"] = t["d2t"][: config["draft_vocab_size"] - 24].clone()


@fault
def d2t_out_of_range(config: dict, t: Tensors) -> None:
    t["d2t"][7] = config["transformer_layer_config"]["vocab_size"]  # draft id 7 -> a target id past the vocabulary


@fault
def t2d_short(config: dict, t: Tensors) -> None:
    t["t2d"] = t["t2d"][:-96].clone()


@fault
def t2d_disagrees(config: dict, t: Tensors) -> None:
    t2d = t["t2d"].clone()
    off = int((~t2d).nonzero()[0])
    t2d[off] = True
    t["t2d"] = t2d


@fault
def no_vocab_mapping(config: dict, t: Tensors) -> None:
    del t["d2t"], t["t2d"]


# --- verifier and options -----------------------------------------------------------------------------------
@fault
def verifier_other_name(config: dict, t: Tensors) -> None:
    config["speculators_config"]["verifier"]["architectures"] = ["DeepseekV3ForCausalLM"]


@fault
def norm_before_residual(config: dict, t: Tensors) -> None:
    config["norm_before_residual"] = True


@fault
def norm_before_residual_unset(config: dict, t: Tensors) -> None:
    del config["norm_before_residual"]


@fault
def trained_embeddings(config: dict, t: Tensors) -> None:
    config["embed_requires_grad"] = True


@fault
def mistral_layer(config: dict, t: Tensors) -> None:
    config["transformer_layer_config"]["model_type"] = "mistral"


# --- values -----------------------------------------------------------------------------------------------
@fault
def nan_in_fc(config: dict, t: Tensors) -> None:
    t["fc.weight"] = t["fc.weight"].clone()
    t["fc.weight"][3, 5] = float("nan")


@fault
def zero_o_proj(config: dict, t: Tensors) -> None:
    t["layers.0.self_attn.o_proj.weight"] = torch.zeros_like(t["layers.0.self_attn.o_proj.weight"])


@fault
def mixed_dtypes(config: dict, t: Tensors) -> None:
    t["fc.weight"] = t["fc.weight"].to(torch.float32)


@fault
def fresh_init(config: dict, t: Tensors) -> None:
    """The same shapes straight from PyTorch's default nn.Linear init (what speculators starts from), with the
    embeddings, head and vocabulary maps kept from the trained draft, as speculators copies them in."""
    from kimi_eagle.draft_model import Eagle3Draft

    torch.manual_seed(1234)
    fresh = Eagle3Draft(config["transformer_layer_config"], len(config["eagle_aux_hidden_state_layer_ids"]), HIDDEN,
                        DRAFT_VOCAB_SIZE).state_dict()
    for name, value in fresh.items():
        if name not in ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d", "norm.weight"):
            t[name] = value.to(t[name].dtype)


def _fresh_linear(rows: int, cols: int, seed: int) -> torch.Tensor:
    """PyTorch's default nn.Linear init, what a draft matrix holds before training."""
    torch.manual_seed(seed)
    return torch.nn.Linear(cols, rows, bias=False).weight.detach()


@fault
def one_matrix_untrained(config: dict, t: Tensors) -> None:
    """Every matrix trained but one: the draft as a whole still passes a "trained or not" majority vote."""
    name = "layers.0.mlp.down_proj.weight"
    t[name] = _fresh_linear(*t[name].shape, seed=7).to(t[name].dtype)


@fault
def fc_aux_input_unused(config: dict, t: Tensors) -> None:
    """fc's columns for the second aux layer never trained: a draft trained while that layer's state was missing."""
    h = _hidden(config)
    fc = t["fc.weight"].clone()
    fc[:, h:2 * h] = _fresh_linear(h, 3 * h, seed=8)[:, h:2 * h].to(fc.dtype)
    t["fc.weight"] = fc


@fault
def aux_ids_disagree(config: dict, t: Tensors) -> None:
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}


# --- the MLA draft: what each engine would do with a published MLA layout ----------------------------------------
@mla_fault
def mla_v3_class_name(config: dict, t: Tensors) -> None:
    config["architectures"] = ["Eagle3DeepseekV3ForCausalLM"]  # vLLM's other name: SGLang registers only V2


@mla_fault
def mla_llama_class(config: dict, t: Tensors) -> None:
    config["architectures"] = ["LlamaForCausalLMEagle3"]


@mla_fault
def mla_speculators_format(config: dict, t: Tensors) -> None:
    layer = {k: v for k, v in config.items() if k not in ("architectures", "draft_vocab_size", "eagle_config",
                                                          "target_hidden_size", "dtype")}
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    config.clear()
    config.update(speculators_model_type="eagle3", architectures=["Eagle3DraftModel"], draft_vocab_size=1024,
                  norm_before_residual=False, eagle_aux_hidden_state_layer_ids=ids, transformer_layer_config=layer)
    _rename(t, "midlayer.", "layers.0.")


@mla_fault
def mla_no_q_lora(config: dict, t: Tensors) -> None:
    config["q_lora_rank"] = None
    q = t.pop("midlayer.self_attn.q_b_proj.weight") @ t.pop("midlayer.self_attn.q_a_proj.weight")
    t.pop("midlayer.self_attn.q_a_layernorm.weight")
    t["midlayer.self_attn.q_proj.weight"] = q


@mla_fault
def mla_norm_before_fc(config: dict, t: Tensors) -> None:
    config["norm_before_fc"] = True


@mla_fault
def mla_eagle31_flags(config: dict, t: Tensors) -> None:
    config.update(fc_norm=True, norm_output=True)
    for j in range(3):
        t[f"fc_norm.{j}.weight"] = torch.ones(HIDDEN, dtype=t["fc.weight"].dtype)


@mla_fault
def mla_typo_key(config: dict, t: Tensors) -> None:
    t["midlayer.self_attn.kv_b_prj.weight"] = t.pop("midlayer.self_attn.kv_b_proj.weight")


@mla_fault
def mla_no_kv_b(config: dict, t: Tensors) -> None:
    del t["midlayer.self_attn.kv_b_proj.weight"]


@mla_fault
def mla_kv_rank_other(config: dict, t: Tensors) -> None:
    config["kv_lora_rank"] = 256


def sglang_view(out: Path) -> Path:
    """A flat SGLang-style config over the fixture's weights (how a flat view of the draft looks)."""
    config, tensors = read_draft()
    layer = dict(config["transformer_layer_config"])
    layer.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=config["draft_vocab_size"],
                 target_hidden_size=HIDDEN, torch_dtype=config["dtype"],
                 eagle_config={"eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"],
                               "use_aux_hidden_state": True})
    return write_draft(out / "sglang_view", layer, tensors)


# --- header-only checkpoints of Kimi-K2.5's real sizes --------------------------------------------------------
DTYPE_BYTES = {"BF16": 2, "F32": 4, "I64": 8, "BOOL": 1, "I32": 4, "U8": 1}


def write_header_only(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A safetensors header describing `tensors` (dtype, shape) with no data after it."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = DTYPE_BYTES[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


KIMI_TEXT = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "vocab_size": 163840,
             "num_attention_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048,
             "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
             "v_head_dim": 128, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
             "first_k_dense_replace": 1, "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0}


def kimi_target(out: Path, shards: int = 64) -> Path:
    """Kimi-K2.5's config and weight names (a few tensors per layer, real shapes), 64 header-only shards."""
    out.mkdir(parents=True, exist_ok=True)
    h, lm = KIMI_TEXT["hidden_size"], "language_model."
    names: dict[str, tuple[str, tuple[int, ...]]] = {
        f"{lm}model.embed_tokens.weight": ("BF16", (163840, h)),
        f"{lm}lm_head.weight": ("BF16", (163840, h)),
        f"{lm}model.norm.weight": ("BF16", (h,)),
        "vision_tower.patch_embed.proj.weight": ("BF16", (1152, 3, 14, 14)),
        "mm_projector.proj.0.weight": ("BF16", (h, 4608)),
    }
    for i in range(KIMI_TEXT["num_hidden_layers"]):
        p = f"{lm}model.layers.{i}."
        names[p + "input_layernorm.weight"] = ("BF16", (h,))
        names[p + "self_attn.q_a_proj.weight"] = ("BF16", (1536, h))
        names[p + "self_attn.kv_a_proj_with_mqa.weight"] = ("BF16", (576, h))
        names[p + "mlp.shared_experts.down_proj.weight"] = ("BF16", (h, 2048))
    keys = list(names)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[s::shards]
        write_header_only(out / file, {k: names[k] for k in part})
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
              "text_config": KIMI_TEXT, "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27}}
    (out / "config.json").write_text(json.dumps(config))
    return out


def kimi_draft(out: Path, aux_ids: list[int], fc_states: int = 3, draft_vocab: int = 32000) -> Path:
    """A Kimi-K2.5-sized speculators draft: the big matrices header-only, d2t/t2d/norms real (value checks read
    those), so `diagnose(..., check_values=False)` must read only headers and the vocabulary maps."""
    out.mkdir(parents=True, exist_ok=True)
    h, v = KIMI_TEXT["hidden_size"], KIMI_TEXT["vocab_size"]
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": v, "hidden_size": h,
             "intermediate_size": 18432, "num_hidden_layers": 1, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    big = {"fc.weight": ("BF16", (h, fc_states * h)),
           "layers.0.self_attn.q_proj.weight": ("BF16", (64 * 128, 2 * h)),
           "layers.0.self_attn.k_proj.weight": ("BF16", (8 * 128, 2 * h)),
           "layers.0.self_attn.v_proj.weight": ("BF16", (8 * 128, 2 * h)),
           "layers.0.self_attn.o_proj.weight": ("BF16", (h, 64 * 128)),
           "layers.0.mlp.gate_proj.weight": ("BF16", (18432, h)),
           "layers.0.mlp.up_proj.weight": ("BF16", (18432, h)),
           "layers.0.mlp.down_proj.weight": ("BF16", (h, 18432)),
           "lm_head.weight": ("BF16", (draft_vocab, h))}
    write_header_only(out / "model-00002-of-00002.safetensors", big)
    hot = torch.arange(draft_vocab) * 5  # every fifth target id
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[hot] = True
    small = {"d2t": hot - torch.arange(draft_vocab), "t2d": t2d}
    for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm"):
        small[f"layers.0.{n}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    small["norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    save_file(small, out / "model-00001-of-00002.safetensors")
    weight_map = {**dict.fromkeys(small, "model-00001-of-00002.safetensors"),
                  **dict.fromkeys(big, "model-00002-of-00002.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3",
              "draft_vocab_size": draft_vocab, "norm_before_residual": False, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": aux_ids, "transformer_layer_config": layer,
              "speculators_config": {
                  "algorithm": "eagle3",
                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                  "verifier": {"name_or_path": "moonshotai/Kimi-K2.5",
                               "architectures": ["KimiK25ForConditionalGeneration"]}}}
    (out / "config.json").write_text(json.dumps(config))
    return out
