"""Kimi-K2.5 at its real scale, for the doctor: the published INT4 checkpoint's layout (every tensor's name, dtype and
shape over its 64 shards, with the index), and real-width EAGLE-3 drafts for it with their values on disk.

What is reconstructed, and from what (no hub is reachable here):

- config.json: `KimiK25ForConditionalGeneration`, the DeepSeek-V3 language model under `text_config` (61 layers, the
  first dense, 384 routed experts + 1 shared, MLA attention with q_lora_rank 1536 / kv_lora_rank 512, vocabulary
  163840) and the MoonViT vision tower under `vision_config` (27 layers of width 1152), as the model card and
  transformers' `Kimi_K25Config` describe them; the quantization_config (compressed-tensors, `pack-quantized`, INT4,
  group size 32, symmetric, targets Linear) sits in `text_config`, its `ignore` list naming every module that is not a
  routed expert.
- tensor names: vLLM 0.32's loaders: `kimi_k25.py` (the `language_model.` prefix; its `hf_to_vllm_mapper`),
  `deepseek_v2.py` (q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj; a dense
  MLP in layer 0; the router `mlp.gate` with its `e_score_correction_bias`, `shared_experts` and `experts.N.*` in
  layers 1-60) and `kimi_k25_vit.py` (`vision_tower.patch_embed`, `vision_tower.encoder.blocks.N.{norm0, norm1, wqkv,
  wo, mlp.fc0, mlp.fc1}`, `final_layernorm`; `mm_projector.pre_norm`, `proj.0`, `proj.2`), which transformers 5.19's
  conversion mapping for `kimi_k25` confirms as the original checkpoint's keys.
- dtypes and shapes of the quantized experts: compressed-tensors' pack-quantized format as vLLM's
  `compressed_tensors_moe_wna16.py` reads it: `weight_packed` I32 [out, in/8] (eight 4-bit values per int32),
  `weight_scale` BF16 [out, in/32], `weight_shape` I64 [2] (the compressor stores `torch.tensor(shape)`); everything
  else BF16 but the router's `e_score_correction_bias` (F32).
- shards: 64 files `model-000NN-of-000064.safetensors`, each layer whole in one file (layer i in file i+1: the
  dense layer 0 in the first, 1.0 GB, layer 60 in the 61st, 9.8 GB each), the embeddings, final norm and head in the
  62nd, the vision tower in the 64th, as copies of the release show; the projector in the 63rd is a guess.
- what is known of the release and holds here: 595 GB in all; 208 550 tensors, which is the 139 613 of AMD's MXFP4
  requantisation of it (its index, quoted in public tests) less the 183 weight scales it adds for the shared experts
  and the dense MLP, plus the 69 120 `weight_shape` tensors of INT4 experts (60 layers x 384 experts x 3).

Data: none. Each shard is its header alone, so anything that reads a value of the target fails: doctor reads a
target's headers only. The drafts carry values (random, written in chunks), since doctor reads every value of a draft.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from kimi_eagle.checks.checkpoint import DTYPE_BYTES, INDEX_NAME, TensorInfo, iter_chunks, load_torch, open_checkpoint
from tests.helpers.broken_drafts import FAULTS, write_header_only

SHARDS = 64
HIDDEN = 7168
VOCAB = 163840
DRAFT_VOCAB = 32000
LAYERS = 61
EXPERTS = 384
MOE_INTERMEDIATE = 2048
INTERMEDIATE = 18432
AUX_IDS = [2, 30, 58]  # speculators' default for 61 layers: (2, L//2, L-3)
VISION = {"hidden": 1152, "layers": 27, "intermediate": 4304, "patch": 14, "pos_emb": 64}

QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "config_groups": {"group_0": {
        "targets": ["Linear"], "input_activations": None, "output_activations": None,
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {}}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*vision_tower.*", "re:.*mm_projector.*"],
}

TEXT_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "dtype": "bfloat16",
    "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE, "moe_intermediate_size": MOE_INTERMEDIATE,
    "num_hidden_layers": LAYERS, "num_nextn_predict_layers": 0, "vocab_size": VOCAB,
    "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "n_routed_experts": EXPERTS, "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    "norm_topk_prob": True, "routed_scaling_factor": 2.827, "hidden_act": "silu", "rms_norm_eps": 1e-5,
    "max_position_embeddings": 262144, "rope_theta": 50000.0,
    "rope_scaling": {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 163584, "eos_token_id": 163585,
    "pad_token_id": 163839, "quantization_config": QUANTIZATION_CONFIG,
}

CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "dtype": "bfloat16",
    "bos_token_id": 163584, "eos_token_id": 163585, "pad_token_id": 163839, "media_placeholder_token_id": 163605,
    "tie_word_embeddings": False, "use_unified_vision_chunk": True,
    "video_placeholder": "<|kimi_k25_video_placeholder|>",
    "text_config": TEXT_CONFIG,
    "vision_config": {
        "patch_size": VISION["patch"], "init_pos_emb_height": VISION["pos_emb"],
        "init_pos_emb_width": VISION["pos_emb"], "init_pos_emb_time": 4, "pos_emb_type": "divided_fixed",
        "vt_num_attention_heads": 16, "vt_num_hidden_layers": VISION["layers"], "vt_hidden_size": VISION["hidden"],
        "vt_intermediate_size": VISION["intermediate"], "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal", "mm_projector_type": "patchmerger", "mm_hidden_size": VISION["hidden"],
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": HIDDEN},
}

Layout = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (dtype, shape)


def shard_name(number: int) -> str:
    return f"model-{number:05d}-of-{SHARDS:06d}.safetensors"


def _layer(i: int) -> Layout:
    p, h = f"language_model.model.layers.{i}.", HIDDEN
    out: Layout = {p + "input_layernorm.weight": ("BF16", (h,)), p + "post_attention_layernorm.weight": ("BF16", (h,))}
    attn = {"q_a_proj.weight": (1536, h), "q_a_layernorm.weight": (1536,), "q_b_proj.weight": (64 * 192, 1536),
            "kv_a_proj_with_mqa.weight": (512 + 64, h), "kv_a_layernorm.weight": (512,),
            "kv_b_proj.weight": (64 * (128 + 128), 512), "o_proj.weight": (h, 64 * 128)}
    out.update({p + "self_attn." + n: ("BF16", shape) for n, shape in attn.items()})
    if i == 0:  # first_k_dense_replace = 1
        out.update({p + "mlp.gate_proj.weight": ("BF16", (INTERMEDIATE, h)),
                    p + "mlp.up_proj.weight": ("BF16", (INTERMEDIATE, h)),
                    p + "mlp.down_proj.weight": ("BF16", (h, INTERMEDIATE))})
        return out
    m = MOE_INTERMEDIATE
    out.update({p + "mlp.gate.weight": ("BF16", (EXPERTS, h)),
                p + "mlp.gate.e_score_correction_bias": ("F32", (EXPERTS,)),
                p + "mlp.shared_experts.gate_proj.weight": ("BF16", (m, h)),
                p + "mlp.shared_experts.up_proj.weight": ("BF16", (m, h)),
                p + "mlp.shared_experts.down_proj.weight": ("BF16", (h, m))})
    for e in range(EXPERTS):
        for proj, (rows, cols) in (("gate_proj", (m, h)), ("up_proj", (m, h)), ("down_proj", (h, m))):
            q = f"{p}mlp.experts.{e}.{proj}."
            out[q + "weight_packed"] = ("I32", (rows, cols // 8))
            out[q + "weight_scale"] = ("BF16", (rows, cols // 32))
            out[q + "weight_shape"] = ("I64", (2,))
    return out


def _vision() -> Layout:
    v, p = VISION["hidden"], "vision_tower."
    out: Layout = {p + "patch_embed.proj.weight": ("BF16", (v, 3, VISION["patch"], VISION["patch"])),
                   p + "patch_embed.proj.bias": ("BF16", (v,)),
                   p + "patch_embed.pos_emb.weight": ("BF16", (VISION["pos_emb"], VISION["pos_emb"], v))}
    for i in range(VISION["layers"]):
        b = f"{p}encoder.blocks.{i}."
        shapes = {"norm0": (v,), "norm1": (v,), "wqkv": (3 * v, v), "wo": (v, v),
                  "mlp.fc0": (VISION["intermediate"], v), "mlp.fc1": (v, VISION["intermediate"])}
        for name, shape in shapes.items():
            out[b + name + ".weight"] = ("BF16", shape)
            out[b + name + ".bias"] = ("BF16", (shape[0],))
    out[p + "encoder.final_layernorm.weight"] = ("BF16", (v,))
    out[p + "encoder.final_layernorm.bias"] = ("BF16", (v,))
    return out


def _projector() -> Layout:
    v, merged = VISION["hidden"], VISION["hidden"] * 4  # 2 x 2 patches merged
    return {"mm_projector.pre_norm.weight": ("BF16", (v,)), "mm_projector.pre_norm.bias": ("BF16", (v,)),
            "mm_projector.proj.0.weight": ("BF16", (merged, merged)), "mm_projector.proj.0.bias": ("BF16", (merged,)),
            "mm_projector.proj.2.weight": ("BF16", (HIDDEN, merged)), "mm_projector.proj.2.bias": ("BF16", (HIDDEN,))}


def target_layout() -> dict[str, Layout]:
    """Shard file name -> the tensors it holds, for all 64 shards."""
    shards = {shard_name(i + 1): _layer(i) for i in range(LAYERS)}
    shards[shard_name(62)] = {"language_model.model.embed_tokens.weight": ("BF16", (VOCAB, HIDDEN)),
                              "language_model.model.norm.weight": ("BF16", (HIDDEN,)),
                              "language_model.lm_head.weight": ("BF16", (VOCAB, HIDDEN))}
    shards[shard_name(63)] = _projector()
    shards[shard_name(64)] = _vision()
    return shards


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    size = DTYPE_BYTES[dtype]
    for dim in shape:
        size *= dim
    return size


def write_target(out: Path) -> Path:
    """The reconstructed Kimi-K2.5 folder: config.json, the index (with the real total size) and 64 header-only
    shards. About 30 MB of headers and index."""
    out.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for file, tensors in target_layout().items():
        write_header_only(out / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(nbytes(*spec) for spec in tensors.values())
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return out


# --- writing safetensors files with data, in chunks -------------------------------------------------------------------
CHUNK_ELEMENTS = 1 << 24
DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64", torch.bool: "BOOL"}


@dataclass(frozen=True)
class Fill:
    """Values made chunk by chunk (a row block at a time): `make(rows, cols, first_row)` returns one block."""

    dtype: str
    shape: tuple[int, int]
    make: Callable[[int, int, int], torch.Tensor]

    def chunks(self) -> Iterator[torch.Tensor]:
        rows, cols = self.shape
        step = max(1, CHUNK_ELEMENTS // cols)
        for first in range(0, rows, step):
            yield self.make(min(step, rows - first), cols, first)


Source = torch.Tensor | TensorInfo | Fill  # in memory, bytes of another file, or made in chunks


def _spec(source: Source) -> tuple[str, tuple[int, ...]]:
    if isinstance(source, torch.Tensor):
        return DTYPE_NAMES[source.dtype], tuple(source.shape)
    return source.dtype, tuple(source.shape)


def _bytes(source: Source) -> Iterator[memoryview]:
    if isinstance(source, TensorInfo):
        yield from (piece.data for piece in iter_chunks(source))
        return
    for chunk in [source] if isinstance(source, torch.Tensor) else source.chunks():
        yield chunk.contiguous().reshape(-1).view(torch.uint8).numpy().data


def write_safetensors(path: Path, tensors: dict[str, Source]) -> None:
    """A safetensors file written one chunk at a time: a 2.3 GB embedding never sits in memory whole."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, source in tensors.items():
        dtype, shape = _spec(source)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes(dtype, shape)]}
        offset += nbytes(dtype, shape)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for source in tensors.values():
            for chunk in _bytes(source):
                f.write(chunk)


