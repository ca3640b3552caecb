"""The sizing arithmetic against values worked out by hand from the published Kimi-K2.5 shape."""


from __future__ import annotations

import pytest

from kimi_eagle.cli import main
from kimi_eagle.fixtures.export import speculators_config
from kimi_eagle.serve.sizing import (
    GIB,
    DraftShape,
    SizingError,
    TargetShape,
    kimi_k25_shapes,
    size_deployment,
)

# Kimi-K2.5: hidden 7168, 61 layers (1 dense + 60 MoE), 64 heads, vocab 163840, MLA q_lora 1536, kv_lora 512,
# qk_nope 128, qk_rope 64, v_head 128, 384 routed experts of 2048 + 1 shared, dense MLP 18432.
ROUTED_PARAMS = 60 * 384 * 3 * 7168 * 2048                      # 1,014,686,023,680


ROUTED_BYTES = ROUTED_PARAMS // 2 + ROUTED_PARAMS // 32 * 2        # packed INT4 + a bf16 scale per 32


REPLICATED_PARAMS = (61 * (7168 * (1536 + 512 + 64)                # fused q_a + kv_a projection
                           + 2 * 7168 + 1536 + 512)                # layer norms, q_a and kv_a norms
                     + 60 * (384 * 7168 + 384)                     # router weight + correction bias
                     + 7168)                                       # final norm


SHARDED_PARAMS = (61 * (1536 * 64 * 192 + 512 * 64 * 256 + 64 * 128 * 7168)  # q_b, kv_b, o_proj
                  + 3 * 7168 * 18432                                # the dense layer's MLP
                  + 60 * 3 * 7168 * 2048                            # shared experts
                  + 2 * 163840 * 7168)                              # embedding + lm_head


MLA_KV_BYTES_PER_TOKEN = (512 + 64) * 61 * 2                      # 70,272 bytes, bf16


# The lightseekorg-family draft: hidden 7168, 64 heads and 64 KV heads of 128, MLP 12288, vocab 163840 (no pruning).
DRAFT_REPLICATED = 3 * 7168 * 7168 + 4 * 7168                    # fc over three aux states + 4 norms


DRAFT_SHARDED = (2 * 7168 * (8192 + 2 * 8192) + 8192 * 7168       # q/k/v read 2H, o_proj
                 + 3 * 7168 * 12288                               # MLP
                 + 2 * 163840 * 7168)                             # own embedding + lm_head


def test_kimi_k25_parameter_counts_match_the_hand_computation() -> None:
    target, draft = kimi_k25_shapes()
    assert target.routed_expert_params() == ROUTED_PARAMS == 1_014_686_023_680
    assert target.routed_expert_bytes() == ROUTED_BYTES == 570_760_888_320
    assert target.replicated_params() == REPLICATED_PARAMS == 1_089_648_128
    assert target.sharded_bf16_params() == SHARDED_PARAMS == 10_632_560_640
    assert draft.replicated_params() == DRAFT_REPLICATED
    assert draft.sharded_params() == DRAFT_SHARDED == 3_024_093_184


def test_whole_checkpoint_size_is_the_published_one() -> None:
    """At TP 1 the weights are the whole checkpoint: the notes give "about 554 GB" (it matches in GiB)."""
    target, _ = kimi_k25_shapes()
    whole = target.weight_bytes_per_gpu(1)
    assert whole == REPLICATED_PARAMS * 2 + SHARDED_PARAMS * 2 + ROUTED_BYTES
    assert 553 < whole / GIB < 554


