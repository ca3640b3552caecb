"""GPU memory for serving Kimi-K2.5 + an EAGLE-3 draft on vLLM: weights, KV cache and draft, per GPU.

The arithmetic follows how vLLM 0.32 lays the model out (read in its source, `model_executor/models/deepseek_v2.py`
and `llama_eagle3.py`), not a generic "parameters x bytes":

- Target weights. Routed experts are INT4 (compressed-tensors `pack-quantized`, symmetric, group 32): half a byte per
  weight plus one bf16 scale per 32 weights. Everything else is bf16 (attention, shared expert, the dense MLP of the
  first layers, router, embeddings, lm_head). Under tensor parallelism (TP) the experts, `q_b/kv_b/o_proj`, the
  MLPs, the embedding and lm_head are split across GPUs; `fused_qkv_a_proj` (q_a + kv_a), the router and the norms
  are replicated on every GPU.
- Target KV cache (MLA). One latent of `kv_lora_rank + qk_rope_head_dim` values per token per layer, and *not* split
  by TP: every GPU keeps the whole latent of every sequence it serves (vLLM's MLA cache has one KV head).
- Draft (one Llama decoder layer). Its attention, MLP, embedding and lm_head are split by TP; `fc` is replicated.
  Its KV cache is ordinary attention (K and V per KV head), split by TP over the KV heads.

Not modelled: activations, CUDA graphs, the sampler's buffers, NCCL, the vision tower (its size is not in our notes;
with `--mm-encoder-tp-mode data` it is replicated on every GPU). vLLM reserves `gpu_memory_utilization` of each GPU
(0.92 by default) and fills what the weights and activations leave with KV cache; the headroom below is only the
difference between that budget and what is modelled here.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, computed_field

GIB = 2**30
BF16_BYTES = 2
INT4_GROUP_SIZE = 32

# --- The published shapes -------------------------------------------------------------------------------------------
# `text_config` of moonshotai/Kimi-K2.5 (its public config.json on the model hub). Only the fields the
# sizing and the flag validation read; vLLM fills the rest with DeepseekV3 defaults.
KIMI_K25_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                        "mscale": 1.0, "mscale_all_dim": 1.0},
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "pad_token_id": 163839,
    "dtype": "bfloat16",
    # INT4 routed experts, group 32; attention, shared experts, dense MLP and lm_head unquantised (the notes).
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": INT4_GROUP_SIZE, "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None, "output_activations": None,
        }},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"],
    },
}
KIMI_K25_MEDIA_PLACEHOLDER_ID = 163605

# The draft shape of the lightseekorg/kimi-k2.5-eagle3 family: TorchSpec's `configs/draft_models/kimi_k25_eagle3.json`
# (torchspec-project/TorchSpec), the training config of that draft; the published checkpoint's own config.json was not
# available here. No `draft_vocab_size`: SGLang and vLLM then use the full vocabulary.
KIMI_K25_EAGLE3_DRAFT_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 7168,
    "intermediate_size": 12288,
    "num_hidden_layers": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "torch_dtype": "bfloat16",
}


class SizingError(ValueError):
    """A shape or deployment that cannot be sized; the message names the field."""


def _need(config: dict[str, Any], key: str, where: str) -> Any:
    if config.get(key) is None:
        raise SizingError(f"{where} has no {key!r}: give a config.json with the model's full shape")
    return config[key]


class TargetShape(BaseModel):
    """What the sizing needs of a DeepseekV3-style MLA + MoE target (Kimi-K2.5's `text_config`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hidden_size: int = Field(gt=0, description="Residual width.")
    num_layers: int = Field(gt=0, description="Decoder layers.")
    num_heads: int = Field(gt=0, description="Attention heads.")
    vocab_size: int = Field(gt=0, description="Embedding and lm_head rows.")
    dense_intermediate_size: int = Field(gt=0, description="MLP width of the dense (non-MoE) layers.")
    moe_intermediate_size: int = Field(gt=0, description="Width of one expert.")
    num_routed_experts: int = Field(ge=0, description="Routed experts per MoE layer.")
    num_shared_experts: int = Field(ge=0, description="Shared experts per MoE layer.")
    num_dense_layers: int = Field(ge=0, description="Leading layers with a dense MLP (`first_k_dense_replace`).")
    q_lora_rank: int = Field(gt=0, description="MLA query compression rank.")
    kv_lora_rank: int = Field(gt=0, description="MLA key/value latent width (cached).")
    qk_nope_head_dim: int = Field(gt=0, description="Per-head query/key width without RoPE.")
    qk_rope_head_dim: int = Field(gt=0, description="Per-head RoPE width (its key part is cached).")
    v_head_dim: int = Field(gt=0, description="Per-head value width.")
    routed_experts_int4: bool = Field(True, description="Routed experts stored INT4 group-32 (else bf16).")

    @classmethod
    def from_text_config(cls, text: dict[str, Any], *, routed_experts_int4: bool | None = None) -> TargetShape:
        where = "the target's text_config"
        quant = text.get("quantization_config") or {}
        if routed_experts_int4 is None:
            groups = quant.get("config_groups", {}).values()
            routed_experts_int4 = any(g.get("weights", {}).get("num_bits") == 4 for g in groups)
        return cls(
            hidden_size=_need(text, "hidden_size", where), num_layers=_need(text, "num_hidden_layers", where),
            num_heads=_need(text, "num_attention_heads", where), vocab_size=_need(text, "vocab_size", where),
            dense_intermediate_size=_need(text, "intermediate_size", where),
            moe_intermediate_size=_need(text, "moe_intermediate_size", where),
            num_routed_experts=_need(text, "n_routed_experts", where),
            num_shared_experts=text.get("n_shared_experts") or 0,
            num_dense_layers=text.get("first_k_dense_replace") or 0,
            q_lora_rank=_need(text, "q_lora_rank", where), kv_lora_rank=_need(text, "kv_lora_rank", where),
            qk_nope_head_dim=_need(text, "qk_nope_head_dim", where),
            qk_rope_head_dim=_need(text, "qk_rope_head_dim", where),
            v_head_dim=_need(text, "v_head_dim", where), routed_experts_int4=routed_experts_int4,
        )

    # Parameter counts, split into what TP divides and what every GPU holds whole.
    def replicated_params(self) -> int:
        h = self.hidden_size
        qkv_a = h * (self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim)  # fused_qkv_a_proj, disable_tp
        norms = 2 * h + self.q_lora_rank + self.kv_lora_rank  # input/post-attention norms, q_a/kv_a norms
        router = self.num_routed_experts * h + self.num_routed_experts  # gate + e_score_correction_bias
        per_moe_layer = router if self.num_routed_experts else 0
        return self.num_layers * (qkv_a + norms) + self.num_moe_layers * per_moe_layer + h  # + final norm

    def sharded_bf16_params(self) -> int:
        h, heads = self.hidden_size, self.num_heads
        q_b = self.q_lora_rank * heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        kv_b = self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        o = heads * self.v_head_dim * h
        dense_mlp = 3 * h * self.dense_intermediate_size
        shared = 3 * h * self.moe_intermediate_size * self.num_shared_experts
        embed_and_head = 2 * self.vocab_size * h
        return (self.num_layers * (q_b + kv_b + o) + self.num_dense_layers * dense_mlp
                + self.num_moe_layers * shared + embed_and_head)

    def routed_expert_params(self) -> int:
        return self.num_moe_layers * self.num_routed_experts * 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    def routed_expert_bytes(self) -> int:
        params = self.routed_expert_params()
        if not self.routed_experts_int4:
            return params * BF16_BYTES
        # Packed INT4 (8 per int32) + one bf16 scale per group; symmetric, so no zero points.
        return params // 2 + (params // INT4_GROUP_SIZE) * BF16_BYTES

    def weight_bytes_per_gpu(self, tensor_parallel_size: int) -> int:
        sharded = self.sharded_bf16_params() * BF16_BYTES + self.routed_expert_bytes()
        return self.replicated_params() * BF16_BYTES + math.ceil(sharded / tensor_parallel_size)

    def kv_bytes_per_token(self, kv_cache_bytes: int = BF16_BYTES) -> int:
        """MLA: one latent of kv_lora_rank + qk_rope_head_dim per layer; the same on every TP rank."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.num_layers * kv_cache_bytes


class DraftShape(BaseModel):
    """What the sizing needs of an EAGLE-3 draft (one or more Llama or MLA decoder layers + fc + lm_head)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    hidden_size: int = Field(gt=0, description="Draft residual width.")
    target_hidden_size: int = Field(gt=0, description="Width of one aux hidden state of the target.")
    num_aux_hidden_states: int = Field(3, gt=0, description="Aux states concatenated into fc (EAGLE-3: 3).")
    num_layers: int = Field(1, gt=0, description="Decoder layers of the draft.")
    num_heads: int = Field(gt=0, description="Attention heads.")
    num_kv_heads: int = Field(gt=0, description="Key/value heads.")
    head_dim: int = Field(gt=0, description="Per-head width.")
    intermediate_size: int = Field(gt=0, description="MLP width.")
    vocab_size: int = Field(gt=0, description="Rows of its embedding (the target's vocabulary).")
    draft_vocab_size: int = Field(gt=0, description="Rows of its lm_head.")
    has_own_embedding: bool = Field(True, description="False when vLLM shares the target's embedding.")
    q_lora_rank: int | None = Field(None, description="MLA layer: query down-projection rank.")
    kv_lora_rank: int | None = Field(None, description="MLA layer: latent KV width (None: a GQA layer).")
    qk_rope_head_dim: int | None = Field(None, description="MLA layer: rotary part of each query/key head.")
    qk_nope_head_dim: int | None = Field(None, description="MLA layer: non-rotary part of each query/key head.")
    v_head_dim: int | None = Field(None, description="MLA layer: per-head value width.")

    @classmethod
    def from_config(cls, config: dict[str, Any], *, target_hidden_size: int | None = None,
                    has_own_embedding: bool = True) -> DraftShape:
        """Any layout the draft reader knows (speculators, SpecForge flat), read by it."""
        from kimi_eagle.checks.layout import DraftConfigError, draft_spec

        try:
            spec = draft_spec(config)
        except DraftConfigError as exc:
            raise SizingError(f"the draft config: {exc}") from None
        return cls(
            hidden_size=spec.hidden_size,
            target_hidden_size=spec.declared_target_hidden_size or target_hidden_size or spec.hidden_size,
            num_aux_hidden_states=spec.vllm_fc_count, num_layers=spec.num_layers, num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, intermediate_size=spec.intermediate_size,
            vocab_size=spec.vocab_size, draft_vocab_size=spec.draft_vocab_size, has_own_embedding=has_own_embedding,
            **({"q_lora_rank": spec.mla.q_lora_rank, "kv_lora_rank": spec.mla.kv_lora_rank,
                "qk_rope_head_dim": spec.mla.qk_rope_head_dim, "qk_nope_head_dim": spec.mla.qk_nope_head_dim,
                "v_head_dim": spec.mla.v_head_dim} if spec.mla else {}),
        )

    def _mla_attention_params(self, width: int) -> int:
        heads, qk = self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim
        latent = self.kv_lora_rank + self.qk_rope_head_dim
        q = width * self.q_lora_rank + self.q_lora_rank * heads * qk if self.q_lora_rank else width * heads * qk
        kv = width * latent + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * self.hidden_size

    def replicated_params(self) -> int:
        fc = self.num_aux_hidden_states * self.target_hidden_size * self.hidden_size  # ReplicatedLinear in vLLM
        norms = self.num_layers * 3 * self.hidden_size + self.hidden_size  # hidden/input/post norms + final norm
        return fc + norms

    def sharded_params(self) -> int:
        h, qd, kvd = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.kv_lora_rank:
            first_attn, later_attn = self._mla_attention_params(2 * h), self._mla_attention_params(h)
        else:
            first_attn = 2 * h * (qd + 2 * kvd) + qd * h  # the first layer reads [embedding, hidden]: 2H wide
            later_attn = h * (qd + 2 * kvd) + qd * h
        attn = first_attn + (self.num_layers - 1) * later_attn
        mlp = self.num_layers * 3 * h * self.intermediate_size
        embed = self.vocab_size * h if self.has_own_embedding else 0
        return attn + mlp + embed + self.draft_vocab_size * h

    def weight_bytes_per_gpu(self, tensor_parallel_size: int) -> int:
        return (self.replicated_params() * BF16_BYTES
                + math.ceil(self.sharded_params() * BF16_BYTES / tensor_parallel_size))

    def kv_bytes_per_token_per_gpu(self, tensor_parallel_size: int, kv_cache_bytes: int = BF16_BYTES) -> int:
        """K and V per KV head, KV heads split across TP ranks (at least one per rank); an MLA layer caches its
        latent and rotary key once per token on every rank, as the target's layers do."""
        if self.kv_lora_rank:
            return (self.kv_lora_rank + self.qk_rope_head_dim) * self.num_layers * kv_cache_bytes
        kv_heads_per_gpu = max(1, self.num_kv_heads // tensor_parallel_size)
        return 2 * kv_heads_per_gpu * self.head_dim * self.num_layers * kv_cache_bytes


class Sizing(BaseModel):
    """Memory per GPU for one deployment; every size in bytes unless its name says otherwise."""

    model_config = ConfigDict(extra="forbid")
    tensor_parallel_size: int
    context_tokens: int = Field(description="Tokens per sequence (prompt + output).")
    concurrency: int = Field(description="Sequences resident in the KV cache at once.")
    kv_cache_bytes_per_value: int
    target_weights_bytes: int
    draft_weights_bytes: int
    target_kv_bytes_per_token: int
    draft_kv_bytes_per_token: int
    gpu_memory_bytes: int | None = Field(None, description="Memory of one GPU; None when not given.")
    gpu_memory_utilization: float = Field(0.92, description="vLLM's share of each GPU (its default 0.92).")

    @computed_field
    @property
    def kv_cache_bytes(self) -> int:
        per_token = self.target_kv_bytes_per_token + self.draft_kv_bytes_per_token
        return per_token * self.context_tokens * self.concurrency

    @computed_field
    @property
    def total_bytes(self) -> int:
        return self.target_weights_bytes + self.draft_weights_bytes + self.kv_cache_bytes

    @computed_field
    @property
    def headroom_bytes(self) -> int | None:
        """vLLM's budget minus what is modelled; activations and graphs must fit in it. None without a GPU size."""
        if self.gpu_memory_bytes is None:
            return None
        return int(self.gpu_memory_bytes * self.gpu_memory_utilization) - self.total_bytes

    @computed_field
    @property
    def max_concurrency_at_context(self) -> int | None:
        """Sequences of `context_tokens` whose KV cache fits the budget left after the weights."""
        if self.gpu_memory_bytes is None:
            return None
        left = int(self.gpu_memory_bytes * self.gpu_memory_utilization) - self.target_weights_bytes \
            - self.draft_weights_bytes
        per_sequence = (self.target_kv_bytes_per_token + self.draft_kv_bytes_per_token) * self.context_tokens
        return max(0, left // per_sequence)


def size_deployment(target: TargetShape, draft: DraftShape | None, *, context_tokens: int, concurrency: int,
                    tensor_parallel_size: int, kv_cache_bytes: int = BF16_BYTES, gpu_memory_gib: float | None = None,
                    gpu_memory_utilization: float = 0.92) -> Sizing:
    """Per-GPU memory of target + draft weights and of the KV cache for `concurrency` sequences of `context_tokens`."""
    if tensor_parallel_size < 1 or target.num_heads % tensor_parallel_size:
        raise SizingError(f"tensor parallel size {tensor_parallel_size} must divide the {target.num_heads} heads")
    if context_tokens < 1 or concurrency < 1:
        raise SizingError("context tokens and concurrency must be at least 1")
    return Sizing(
        tensor_parallel_size=tensor_parallel_size, context_tokens=context_tokens, concurrency=concurrency,
        kv_cache_bytes_per_value=kv_cache_bytes,
        target_weights_bytes=target.weight_bytes_per_gpu(tensor_parallel_size),
        draft_weights_bytes=draft.weight_bytes_per_gpu(tensor_parallel_size) if draft else 0,
        target_kv_bytes_per_token=target.kv_bytes_per_token(kv_cache_bytes),
        draft_kv_bytes_per_token=draft.kv_bytes_per_token_per_gpu(tensor_parallel_size, kv_cache_bytes) if draft else 0,
        gpu_memory_bytes=int(gpu_memory_gib * GIB) if gpu_memory_gib else None,
        gpu_memory_utilization=gpu_memory_utilization,
    )


def kimi_k25_shapes() -> tuple[TargetShape, DraftShape]:
    """The published Kimi-K2.5 target and the lightseekorg-family EAGLE-3 draft (see the constants above)."""
    target = TargetShape.from_text_config(KIMI_K25_TEXT_CONFIG)
    return target, DraftShape.from_config(KIMI_K25_EAGLE3_DRAFT_CONFIG, target_hidden_size=target.hidden_size)
