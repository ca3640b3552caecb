"""Faults of the CPU build of vLLM 0.32 that stop EAGLE-3 on a Kimi-K2.5 (MLA) target, or cripple it.

Each fix is guarded by the vLLM version it was read against: on any other version it is not applied and
the plugin says so, so an upgrade re-checks instead of patching code that has moved.
"""

from __future__ import annotations

import bisect
import logging

import torch

from kimi_eagle import envs
from kimi_eagle.adapter import compat, surface
from kimi_eagle.cpu_kernels import kernel_report

logger = logging.getLogger("vllm.kimi_eagle")  # under "vllm": its handlers and format

CPU_ATTN_BLOCK_SIZES_16 = 16


def applies_here() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu() and compat.supported()


def cpu_attention_block_sizes(kv_cache_spec=None) -> list:
    from vllm.v1.attention.backend import MultipleOf

    return [CPU_ATTN_BLOCK_SIZES_16, MultipleOf(32)]


def enable_block_size_16() -> None:
    """Target (CPU_MLA: block size 16 only) and draft (CPU_ATTN: multiples of 32) share one KV-cache group,
    and vLLM refuses to start ("No common block size for 16"). CPU_ATTN's kernel has a 16-wide path
    (`_get_attn_isa` returns "vec16" for such blocks), so it can honestly advertise 16 as well."""
    surface.wrap("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend.get_supported_kernel_block_sizes",
                 lambda _: cpu_attention_block_sizes)


def expand_kernel(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                  replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 - the kernel's name
    """Repeat each request's value over its tokens, in the output's own dtype.

    Replaces `cpu_triton_utils._expand_kernel_impl`, which hands the int64-only C++ op an int64 *copy* of a
    float32 output (so per-token temperatures, top-k and top-p are never written: uninitialised memory) and
    truncates float inputs (0.7 -> 0). Upstream: vllm-project/vllm issue 55005."""
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()].copy_(expanded)


def upstream_expand_kernel():
    """vLLM's own CPU expand, whether or not the fix has replaced it (tests show why the fix exists)."""
    from vllm.utils import cpu_triton_utils

    return surface.original_of(cpu_triton_utils._expand_kernel_impl)


def enable_correct_expand() -> None:
    """Must run before the CPU platform registers its kernel overrides: the worker loads general plugins
    first and then reads `cpu_triton_utils._expand_kernel_impl` by name."""
    surface.wrap("vllm.utils.cpu_triton_utils", "_expand_kernel_impl", lambda _: expand_kernel)


PLACEHOLDER_TOKEN_ID = -1  # vllm.v1.sample.rejection_sampler.PLACEHOLDER_TOKEN_ID
PLACEHOLDER_REACHED = "a placeholder draft token (-1) reached the CPU rejection sampler"
_placeholder_reported = False


def rejection_random_sample_kernel(output_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                                   draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                                   target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                                   recovered_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                                   is_greedy: torch.Tensor | None, *args, **kwargs) -> None:
    """vLLM's CPU rejection sampling at T > 0, with a placeholder draft token (-1) rejected as the Triton kernel
    rejects it.

    The C++ kernel behind `cpu_triton_utils._rejection_random_sample_kernel_impl` reads the target's probability
    at index -1 (the previous row's last entry, or memory before the tensor) and, where that passes, emits -1 as
    a sampled token. vLLM pads grammar-invalid drafts with -1 (`Scheduler.update_draft_token_ids_in_output`, async
    scheduling with structured outputs). Here the kernel reads token 0 instead, and each sampled request's outputs
    from its first placeholder on become the recovered token there, then nothing: what the Triton kernel writes."""
    upstream = upstream_rejection_random_sample()
    placeholders = draft_token_ids < 0
    if not bool(placeholders.any()):
        upstream(output_token_ids, cu_num_draft_tokens, draft_token_ids, draft_probs, target_probs, bonus_token_ids,
                 recovered_token_ids, uniform_probs, is_greedy, *args, **kwargs)
        return
    global _placeholder_reported
    if not _placeholder_reported:  # the tests' proof that serving on this path does not reach it reads this line
        _placeholder_reported = True
        logger.warning("kimi-eagle: %s at T > 0: rejected there, as vLLM's Triton kernel rejects it",
                       PLACEHOLDER_REACHED)
    upstream(output_token_ids, cu_num_draft_tokens, draft_token_ids.clamp(min=0), draft_probs, target_probs,
             bonus_token_ids, recovered_token_ids, uniform_probs, is_greedy, *args, **kwargs)
    ends = cu_num_draft_tokens.tolist()
    for token_idx in placeholders.nonzero().flatten().tolist():
        request = bisect.bisect_right(ends, token_idx)  # ends are cumulative: the first end past the token
        if is_greedy is not None and bool(is_greedy[request]):  # the greedy kernel's row, already right
            continue
        pos = token_idx - (ends[request - 1] if request else 0)
        row = output_token_ids[request]
        if row[pos] == PLACEHOLDER_TOKEN_ID:  # stopped before it, or an earlier placeholder settled it
            continue
        row[pos] = recovered_token_ids[token_idx]
        row[pos + 1:] = PLACEHOLDER_TOKEN_ID