def _linear_init(seed: int, trained: bool) -> Callable[[int, int, int], torch.Tensor]:
    """PyTorch's nn.Linear init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)): what a draft matrix holds before training.
    `trained` scales each row by its own factor in [0.25, 1.75]: row norms as uneven as a trained matrix's, which
    the "trained or not" check reads as structure (a random init's rows are all about as long)."""
    def make(rows: int, cols: int, first: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + first)
        bound = cols ** -0.5
        block = torch.empty(rows, cols, dtype=torch.bfloat16).uniform_(-bound, bound, generator=g)
        if trained:
            block *= (0.25 + 1.5 * torch.rand(rows, 1, generator=g)).to(torch.bfloat16)
        return block
    return make


def _embedding(seed: int) -> Callable[[int, int, int], torch.Tensor]:
    """Normal values of a trained embedding's spread; the block repeats (the checks read an embedding's health only,
    not its structure), so 2.3 GB are written at disk speed."""
    block: list[torch.Tensor] = []

    def make(rows: int, cols: int, first: int) -> torch.Tensor:
        if not block or block[0].shape != (rows, cols):
            g = torch.Generator().manual_seed(seed)
            block[:] = [(torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)]
        return block[0]
    return make


def draft_config(aux_ids: list[int] | None = None) -> dict:
    layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
             "intermediate_size": INTERMEDIATE, "num_hidden_layers": 1, "num_attention_heads": 64,
             "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 262144,
             "rms_norm_eps": 1e-5, "rope_theta": 50000.0, "tie_word_embeddings": False}
    return {"architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "draft_vocab_size": DRAFT_VOCAB,
            "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "target_hidden_size": None, "embed_requires_grad": False,
            "eagle_aux_hidden_state_layer_ids": AUX_IDS if aux_ids is None else aux_ids,
            "transformer_layer_config": layer, "dtype": "bfloat16",
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "moonshotai/Kimi-K2.5",
                             "architectures": ["KimiK25ForConditionalGeneration"]}}}


