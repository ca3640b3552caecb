"""CPU_MLA that verifies draft tokens on its decode kernel, as vLLM's GPU MLA backends do.

vLLM 0.32's CPU_MLA declares single-token queries only (`QueryLenSupport.SINGLE_ONLY`), so each verification
step of speculative decoding (1 + k query tokens per request) takes the prefill path: it gathers the whole
context from the KV cache, up-projects it through `kv_b_proj` and runs SDPA, every step. Measured on the tiny
pair, that made a speculative step cost almost two plain steps before its first draft token.

The CPU decode kernel (`mla_decode_kvcache_cpu`) reads each query row's own KV extent from `seq_lens`, so a
uniform block of q query tokens is q decode rows: the same block table, extents seq_len - q + 1 ... seq_len
(causal inside the block). This is how vLLM's Triton MLA backend handles spec decode
(`TritonMLAImpl.forward_mqa`); the KV cache already holds the block's own tokens when attention runs.

Installed through vLLM's registry (`register_backend` overriding `CPU_MLA`), not by editing its classes.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl


def decode_rows(block_table: torch.Tensor, seq_lens: torch.Tensor, num_query_rows: int,
                causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One (block table row, KV extent) per query row, for a uniform block of query tokens per request."""
    num_requests = seq_lens.shape[0]
    query_len, remainder = divmod(num_query_rows, num_requests) if num_requests else (1, 0)
    if remainder:
        raise ValueError(f"non-uniform decode block: {num_query_rows} query rows over {num_requests} requests")
    if query_len == 1:
        return block_table, seq_lens
    block_table = block_table.repeat_interleave(query_len, dim=0)
    if not causal:
        return block_table, seq_lens.repeat_interleave(query_len)
    # Row t of a request's block sees the context plus block tokens 0..t.
    offsets = torch.arange(1 - query_len, 1, dtype=seq_lens.dtype, device=seq_lens.device)
    return block_table, (seq_lens.unsqueeze(1) + offsets).flatten().clamp(min=0)


class SpecDecodeCPUMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    # UNIFORM raises the decode threshold to 1 + num_speculative_tokens; a batch whose query lengths differ
    # sends the odd ones to the prefill path, which stays correct.
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM


class SpecDecodeCPUMLAImpl(CPUMLAImpl):
    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: MLACommonMetadata, layer: AttentionLayer) -> tuple[torch.Tensor, None]:
        from vllm import _custom_ops as ops

        assert attn_metadata.decode is not None
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        q = q.contiguous()
        rows, num_heads, _ = q.shape
        block_table, seq_lens = decode_rows(attn_metadata.decode.block_table, attn_metadata.decode.seq_lens, rows,
                                            causal=attn_metadata.causal)
        out = torch.zeros(rows, num_heads, self.kv_lora_rank, dtype=q.dtype, device=q.device)
        # The kernel is templated on int32 block tables and lengths.
        ops.mla_decode_kvcache_cpu(out, q, kv_c_and_k_pe_cache, self.scale, block_table.to(torch.int32),
                                   seq_lens.to(torch.int32))
        return out, None


class SpecDecodeCPUMLABackend(CPUMLABackend):
    @staticmethod
    def get_builder_cls() -> type[SpecDecodeCPUMLAMetadataBuilder]:
        return SpecDecodeCPUMLAMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[SpecDecodeCPUMLAImpl]:
        return SpecDecodeCPUMLAImpl
