"""CPU_MLA and AMX_MLA that verify draft tokens on their decode kernels, as vLLM's GPU MLA backends do.

vLLM 0.32's CPU MLA backends declare single-token queries only (`QueryLenSupport.SINGLE_ONLY`), so each
verification step of speculative decoding (1 + k query tokens per request) takes the prefill path. On CPU_MLA
that gathers the whole context from the KV cache, up-projects it through `kv_b_proj` and runs SDPA, every step:
measured on the tiny pair, a speculative step cost almost two plain steps before its first draft token. AMX_MLA
(vLLM's pick for bfloat16 on a CPU with AMX) runs its extend kernel there: measured under one stream, that was
12% of the worker's time, 2.6 times what the decode kernel took for a plain step.

Both decode kernels (`mla_decode_kvcache_cpu`, AMX's `cpu_mla_decode`) read each query row's own KV extent from
`seq_lens`, so a uniform block of q query tokens is q decode rows: the same block table, extents
seq_len - q + 1 ... seq_len (causal inside the block). vLLM's Triton MLA backend handles spec decode the same way
(`TritonMLAImpl.forward_mqa`); the KV cache already holds the block's own tokens when attention runs. Here the
rows are laid out in the decode metadata, once per step, and upstream's impls run unchanged.

Installed through vLLM's registry (`register_backend` overriding `CPU_MLA` and `AMX_MLA`), not by editing their
classes.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonDecodeMetadata,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend, AMXMLAMetadataBuilder
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend


def decode_rows(block_table: torch.Tensor, seq_lens: torch.Tensor,
                num_query_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One (block table row, causal KV extent) per query row, for a uniform block of query tokens per request."""
    num_requests = seq_lens.shape[0]
    query_len, remainder = divmod(num_query_rows, num_requests) if num_requests else (1, 0)
    if remainder:
        raise ValueError(f"non-uniform decode block: {num_query_rows} query rows over {num_requests} requests")
    if query_len == 1:
        return block_table, seq_lens
    # Row t of a request's block sees the context plus block tokens 0..t.
    offsets = torch.arange(1 - query_len, 1, dtype=seq_lens.dtype, device=seq_lens.device)
    return (block_table.repeat_interleave(query_len, dim=0),
            (seq_lens.unsqueeze(1) + offsets).flatten().clamp(min=0))


class DecodeRowPerQueryToken:
    """Decode metadata with one row per query token, built once per step for every layer; upstream's
    `forward_mqa` then hands each row to its kernel unchanged. Mixed in before a backend's own builder."""

    # UNIFORM raises the decode threshold to 1 + num_speculative_tokens; a batch whose query lengths differ
    # sends the odd ones to the prefill path, which stays correct. Non-causal blocks stay refused by the parent
    # (`supports_non_causal_multi_token_decode` is False), so every block here is causal.
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor, max_seq_len: int,
                      query_start_loc_cpu: torch.Tensor, query_start_loc_device: torch.Tensor,
                      num_decode_tokens: int, max_query_len: int,
                      dcp_tot_seq_lens_device: torch.Tensor | None) -> MLACommonDecodeMetadata:
        block_table, seq_lens = decode_rows(block_table_tensor, seq_lens_device, num_decode_tokens)
        return super()._build_decode(block_table, seq_lens, max_seq_len, query_start_loc_cpu,
                                     query_start_loc_device, num_decode_tokens, max_query_len,
                                     dcp_tot_seq_lens_device)


class SpecDecodeCPUMLAMetadataBuilder(DecodeRowPerQueryToken, MLACommonMetadataBuilder[MLACommonMetadata]):
    pass


class SpecDecodeCPUMLABackend(CPUMLABackend):
    @staticmethod
    def get_builder_cls() -> type[SpecDecodeCPUMLAMetadataBuilder]:
        return SpecDecodeCPUMLAMetadataBuilder


class SpecDecodeAMXMLAMetadataBuilder(DecodeRowPerQueryToken, AMXMLAMetadataBuilder):
    """AMX's `build` then derives its kernel's `req_to_token` and int64 `seq_lens` from these rows."""


class SpecDecodeAMXMLABackend(AMXMLABackend):
    @staticmethod
    def get_builder_cls() -> type[SpecDecodeAMXMLAMetadataBuilder]:
        return SpecDecodeAMXMLAMetadataBuilder