def test_per_gpu_sizes_at_tp8_128k_context_8_sequences() -> None:
    target, draft = kimi_k25_shapes()
    sizing = size_deployment(target, draft, context_tokens=131072, concurrency=8, tensor_parallel_size=8,
                             gpu_memory_gib=139)
    assert sizing.target_weights_bytes == REPLICATED_PARAMS * 2 + (SHARDED_PARAMS * 2 + ROUTED_BYTES) // 8
    assert sizing.draft_weights_bytes == DRAFT_REPLICATED * 2 + DRAFT_SHARDED * 2 // 8
    assert sizing.target_kv_bytes_per_token == MLA_KV_BYTES_PER_TOKEN == 70_272
    assert sizing.draft_kv_bytes_per_token == 2 * (64 // 8) * 128 * 2 == 4096
    assert sizing.kv_cache_bytes == (70_272 + 4096) * 131072 * 8 == 77_980_499_968
    assert sizing.total_bytes == sizing.target_weights_bytes + sizing.draft_weights_bytes + sizing.kv_cache_bytes
    budget = int(139 * GIB * 0.92)
    assert sizing.headroom_bytes == budget - sizing.total_bytes < 0  # eight 128K sequences do not fit at TP 8
    per_sequence = (70_272 + 4096) * 131072
    expected = (budget - sizing.target_weights_bytes - sizing.draft_weights_bytes) // per_sequence
    assert sizing.max_concurrency_at_context == expected == 6


def test_mla_cache_is_not_split_by_tensor_parallelism_but_weights_are() -> None:
    target, draft = kimi_k25_shapes()
    tp8 = size_deployment(target, draft, context_tokens=4096, concurrency=1, tensor_parallel_size=8)
    tp16 = size_deployment(target, draft, context_tokens=4096, concurrency=1, tensor_parallel_size=16)
    assert tp8.target_kv_bytes_per_token == tp16.target_kv_bytes_per_token
    assert tp16.draft_kv_bytes_per_token * 2 == tp8.draft_kv_bytes_per_token
    assert tp16.target_weights_bytes < tp8.target_weights_bytes
    assert tp8.headroom_bytes is None and tp8.max_concurrency_at_context is None  # no GPU size given


def test_fp8_kv_cache_halves_the_cache() -> None:
    target, draft = kimi_k25_shapes()
    bf16 = size_deployment(target, draft, context_tokens=8192, concurrency=4, tensor_parallel_size=8)
    fp8 = size_deployment(target, draft, context_tokens=8192, concurrency=4, tensor_parallel_size=8, kv_cache_bytes=1)
    assert fp8.kv_cache_bytes * 2 == bf16.kv_cache_bytes


def test_small_shape_by_hand() -> None:
    """A shape small enough to add up on paper, INT4 off."""
    target = TargetShape(hidden_size=8, num_layers=2, num_heads=2, vocab_size=10, dense_intermediate_size=16,
                         moe_intermediate_size=4, num_routed_experts=4, num_shared_experts=1, num_dense_layers=1,
                         q_lora_rank=4, kv_lora_rank=6, qk_nope_head_dim=2, qk_rope_head_dim=2, v_head_dim=3,
                         routed_experts_int4=False)
    # replicated: 2 layers x (8*(4+6+2) + 2*8 + 4 + 6) + 1 MoE layer x (4*8 + 4) + 8 = 2*122 + 36 + 8 = 288
    assert target.replicated_params() == 288
    # sharded: 2 x (4*2*4 + 6*2*5 + 2*3*8) + 3*8*16 + 1 x 3*8*4 + 2*10*8 = 2*140 + 384 + 96 + 160 = 920
    assert target.sharded_bf16_params() == 920
    assert target.routed_expert_bytes() == 4 * 3 * 8 * 4 * 2  # bf16 experts: 768 bytes
    assert target.weight_bytes_per_gpu(2) == 288 * 2 + (920 * 2 + 768) // 2
    assert target.kv_bytes_per_token() == (6 + 2) * 2 * 2


def test_draft_shape_from_a_speculators_config() -> None:
    draft = DraftShape.from_config(speculators_config("tiny"), target_hidden_size=256)
    assert (draft.hidden_size, draft.draft_vocab_size, draft.vocab_size) == (256, 1024, 4096)
    assert (draft.num_heads, draft.num_kv_heads, draft.head_dim, draft.num_aux_hidden_states) == (4, 2, 64, 3)
    assert draft.kv_bytes_per_token_per_gpu(1) == 2 * 2 * 64 * 2


def test_bad_deployments_are_refused_with_the_reason() -> None:
    target, draft = kimi_k25_shapes()
    with pytest.raises(SizingError, match="must divide the 64 heads"):
        size_deployment(target, draft, context_tokens=1024, concurrency=1, tensor_parallel_size=6)
    with pytest.raises(SizingError, match="at least 1"):
        size_deployment(target, draft, context_tokens=0, concurrency=1, tensor_parallel_size=8)
    with pytest.raises(SizingError, match="kv_lora_rank"):
        TargetShape.from_text_config({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2,
                                      "vocab_size": 10, "intermediate_size": 16, "moe_intermediate_size": 4,
                                      "n_routed_experts": 4, "q_lora_rank": 4})


def test_sizing_command_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sizing", "--context", "131072", "--concurrency", "1", "8", "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "target weights 71.0 GiB" in out and "70272 B (target, MLA) + 4096 B (draft)" in out
    assert "| 131,072 | 8 | 72.6 |" in out
    assert out.count("| 131,072 |") == 2


def test_sizing_command_rejects_a_bad_tp(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sizing", "--tp", "5"]) == 2
    assert "must divide the 64 heads" in capsys.readouterr().err

