"""What each engine builds for an EAGLE-3 draft (a Llama or an MLA layer) and where each checkpoint name lands, read
from its code.

vLLM 0.32: `vllm/model_executor/models/llama_eagle3.py` (`Eagle3LlamaForCausalLM.load_weights`, then
`LlamaModel.load_weights` with its `WeightsMapper`, then `AutoWeightsLoader`, which raises for an unknown name
but silently ignores unknown names ending in `.bias`, and returns a set of loaded names that nobody checks).
SGLang 0.5.23: `python/sglang/srt/models/llama_eagle3.py` (`LlamaForCausalLMEagle3.load_weights`: a name that
matches no parameter, with or without a `model.` prefix, is dropped without a word; `d2t` becomes `hot_token_id`,
`t2d` is skipped; legacy `midlayer.` names are mapped to `layers.0.`; `fc` is sized for 3 aux states).
MLA drafts: vLLM 0.32 `deepseek_eagle3.py` (`Eagle3DeepseekV2ForCausalLM`: `model.` before every name but `lm_head`,
`midlayer.` -> `layers.0.`, `q_a_proj` and `kv_a_proj_with_mqa` stacked into `fused_qkv_a_proj`, `fc_norm` and
`norm_output` read, `norm_before_fc` not, `AutoWeightsLoader` as above); SGLang 0.5.23 `kimi_k25_eagle3.py` (the same
names into `midlayer.`, `q_a_proj` + `kv_a_proj_with_mqa` into `fused_qkv_a_proj_with_mqa`, an unknown name skipped
with a log line, `fc` sized from the config's aux ids, no EAGLE-3.1 flags).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kimi_eagle.checks.layout import DraftSpec

Status = Literal["loaded", "consumed", "ignored", "dropped", "load-error"]
ENGINES = ("vllm", "sglang")
ENGINE_LABELS = {"vllm": "vLLM 0.32", "sglang": "SGLang 0.5.23"}

STACKED = ((".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
           (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1))
# MLA: the two down-projections of the latent attention are one matrix in both engines
MLA_STACKED = ((".q_a_proj", ".fused_qkv_a_proj", "q_a"), (".kv_a_proj_with_mqa", ".fused_qkv_a_proj", "kv_a"),
               (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1))
ROTARY_UNUSED = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(frozen=True)
class Param:
    """One engine parameter and the checkpoint tensor shape each of its shards takes."""

    name: str
    shards: dict[object, tuple[int, ...]]  # shard id (None: the whole parameter) -> expected tensor shape
    shareable: bool = False  # embeddings / lm_head: the engine may take the target's instead
    needed: bool = True  # False: exists but unused (e.g. hidden_norm of layers after the first)


@dataclass(frozen=True)
class Fate:
    status: Status
    param: str | None = None
    shard: object = None
    note: str = ""

    @property
    def fills(self) -> bool:
        return self.status == "loaded"


@dataclass
class EngineModel:
    engine: str
    params: dict[str, Param] = field(default_factory=dict)

    def add(self, name: str, shape: tuple[int, ...], shard: object = None, **kwargs) -> None:
        if name in self.params:
            self.params[name].shards[shard] = shape
        else:
            self.params[name] = Param(name, {shard: shape}, **kwargs)


def _layer_params(model: EngineModel, prefix: str, d: DraftSpec, first: bool, qkv_bias: bool, o_bias: bool) -> None:
    h, q, kv = d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    width = 2 * h if first else h
    for shard, rows in (("q", q), ("k", kv), ("v", kv)):
        model.add(f"{prefix}self_attn.qkv_proj.weight", (rows, width), shard)
        if qkv_bias:
            model.add(f"{prefix}self_attn.qkv_proj.bias", (rows,), shard)
    model.add(f"{prefix}self_attn.o_proj.weight", (h, q))
    if o_bias:
        model.add(f"{prefix}self_attn.o_proj.bias", (h,))
    for shard in (0, 1):
        model.add(f"{prefix}mlp.gate_up_proj.weight", (d.intermediate_size, h), shard)
        if d.mlp_bias:
            model.add(f"{prefix}mlp.gate_up_proj.bias", (d.intermediate_size,), shard)
    model.add(f"{prefix}mlp.down_proj.weight", (h, d.intermediate_size))
    if d.mlp_bias:
        model.add(f"{prefix}mlp.down_proj.bias", (h,))
    model.add(f"{prefix}input_layernorm.weight", (h,))
    model.add(f"{prefix}post_attention_layernorm.weight", (h,))
    model.add(f"{prefix}hidden_norm.weight", (h,), needed=first)


def _mla_layer_params(model: EngineModel, prefix: str, d: DraftSpec, first: bool) -> None:
    """`DeepseekV2Eagle3DecoderLayer`: MLA attention (input 2H in the first layer) and a dense MLP."""
    mla, h, heads = d.mla, d.hidden_size, d.num_heads
    width = 2 * h if first else h
    attn = f"{prefix}self_attn."
    if mla.q_lora_rank:
        model.add(f"{attn}fused_qkv_a_proj.weight", (mla.q_lora_rank, width), "q_a")
        model.add(f"{attn}fused_qkv_a_proj.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, width), "kv_a")
        model.add(f"{attn}q_a_layernorm.weight", (mla.q_lora_rank,))
        model.add(f"{attn}q_b_proj.weight", (heads * mla.qk_head_dim, mla.q_lora_rank))
    else:
        model.add(f"{attn}q_proj.weight", (heads * mla.qk_head_dim, width))
        model.add(f"{attn}kv_a_proj_with_mqa.weight", (mla.kv_lora_rank + mla.qk_rope_head_dim, width))
    model.add(f"{attn}kv_a_layernorm.weight", (mla.kv_lora_rank,))
    model.add(f"{attn}kv_b_proj.weight", (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank))
    model.add(f"{attn}o_proj.weight", (h, heads * mla.v_head_dim))
    for shard in (0, 1):
        model.add(f"{prefix}mlp.gate_up_proj.weight", (d.intermediate_size, h), shard)
    model.add(f"{prefix}mlp.down_proj.weight", (h, d.intermediate_size))
    for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        model.add(f"{prefix}{norm}.weight", (h,), needed=first or norm != "hidden_norm")


def vllm_model(d: DraftSpec, target_vocab: int) -> EngineModel:
    """The parameters of vLLM 0.32's `Eagle3LlamaForCausalLM` (or, for an MLA layer, `Eagle3DeepseekV2ForCausalLM`)
    for this config."""
    m = EngineModel("vllm")
    h, th, n_aux = d.hidden_size, d.target_hidden_size, d.vllm_fc_count
    m.add("model.embed_tokens.weight", (d.vocab_size, h), shareable=True)
    for i in range(d.num_layers):
        if d.mla:
            _mla_layer_params(m, f"model.layers.{i}.", d, first=i == 0)
        else:
            _layer_params(m, f"model.layers.{i}.", d, first=i == 0, qkv_bias=d.attention_bias,
                          o_bias=d.attention_bias)
    if d.mla or d.use_aux_hidden_state:  # the MLA class always builds fc, and has no input_norm
        m.add("model.fc.weight", (h, n_aux * th))
        if d.norm_before_fc and not d.mla:
            m.add("model.input_norm.weight", (n_aux * th,))
        if d.fc_norm:
            for j in range(n_aux):
                m.add(f"model.fc_norm.{j}.weight", (th,))
    m.add("model.norm.weight", (h,))
    m.add("lm_head.weight", (d.draft_vocab_size, h), shareable=True)
    if d.draft_vocab_size != target_vocab:
        m.add("draft_id_to_target_id", (d.draft_vocab_size,))
    return m


def vllm_fate(name: str, d: DraftSpec, model: EngineModel, has_d2t: bool) -> Fate:
    """Where vLLM 0.32 puts checkpoint tensor `name` (`Eagle3LlamaForCausalLM.load_weights`, or the MLA class's)."""
    if d.mla:
        return _vllm_mla_fate(name, model)
    if "t2d" in name:
        return Fate("consumed", note="skipped by vLLM (checked here against d2t)")
    if "d2t" in name:
        name = name.replace("d2t", "draft_id_to_target_id")
    elif "mask_hidden" in name:
        return Fate("dropped", note="mask_hidden is for parallel drafting: skipped with a log warning")
    elif "lm_head" not in name:
        name = "model." + name
    dropped_substr = {"mask_hidden": "parallel drafting only"}
    if not has_d2t:
        dropped_substr["draft_id_to_target_id"] = "no d2t in the checkpoint"
    if not d.use_aux_hidden_state:
        dropped_substr["fc."] = "eagle_config.use_aux_hidden_state is false"
    if not d.norm_before_fc:
        dropped_substr["input_norm."] = "the config does not enable norm_before_fc"
    for substr, why in dropped_substr.items():
        if substr in name:
            return Fate("dropped", note=f"dropped without a word: {why}")
    if any(s in name for s in ROTARY_UNUSED):
        return Fate("ignored", note="rotary cache: recomputed by the engine")
    shard = None
    if name.startswith("model."):
        inner, shard = _stacked(name.removeprefix("model.").replace("midlayer.", "layers.0.", 1), STACKED)
        name = "model." + inner
    return _vllm_param_fate(name, shard, model)


def _stacked(name: str, table: tuple) -> tuple[str, object]:
    for old, new, shard_id in table:
        if old in name:
            return name.replace(old, new, 1), shard_id
    return name, None


def _vllm_param_fate(name: str, shard: object, model: EngineModel) -> Fate:
    """`AutoWeightsLoader` on an engine name: loaded, an unknown bias ignored, anything else unknown a load error."""
    if name in model.params:
        return Fate("loaded", name, shard)
    if name.endswith(".bias"):
        return Fate("dropped", note="no such bias parameter: AutoWeightsLoader ignores unknown '.bias' names")
    return Fate("load-error", note=f"no parameter {name!r}: vLLM stops at load with 'There is no module or "
                                   "parameter named ...'")


def _vllm_mla_fate(name: str, model: EngineModel) -> Fate:
    """`Eagle3DeepseekV2ForCausalLM.load_weights`, then `DeepseekV2Eagle3Model.load_weights` (its mapper)."""
    if "t2d" in name:
        return Fate("consumed", note="skipped by vLLM (checked here against d2t)")
    if "d2t" in name:
        name = name.replace("d2t", "draft_id_to_target_id")
        return Fate("loaded", name) if name in model.params else Fate(
            "dropped", note="the draft vocabulary equals the target's: no d2t parameter")
    if "lm_head" not in name:
        name = "model." + name
    if any(s in name for s in ROTARY_UNUSED):
        return Fate("ignored", note="rotary cache: recomputed by the engine")
    name, shard = _stacked(name.replace("midlayer.", "layers.0.", 1), MLA_STACKED)
    return _vllm_param_fate(name, shard, model)


def sglang_model(d: DraftSpec, target_vocab: int) -> EngineModel:
    """The parameters of SGLang 0.5.23's `LlamaForCausalLMEagle3` (one layer, qkv without bias, fc for 3 states), or
    for an MLA layer of `kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM` (fc sized from the config's aux ids)."""
    m = EngineModel("sglang")
    h, th = d.hidden_size, d.target_hidden_size
    m.add("model.embed_tokens.weight", (d.vocab_size, h), shareable=True)
    if d.mla:
        _mla_layer_params(m, "model.layers.0.", d, first=True)
        m.add("model.fc.weight", (h, len(d.sglang_ids or [0, 0, 0]) * th))
    else:
        _layer_params(m, "model.layers.0.", d, first=True, qkv_bias=False, o_bias=d.attention_bias)
        m.add("model.fc.weight", (h, 3 * th))
    m.add("model.norm.weight", (h,))
    if not d.tie_word_embeddings:
        # with no draft_vocab_size SGLang takes the target's head (`load_lm_head_from_target`)
        m.add("lm_head.weight", (d.draft_vocab_size, h), shareable=d.declared_draft_vocab_size is None)
    return m


def sglang_fate(name: str, d: DraftSpec, model: EngineModel) -> Fate:
    """Where SGLang 0.5.23 puts checkpoint tensor `name` (`LlamaForCausalLMEagle3.load_weights`)."""
    if "d2t" in name:
        return Fate("consumed", "hot_token_id", note="becomes hot_token_id (draft id + d2t)")
    if "t2d" in name:
        return Fate("consumed", note="skipped by SGLang (checked here against d2t)")
    name, shard = _stacked(name.replace("midlayer.", "layers.0.", 1), MLA_STACKED if d.mla else STACKED)
    param = name if name in model.params else f"model.{name}"
    if param == "model.embed_tokens.weight":
        # the EAGLE-3 worker then calls set_embed(target's embedding) on every EAGLE-3 draft
        return Fate("loaded", param, shard, note="then replaced by the target's embedding (set_embed)")
    if param in model.params:
        return Fate("loaded", param, shard)
    if any(s in name for s in ROTARY_UNUSED):
        return Fate("ignored", note="rotary cache: recomputed by the engine")
    return Fate("dropped", note=f"matches no parameter ({param!r}): SGLang drops it without a word")