MATRICES = {"fc.weight": (HIDDEN, 3 * HIDDEN),
            "layers.0.self_attn.q_proj.weight": (64 * 128, 2 * HIDDEN),
            "layers.0.self_attn.k_proj.weight": (8 * 128, 2 * HIDDEN),
            "layers.0.self_attn.v_proj.weight": (8 * 128, 2 * HIDDEN),
            "layers.0.self_attn.o_proj.weight": (HIDDEN, 64 * 128),
            "layers.0.mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            "layers.0.mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            "layers.0.mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)}


def write_draft(out: Path, *, trained: bool = True, aux_ids: list[int] | None = None, like: Path | None = None) -> Path:
    """A speculators-format EAGLE-3 draft for Kimi-K2.5 at its real width (hidden 7168, fc 21504 -> 7168, one Llama
    layer of 64 x 128 heads and intermediate 18432, the target's 163840-token embedding, a 32000-token head): 2.1 B
    parameters, 4.3 GB of BF16 with values. `trained=False`: every matrix at nn.Linear's random init (the draft
    speculators starts from); True: rows of uneven norms, as training leaves them. One file per large tensor, with
    an index, so that the broken variants (`build_fault`) share the files they leave alone by hard links; `like`, a
    draft written before, lends its files that do not depend on `trained` (embeddings, head, norms, maps) so too."""
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Source]] = {
        "model-embed_tokens.safetensors": {"embed_tokens.weight": Fill("BF16", (VOCAB, HIDDEN), _embedding(1))},
        "model-lm_head.safetensors": {"lm_head.weight": Fill("BF16", (DRAFT_VOCAB, HIDDEN), _embedding(2))}}
    for seed, (name, shape) in enumerate(MATRICES.items(), start=10):
        files[f"model-{name.removesuffix('.weight').replace('layers.0.', '')}.safetensors"] = {
            name: Fill("BF16", shape, _linear_init(seed, trained))}
    hot = torch.arange(DRAFT_VOCAB) * 5  # every fifth target id
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[hot] = True
    small: dict[str, Source] = {"d2t": hot - torch.arange(DRAFT_VOCAB), "t2d": t2d}
    for n in ("layers.0.hidden_norm", "layers.0.input_layernorm", "layers.0.post_attention_layernorm", "norm"):
        small[f"{n}.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    files["model-small.safetensors"] = small
    weight_map = {}
    for file, tensors in files.items():
        if like is not None and not any(n in MATRICES for n in tensors) and (like / file).is_file():
            os.link(like / file, out / file)
        else:
            write_safetensors(out / file, tensors)
        weight_map.update(dict.fromkeys(tensors, file))
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(draft_config(aux_ids), indent=2))
    return out