def upstream_rejection_random_sample():
    """vLLM's own CPU rejection sampling at T > 0, whether or not the fix has replaced it."""
    from vllm.utils import cpu_triton_utils

    return surface.original_of(cpu_triton_utils._rejection_random_sample_kernel_impl)


def enable_placeholder_rejection() -> None:
    """Like `enable_correct_expand`, before the CPU platform registers its kernel overrides."""
    surface.wrap("vllm.utils.cpu_triton_utils", "_rejection_random_sample_kernel_impl",
                 lambda _: rejection_random_sample_kernel)


def top_k_only(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """vLLM's top-k without sorting, which takes `k.max()` and so fails on zero rows. With a draft configured vLLM
    sends every step through the rejection sampler, and a step in which no request has draft tokens (a prefill, the
    first decode) gives it none to verify: on a CPU, which has no Triton, one request with `top_k` at T > 0 then
    raised inside the engine core and the server exited. Nothing to mask in zero rows."""
    if logits.shape[0] == 0:
        return logits
    return upstream_top_k_only()(logits, k)


def upstream_top_k_only():
    """vLLM's own top-k-only mask, whether or not the fix has replaced it (tests show why the fix exists)."""
    from vllm.v1.sample.ops import topk_topp_sampler

    return surface.original_of(topk_topp_sampler.apply_top_k_only)


def enable_top_k_on_empty_verification() -> None:
    # `apply_top_k_top_p_pytorch` looks the name up in its module at each call, so replacing it there is enough.
    surface.wrap("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_only", lambda _: top_k_only)


def pack_only_what_computes_logits(original):
    """vLLM's CPU build packs every vocabulary embedding's weight for oneDNN matmuls and keeps the weight too
    (`UnquantizedEmbeddingMethod.process_weights_after_loading`, `remove_weight=False`): a second copy of each
    embedding table, which only an lm_head ever multiplies by. At Kimi-K2.5's vocabulary (163840 x 7168 in bfloat16)
    that is 2.3 GB for the target's `embed_tokens`, and 2.3 GB more while an EAGLE-3 draft's own table waits to be
    replaced by the target's (the draft shares it): the real-width pair (`real-width-cpu`) did not fit in 23 GiB.
    A table used only for lookups keeps its one copy; a plain matmul stays available should anything multiply by it."""

    def process_weights_after_loading(self, layer) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        if isinstance(layer, ParallelLMHead):
            original(self, layer)
        else:
            layer.cpu_linear = torch.nn.functional.linear

    return process_weights_after_loading


def enable_single_copy_embeddings() -> None:
    surface.wrap("vllm.model_executor.layers.vocab_parallel_embedding",
                 "UnquantizedEmbeddingMethod.process_weights_after_loading", pack_only_what_computes_logits)


def verify_draft_tokens_on_the_mla_decode_kernel() -> None:
    """CPU_MLA and AMX_MLA send every verification step (1 + k tokens per request) down their prefill paths; the
    overrides (`adapter/cpu_mla_spec_decode.py`, through vLLM's backend registry) run them on the decode kernels."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    module = "kimi_eagle.adapter.cpu_mla_spec_decode"
    register_backend(AttentionBackendEnum.CPU_MLA, f"{module}.SpecDecodeCPUMLABackend")
    register_backend(AttentionBackendEnum.AMX_MLA, f"{module}.SpecDecodeAMXMLABackend")


def apply() -> bool:
    if not applies_here():
        logger.info("kimi-eagle: CPU fixes not applied (vLLM %s; fixed versions %s, CPU only)",
                    compat.vllm_version(), compat.SUPPORTED_VLLM_VERSIONS)
        return False
    report = kernel_report()
    if report:  # each fix below was proven on this build's kernels (tests/unit/kimi_eagle/test_cpu_kernels.py)
        logger.info("kimi-eagle: %s", report.kernels())  # vLLM logs the attention backend it takes
    enable_block_size_16()
    enable_correct_expand()
    enable_placeholder_rejection()
    if envs.fault() == "upstream-top-k":  # a real engine fault for the tests of how a fault is reported
        logger.warning("kimi-eagle: FAULT INJECTION %s=upstream-top-k: vLLM's own CPU top-k", envs.FAULT.name)
    else:
        enable_top_k_on_empty_verification()
    verify_draft_tokens_on_the_mla_decode_kernel()
    enable_single_copy_embeddings()
    return True
