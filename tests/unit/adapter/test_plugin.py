"""The vLLM plugin: registered by entry point, idempotent, and each CPU fix proven against upstream's behaviour on
vLLM's own classes."""


from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.kernel_probe import causal_reference


def test_plugin_is_a_vllm_general_plugin() -> None:
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("kimi_eagle") == "kimi_eagle.adapter.plugin:register"


def test_register_twice_is_harmless() -> None:
    from kimi_eagle.adapter import plugin

    plugin.register()
    plugin.register()
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert 16 in CPUAttentionBackend.get_supported_kernel_block_sizes()


def test_register_first_freezes_what_vllm_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM loads its plugins in each process after its imports and before any model: from then on its full
    collections (after each model load, the warm-up, and its own freeze) leave the imported modules alone."""
    import gc

    from kimi_eagle.adapter import plugin

    monkeypatch.setattr(plugin, "_registered", False)  # as in a process of its own
    imported = [[]]
    try:
        plugin.register()
        assert not any(o is imported for o in gc.get_objects()), "what was imported before register() is collected"
    finally:
        gc.unfreeze()


def _expand_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    temperatures = torch.tensor([0.8, 0.5, 1.0], dtype=torch.float32)
    cu_num_tokens = torch.tensor([2, 5, 6], dtype=torch.int32)
    return temperatures, cu_num_tokens, torch.full((6,), -123.0)


def test_upstream_cpu_expand_still_loses_its_output() -> None:
    """Why the patch exists. If this starts failing, upstream fixed issue 55005: drop `enable_correct_expand`.

    The same on every ISA: the fault is in vLLM's Python wrapper (an int64 copy of the output), and each of the three
    kernel builds has the op; this runs the build vLLM loads for this CPU (tests/unit/kimi_eagle/test_cpu_kernels.py
    runs it on an emulated AVX2-only CPU too)."""
    from kimi_eagle.adapter.cpu_fixes import upstream_expand_kernel
    from kimi_eagle.cpu_kernels import load_vllm_kernels

    load_vllm_kernels()  # registers torch.ops._C: the build vLLM picks, never one imported by name

    upstream = upstream_expand_kernel()
    temperatures, cu, out = _expand_inputs()
    upstream(out, temperatures, cu, 0, 1)
    assert torch.all(out == -123.0)


def test_fixed_expand_writes_every_token_in_its_dtype() -> None:
    from kimi_eagle.adapter.cpu_fixes import expand_kernel

    temperatures, cu, out = _expand_inputs()
    expand_kernel(out, temperatures, cu, 0.5, 0.7)
    assert out.tolist() == pytest.approx([0.8, 0.8, 0.7, 0.7, 0.7, 1.0])
    top_k = torch.zeros(6, dtype=torch.int32)
    expand_kernel(top_k, torch.tensor([5, 0, 9], dtype=torch.int32), cu, 0, 4096)
    assert top_k.tolist() == [5, 5, 4096, 4096, 4096, 9]


CPU_MLA_BACKENDS = {"CPU_MLA": "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend",
                    "AMX_MLA": "vllm.v1.attention.backends.mla.amx_mla.AMXMLABackend"}


@pytest.mark.parametrize("name", CPU_MLA_BACKENDS)
def test_upstream_cpu_mla_backends_still_send_verification_to_their_prefill_path(name: str) -> None:
    """Why the overrides exist. If this fails, that upstream backend verifies draft tokens as decodes: drop its
    line in `verify_draft_tokens_on_the_mla_decode_kernel`."""
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.utils.import_utils import resolve_obj_by_qualname

    upstream = resolve_obj_by_qualname(CPU_MLA_BACKENDS[name])
    assert upstream.get_builder_cls().query_len_support == QueryLenSupport.SINGLE_ONLY


@pytest.mark.parametrize("name", CPU_MLA_BACKENDS)
def test_plugin_points_the_cpu_mla_backends_at_their_spec_decode_builders(name: str) -> None:
    from vllm.model_executor.layers.attention.mla_attention import QueryLenSupport
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kimi_eagle.adapter import plugin

    plugin.register()
    backend = AttentionBackendEnum[name].get_class()
    assert backend.get_name() == name  # the platform's checks and the profile's flag still match it
    builder = backend.get_builder_cls()
    assert builder.query_len_support == QueryLenSupport.UNIFORM
    # upstream's own builder still runs after ours (AMX's `build` derives its kernel's tables from the rows)
    assert issubclass(builder, resolve_obj_by_qualname(CPU_MLA_BACKENDS[name]).get_builder_cls())


@pytest.mark.parametrize("query_len", [1, 2, 4])
def test_cpu_mla_decode_kernel_verifies_a_block_of_draft_tokens_causally(query_len: int) -> None:
    """vLLM's own CPU kernel, fed one row per query token: row t of a request attends the context and block
    tokens 0..t, exactly what the prefill path computed for verification. CPU_MLA's kernel is in all three builds
    (AVX2, AVX-512, AVX-512 BF16): this runs the one vLLM loads here."""
    from vllm import _custom_ops as ops

    from kimi_eagle.adapter.cpu_mla_spec_decode import decode_rows

    torch.manual_seed(0)
    heads, cache = 4, torch.randn(12, 16, 576)  # 12 blocks of 16 latent (512) + rope (64) entries
    block_table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([37, 50], dtype=torch.int32)  # context + the block's own tokens, across blocks
    q = torch.randn(2 * query_len, heads, 576)
    rows, extents = decode_rows(block_table, seq_lens, q.shape[0])
    assert extents.tolist() == [n - query_len + 1 + t for n in (37, 50) for t in range(query_len)]
    out = torch.zeros(2 * query_len, heads, 512)
    ops.mla_decode_kvcache_cpu(out, q, cache, 0.1, rows.to(torch.int32), extents.to(torch.int32))
    for row in range(q.shape[0]):
        expected = causal_reference(q[row], cache, rows[row].tolist(), int(extents[row]))
        torch.testing.assert_close(out[row], expected, atol=1e-5, rtol=1e-4)


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM picks AMX_MLA only where the CPU has AMX")
@pytest.mark.parametrize("query_len", [1, 2, 4])
def test_amx_mla_decode_kernel_verifies_a_block_of_draft_tokens_causally(query_len: int) -> None:
    """AMX's decode kernel, fed our rows through the tables AMX's own builder derives from them (`req_to_token`,
    int64 extents, one pool index per row): row t attends the context and block tokens 0..t."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.mla.amx_mla import _expand_block_table

    from kimi_eagle.adapter.cpu_mla_spec_decode import decode_rows

    torch.manual_seed(0)
    heads, block_size = 4, 32  # AMX_MLA's blocks are multiples of 32
    cache = torch.randn(12, block_size, 576).to(torch.bfloat16)
    block_table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([37, 100], dtype=torch.int32)
    q = torch.randn(2 * query_len, heads, 576).to(torch.bfloat16)
    rows, extents = decode_rows(block_table, seq_lens, q.shape[0])
    flat = cache.view(-1, 1, 576)
    out = torch.zeros(q.shape[0], heads, 512, dtype=torch.bfloat16)
    attn_logits = torch.zeros(q.shape[0], heads, 1, 513, dtype=torch.float32)  # one KV split
    ops.cpu_mla_decode(q, flat, flat[..., :512], out, None, None, None, attn_logits,
                       _expand_block_table(rows, block_size), torch.arange(rows.shape[0], dtype=torch.int64),
                       extents.to(torch.int64), 0.1, 0.0, False, 0, None, None)
    for row in range(q.shape[0]):
        expected = causal_reference(q[row].float(), cache.float(), rows[row].tolist(), int(extents[row]))
        torch.testing.assert_close(out[row].float(), expected, atol=3e-2, rtol=3e-2)


