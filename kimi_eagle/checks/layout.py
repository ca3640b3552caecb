"""The draft and the target as the engines see them, from their configs (and the target's weight names): the one
reader of draft configs, used by the guards inside vLLM, doctor, the sizing and the SGLang view.

vLLM 0.32 reads a speculators-format draft through `SpeculatorsConfig`: the layer config is
`transformer_layer_config`, plus `draft_vocab_size`, `target_hidden_size`, the norm options and the top-level
`eagle_aux_hidden_state_layer_ids` (see `vllm/transformers_utils/configs/speculators/algos.py`). A flat config
(SpecForge's layout, `architectures: ["LlamaForCausalLMEagle3"]`, or `Eagle3DeepseekV2ForCausalLM` for a draft with
one MLA layer) is read as it is. `DraftSpec.layout` names which of the published layouts it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from kimi_eagle.checks.checkpoint import Checkpoint

LAYER_NAME = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")


def default_aux_ids(num_layers: int) -> list[int]:
    """The aux layer ids vLLM's target captures, and speculators trains with, when a draft names none: (2, L//2, L-3)
    of the target's L layers (`gpu_model_runner._get_eagle3_aux_layers_from_config`)."""
    return [2, num_layers // 2, num_layers - 3]


MLA_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")  # a DeepSeek/Kimi multi-head latent attention layer
EAGLE31_FLAGS = ("fc_norm", "norm_output")
NORM_OPTIONS = ("norm_before_residual", "norm_before_fc", *EAGLE31_FLAGS)
MLA_DRAFT_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")  # vLLM 0.32's registry
SGLANG_MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # the one name SGLang registers (its EntryClass)


@dataclass(frozen=True)
class MLAShape:
    """The latent-attention sizes of an MLA draft layer."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _mla_shape(layer: dict) -> MLAShape | None:
    if layer.get("model_type") not in MLA_MODEL_TYPES:
        return None
    missing = [k for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if k not in layer]
    if missing:
        raise DraftConfigError(f"an MLA draft layer (model_type {layer['model_type']!r}) needs {', '.join(missing)}")
    return MLAShape(q_lora_rank=layer.get("q_lora_rank"), kv_lora_rank=int(layer["kv_lora_rank"]),
                    qk_nope_head_dim=int(layer["qk_nope_head_dim"]), qk_rope_head_dim=int(layer["qk_rope_head_dim"]),
                    v_head_dim=int(layer["v_head_dim"]))


def layer_ids(value: object, where: str = "eagle_aux_hidden_state_layer_ids") -> list[int] | None:
    """A list of aux layer ids as a config holds it, or None when it holds none. Ids that are not JSON integers
    (`["2", "30", "58"]`) are refused: neither engine converts them, and vLLM's target then captures no layer at all
    (it compares the layer's int index with strings), so the draft gets nothing to fuse."""
    if not isinstance(value, list | tuple) or not value:
        return None
    wrong = [v for v in value if isinstance(v, bool) or not isinstance(v, int)]
    if wrong:
        fixed = [int(v) if isinstance(v, str) and v.strip().lstrip("-").isdigit() else v for v in value]
        what = "is not a JSON integer" if len(wrong) == 1 else "are not JSON integers"
        raise DraftConfigError(
            f"{where} is {list(value)!r}: {', '.join(repr(v) for v in wrong)} {what}, and no engine converts "
            "them (vLLM's target captures no layer for a string id, and its first step fails)",
            code="aux-ids-type", fix=f"write the ids as integers: \"{where.rsplit('.', 1)[-1]}\": {fixed}")
    return list(value)


@dataclass
class DraftSpec:
    """A draft config normalised to what the engines read. `declared_*` is what the file says."""

    format: str  # "speculators" or "flat"
    model_type: str
    architectures: list[str]
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    declared_draft_vocab_size: int | None
    declared_target_hidden_size: int | None
    declared_norm_before_residual: bool | None
    norm_before_residual: bool  # as vLLM applies it
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    attention_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool
    use_aux_hidden_state: bool
    embed_requires_grad: bool | None
    top_level_ids: list[int] | None  # `eagle_aux_hidden_state_layer_ids` where vLLM's target reads it
    eagle_config_ids: list[int] | None  # `eagle_config.eagle_aux_hidden_state_layer_ids` where vLLM reads it
    unread_ids: list[int] | None  # ids written where no engine reads them (e.g. a speculators top-level eagle_config)
    num_aux_hidden_states: int | None
    verifier_architectures: list[str] = field(default_factory=list)
    verifier_name: str | None = None
    layer_config: dict = field(default_factory=dict)  # the draft layer's own config, every field as written
    dtype: str | None = None  # the checkpoint's dtype as the config states it
    mla: MLAShape | None = None  # set for a DeepSeek/Kimi MLA layer

    @property
    def eagle31_flags(self) -> list[str]:
        return [name for name in EAGLE31_FLAGS if getattr(self, name)]

    @property
    def options_on(self) -> list[str]:
        """The norm options the file turns on (`norm_before_residual` as written, not vLLM's default for it)."""
        return [name for name in NORM_OPTIONS
                if (self.declared_norm_before_residual if name == "norm_before_residual" else getattr(self, name))]

    @property
    def layout(self) -> str:
        """Which published layout this is: "speculators", "specforge" (flat, Llama layer) or "mla" (flat, MLA
        layer), with "+eagle3.1" when it sets EAGLE-3.1's flags."""
        base = "mla" if self.mla else self.format.replace("flat", "specforge")
        return base + ("+eagle3.1" if self.eagle31_flags else "")

    @property
    def draft_vocab_size(self) -> int:
        return self.declared_draft_vocab_size or self.vocab_size

    @property
    def target_hidden_size(self) -> int:
        return self.declared_target_hidden_size or self.hidden_size

    @property
    def declared_ids(self) -> list[int] | None:
        """The ids the draft was trained with, wherever the config wrote them."""
        return self.top_level_ids or self.eagle_config_ids or self.unread_ids

    @property
    def vllm_target_ids(self) -> list[int] | None:
        """What vLLM's target captures (`gpu_model_runner._get_eagle3_aux_layers_from_config`); None: default."""
        return self.top_level_ids or self.eagle_config_ids

    @property
    def vllm_fc_count(self) -> int:
        """How many aux states vLLM sizes `fc` for (`llama_eagle3.LlamaModel.__init__`)."""
        if self.num_aux_hidden_states is not None:
            return self.num_aux_hidden_states
        return len(self.eagle_config_ids) if self.eagle_config_ids else 3

    @property
    def sglang_ids(self) -> list[int] | None:
        """SGLang 0.5.23 reads only `eagle_config.eagle_aux_hidden_state_layer_ids` of a flat config."""
        return self.eagle_config_ids if self.format == "flat" else self.declared_ids


class DraftConfigError(ValueError):
    """A config that is not an EAGLE-3 draft config; the message says what it is and what is needed. `code` and
    `fix` are the finding doctor reports for it."""

    def __init__(self, message: str, code: str = "draft-unreadable", fix: str = "fix the folder") -> None:
        super().__init__(message)
        self.code = code
        self.fix = fix


@dataclass
class _Sections:
    """Where a layout keeps each part of a draft config."""

    format: str
    layer: dict
    eagle_config: dict
    top_level_ids: list[int] | None
    eagle_config_ids: list[int] | None
    unread_ids: list[int] | None
    declared_norm_before_residual: bool | None
    norm_before_residual: bool
    verifier: dict


def _speculators_sections(config: dict) -> _Sections:
    kind = config["speculators_model_type"]
    if kind != "eagle3":
        raise DraftConfigError(f"speculators_model_type is {kind!r}: this checks EAGLE-3 drafts ('eagle3') only")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise DraftConfigError("a speculators config needs a `transformer_layer_config` object (the draft "
                               "layer's Hugging Face config)")
    layer_eagle = layer.get("eagle_config") or {}
    declared_nbr = config.get("norm_before_residual")
    return _Sections(
        format="speculators", layer=layer, eagle_config=layer_eagle,
        # vLLM copies only these fields from the top level (speculators/algos.py::update_eagle3).
        top_level_ids=(layer_ids(config.get("eagle_aux_hidden_state_layer_ids"))
                       or layer_ids(layer.get("eagle_aux_hidden_state_layer_ids"),
                                    "transformer_layer_config.eagle_aux_hidden_state_layer_ids")),
        eagle_config_ids=layer_ids(layer_eagle.get("eagle_aux_hidden_state_layer_ids"),
                                   "transformer_layer_config.eagle_config.eagle_aux_hidden_state_layer_ids"),
        unread_ids=layer_ids((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"),
                             "eagle_config.eagle_aux_hidden_state_layer_ids"),
        declared_norm_before_residual=declared_nbr,
        norm_before_residual=True if declared_nbr is None else bool(declared_nbr),  # vLLM's default here
        verifier=(config.get("speculators_config") or {}).get("verifier") or {})


def _flat_sections(config: dict) -> _Sections:
    eagle_config = config.get("eagle_config") or {}
    declared_nbr = config.get("norm_before_residual")
    return _Sections(
        format="flat", layer=config, eagle_config=eagle_config,
        top_level_ids=layer_ids(config.get("eagle_aux_hidden_state_layer_ids")),
        eagle_config_ids=layer_ids(eagle_config.get("eagle_aux_hidden_state_layer_ids"),
                                   "eagle_config.eagle_aux_hidden_state_layer_ids"),
        unread_ids=None,
        declared_norm_before_residual=declared_nbr, norm_before_residual=bool(declared_nbr), verifier={})


def draft_spec(config: dict) -> DraftSpec:
    """Any draft config (speculators or flat) as the engines read it."""
    where = _speculators_sections(config) if "speculators_model_type" in config else _flat_sections(config)
    layer, eagle_config = where.layer, where.eagle_config
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in layer]
    if missing:
        raise DraftConfigError(f"the draft layer config lacks {', '.join(missing)}")
    heads = int(layer["num_attention_heads"])
    hidden = int(layer["hidden_size"])
    return DraftSpec(
        format=where.format,
        model_type=str(layer.get("model_type", "llama")),
        architectures=list(config.get("architectures") or []),
        hidden_size=hidden,
        num_layers=int(layer.get("num_hidden_layers", 1)),
        num_heads=heads,
        num_kv_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=int(layer["intermediate_size"]),
        vocab_size=int(layer["vocab_size"]),
        declared_draft_vocab_size=config.get("draft_vocab_size"),
        declared_target_hidden_size=config.get("target_hidden_size"),
        declared_norm_before_residual=where.declared_norm_before_residual,
        norm_before_residual=where.norm_before_residual,
        norm_before_fc=bool(eagle_config.get("norm_before_fc", config.get("norm_before_fc", False))),
        fc_norm=bool(config.get("fc_norm", False)),
        norm_output=bool(config.get("norm_output", False)),
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)),
        tie_word_embeddings=bool(layer.get("tie_word_embeddings", False)),
        use_aux_hidden_state=bool(eagle_config.get("use_aux_hidden_state", True)),
        embed_requires_grad=config.get("embed_requires_grad"),
        top_level_ids=where.top_level_ids,
        eagle_config_ids=where.eagle_config_ids,
        unread_ids=where.unread_ids,
        num_aux_hidden_states=layer.get("num_aux_hidden_states"),
        verifier_architectures=list(where.verifier.get("architectures") or []),
        verifier_name=where.verifier.get("name_or_path"),
        layer_config=dict(layer),
        dtype=config.get("dtype") or config.get("torch_dtype"),
        mla=_mla_shape(layer),
    )