# --- the broken drafts of tests/helpers/broken_drafts.py, at real width --------------------------------------------
class LazyTensors(MutableMapping):
    """A draft's tensors as a fault function edits them: each read from disk only when the fault reads it, and moved
    without reading when the fault only renames or drops it."""

    def __init__(self, folder: Path) -> None:
        self.original = open_checkpoint(folder).tensors
        self.entries: dict[str, torch.Tensor | TensorInfo] = dict(self.original)

    def __getitem__(self, name: str) -> torch.Tensor:
        value = self.entries[name]
        if isinstance(value, TensorInfo):
            value = self.entries[name] = load_torch(value)  # the fault may change it in place
        return value

    def __setitem__(self, name: str, value: torch.Tensor | TensorInfo) -> None:
        self.entries[name] = value

    def __delitem__(self, name: str) -> None:
        del self.entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def pop(self, name: str, *default):  # a rename moves the entry; reading it would load gigabytes for nothing
        return self.entries.pop(name, *default)

    def write(self, out: Path, config: dict) -> Path:
        """The edited draft: each file whose tensors are all untouched is a hard link to the original's; everything
        else goes to one new file."""
        out.mkdir(parents=True)
        by_file: dict[Path, list[str]] = {}
        for name, info in self.original.items():
            by_file.setdefault(info.file, []).append(name)
        weight_map, linked = {}, set()
        for file, names in by_file.items():
            if all(self.entries.get(n) is self.original[n] for n in names):
                os.link(file, out / file.name)
                weight_map.update(dict.fromkeys(names, file.name))
                linked.update(names)
        rest = {n: v for n, v in self.entries.items() if n not in linked}
        if rest:
            write_safetensors(out / "model-edited.safetensors", rest)
            weight_map.update(dict.fromkeys(rest, "model-edited.safetensors"))
        (out / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
        (out / "config.json").write_text(json.dumps(config, indent=2))
        return out


def build_fault(name: str, base: Path, out: Path) -> Path:
    """The fault `name` of tests/helpers/broken_drafts.py applied to the real-width draft in `base`."""
    config = json.loads((base / "config.json").read_text())
    tensors = LazyTensors(base)
    FAULTS[name](config, tensors)
    return tensors.write(out / name, config)