def test_decode_rows_refuses_a_non_uniform_block() -> None:
    from kimi_eagle.adapter.cpu_mla_spec_decode import decode_rows

    with pytest.raises(ValueError, match="non-uniform decode block: 7 query rows over 2 requests"):
        decode_rows(torch.zeros(2, 4, dtype=torch.int32), torch.tensor([10, 20]), 7)


def _draft_head(target_hidden: int, draft_hidden: int, num_aux: int) -> torch.nn.Module:
    """The attributes vLLM's `Eagle3LlamaForCausalLM.combine_hidden_states` reads, around a real `fc`; the method
    itself is vLLM's own, so the test runs upstream code on both sides of our first-step check. (Imported here, not
    at the top: importing vLLM's model modules must not happen before the plugin tests choose their order.)"""
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    class DraftHead(torch.nn.Module):
        combine_hidden_states = Eagle3LlamaForCausalLM.combine_hidden_states

    head = DraftHead()
    head.config = SimpleNamespace(hidden_size=draft_hidden)
    head.model = torch.nn.Module()
    head.model.fc = torch.nn.Linear(num_aux * target_hidden, draft_hidden, bias=False)
    head.model.use_aux_hidden_state, head.model.norm_before_fc, head.model.fc_norm = True, False, None
    return head