@dataclass
class TargetSpec:
    folder: Path
    architectures: list[str]
    model_type: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_mtp_layers: int
    layers_in_weights: int | None  # from the weight names; None when the folder has no safetensors
    num_weight_tensors: int

    @property
    def default_aux_ids(self) -> list[int]:
        return default_aux_ids(self.num_layers)


def target_spec(checkpoint: Checkpoint) -> TargetSpec:
    config = checkpoint.config
    text = config.get("text_config") or config  # KimiK25: the DeepSeek-V3 language model's config
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if k not in text]
    if missing:
        raise DraftConfigError(f"the target's config.json lacks {', '.join(missing)} "
                               "(also looked in text_config)")
    layers = {int(m.group(1)) for name in checkpoint.tensors if (m := LAYER_NAME.search(name))}
    return TargetSpec(
        folder=checkpoint.folder,
        architectures=list(config.get("architectures") or []),
        model_type=str(config.get("model_type", "")),
        hidden_size=int(text["hidden_size"]),
        num_layers=int(text["num_hidden_layers"]),
        vocab_size=int(text["vocab_size"]),
        num_mtp_layers=int(text.get("num_nextn_predict_layers") or 0),
        layers_in_weights=max(layers) + 1 if layers else None,
        num_weight_tensors=len(checkpoint.tensors),
    )