def test_first_step_check_runs_once_then_leaves_vllms_method_in_place() -> None:
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    from kimi_eagle.adapter.draft_guard import check_first_step_width

    ids, hidden = (2, 4, 6), 256
    draft = _draft_head(hidden, hidden, len(ids))
    check_first_step_width(draft, ids, hidden)
    assert "combine_hidden_states" in vars(draft)  # armed for the first step only
    out = draft.combine_hidden_states(torch.randn(5, 3 * hidden))
    assert out.shape == (5, hidden)
    # After the first step the hot path is vLLM's method itself: no wrapper, no branch, nothing to cost.
    assert "combine_hidden_states" not in vars(draft)
    assert draft.combine_hidden_states.__func__ is Eagle3LlamaForCausalLM.combine_hidden_states


def test_first_step_check_names_both_widths_and_the_ids() -> None:
    from kimi_eagle.adapter.draft_guard import DraftRefusedError, check_first_step_width

    ids, hidden = (2, 4, 6), 256
    draft = _draft_head(hidden, hidden, len(ids))
    check_first_step_width(draft, ids, hidden)
    with pytest.raises(DraftRefusedError) as refusal:
        draft.combine_hidden_states(torch.randn(5, hidden))  # one layer, as in the SGLang Kimi-K2.5 failure
    message = str(refusal.value)
    assert "768 = 3 aux layers [2, 4, 6] x hidden 256" in message and "sent 256 (1 layer(s))" in message



def test_upstream_top_k_only_still_fails_on_zero_rows() -> None:
    """A step with no draft tokens gives the rejection sampler zero rows; vLLM's CPU top-k mask fails on them."""
    from kimi_eagle.adapter import cpu_fixes

    with pytest.raises(RuntimeError, match="numel"):
        cpu_fixes.upstream_top_k_only()(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int32))


def test_top_k_on_a_verification_without_draft_tokens_masks_nothing() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from kimi_eagle.adapter import plugin

    plugin.register()
    assert apply_top_k_top_p(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int32), None).shape == (0, 8)
    logits = torch.arange(8.0).repeat(2, 1)
    masked = apply_top_k_top_p(logits, torch.tensor([2, 8], dtype=torch.int32), None)
    assert torch.isinf(masked[0]).sum() == 6 and not torch.isinf(masked[1]).any()


def _rejection_inputs(vocab: int = 10) -> dict:
    """Four requests at T > 0 with two draft tokens each: 0 greedy, 1 a placeholder second (its first accepted),
    2 a placeholder first and second, 3 no placeholder. Each target row is one-hot, so acceptance is certain."""
    drafts = [[3, -1], [vocab - 1, -1], [-1, -1], [4, 5]]
    targets = [[3, 6], [vocab - 1, 7], [2, 2], [4, 5]]
    target_probs = torch.zeros(8, vocab)
    for row, token in enumerate(t for pair in targets for t in pair):
        target_probs[row, token] = 1.0
    return {"output_token_ids": torch.full((4, 3), -1, dtype=torch.int32),
            "cu_num_draft_tokens": torch.tensor([2, 4, 6, 8], dtype=torch.int32),
            "draft_token_ids": torch.tensor([t for pair in drafts for t in pair]),
            "draft_probs": None, "target_probs": target_probs,
            "bonus_token_ids": torch.tensor([[9], [9], [9], [9]]),
            "recovered_token_ids": torch.tensor([t for pair in targets for t in pair]),
            "uniform_probs": torch.full((8,), 0.5, dtype=torch.float64),
            "is_greedy": torch.tensor([True, False, False, False]),
            "max_spec_len": 2, "vocab_size": vocab, "NO_DRAFT_PROBS": True}


def test_upstream_cpu_rejection_sampler_still_samples_a_placeholder_draft() -> None:
    """Why the fix exists: vLLM's C++ kernel reads the placeholder's probability at index -1, here the previous row's
    last entry (1.0), accepts it and hands -1 on as a sampled token. If this starts failing, upstream checks the
    placeholder as its Triton kernel does: drop `enable_placeholder_rejection`."""
    from kimi_eagle.adapter import cpu_fixes
    from kimi_eagle.cpu_kernels import load_vllm_kernels

    load_vllm_kernels()
    inputs = _rejection_inputs()
    cpu_fixes.upstream_rejection_random_sample()(**inputs)
    assert inputs["output_token_ids"][1].tolist() == [9, -1, 9]


def test_a_placeholder_draft_is_rejected_and_a_vocabulary_token_recovered() -> None:
    from kimi_eagle.adapter import cpu_fixes
    from kimi_eagle.cpu_kernels import load_vllm_kernels

    load_vllm_kernels()
    inputs = _rejection_inputs()
    cpu_fixes.rejection_random_sample_kernel(**inputs)
    assert inputs["output_token_ids"].tolist() == [
        [-1, -1, -1],  # greedy: the greedy kernel's row, left alone
        [9, 7, -1],  # the first accepted, the placeholder rejected: the target's token there, no bonus
        [2, -1, -1],  # rejected at once
        [4, 5, 9],  # no placeholder: both accepted and the bonus
    ]
