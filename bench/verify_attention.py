"""What verifying 1 + k draft tokens costs in the CPU MLA decode kernel, against a plain decode step.

The plugin verifies on vLLM's decode kernel with one row per query token (`adapter/cpu_mla_spec_decode.py`), so each
request's latent KV is read once per row. The alternative timed beside it reads it once per request: gather the
request's context, one batched product for all its rows and heads, a causal mask. Both give the same output (checked
before timing), so the figures compare two ways of doing the same work.

    python -m kimi_eagle.bench.verify_attention [--dtype bfloat16] [--requests 16] [--draft-tokens 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from vllm import _custom_ops as ops

from kimi_eagle.adapter.cpu_mla_spec_decode import decode_rows

BLOCK_SIZE = 16  # the only block size vLLM 0.32's CPU MLA backends take
KV_LORA_RANK, ROPE_DIM = 512, 64  # what the CPU MLA kernel needs, and the tiny pair's
HEADS = 4  # the tiny target's


class VerifyBatch:
    """A paged latent KV cache holding `context_lens` tokens per request, and 1 + k query rows per request."""

    def __init__(self, context_lens: list[int], query_len: int, dtype: torch.dtype, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.query_len, self.dtype = query_len, dtype
        self.seq_lens = torch.tensor(context_lens, dtype=torch.int32)  # each includes its own query tokens
        blocks_per_request = -(-max(context_lens) // BLOCK_SIZE)
        self.block_table = torch.randperm(len(context_lens) * blocks_per_request, generator=generator,
                                          dtype=torch.int32).view(len(context_lens), blocks_per_request)
        self.cache = torch.randn(self.block_table.numel(), BLOCK_SIZE, KV_LORA_RANK + ROPE_DIM, generator=generator,
                                 dtype=dtype)
        self.query = torch.randn(len(context_lens) * query_len, HEADS, KV_LORA_RANK + ROPE_DIM, generator=generator,
                                 dtype=dtype)
        self.scale = (KV_LORA_RANK + ROPE_DIM) ** -0.5

    def kernel(self, query_len: int | None = None) -> torch.Tensor:
        """vLLM's decode kernel, one row per query token (with `query_len` 1: a plain decode step's attention)."""
        query_len = query_len or self.query_len
        query = self.query.view(len(self.seq_lens), self.query_len, HEADS, -1)[:, -query_len:].reshape(
            -1, HEADS, KV_LORA_RANK + ROPE_DIM)
        block_table, seq_lens = decode_rows(self.block_table, self.seq_lens, query.shape[0])
        out = torch.zeros(query.shape[0], HEADS, KV_LORA_RANK, dtype=self.dtype)
        ops.mla_decode_kvcache_cpu(out, query, self.cache, self.scale, block_table, seq_lens)
        return out

    def folded(self) -> torch.Tensor:
        """Each request's context gathered once, all its rows and heads in one product, causal inside the block."""
        requests, longest = len(self.seq_lens), int(self.seq_lens.max())
        positions = torch.arange(longest)
        slots = self.block_table.long()[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE
        kv = self.cache.view(-1, KV_LORA_RANK + ROPE_DIM)[slots].float()  # [requests, longest, 576]
        query = self.query.view(requests, self.query_len * HEADS, -1).float()
        scores = torch.bmm(query, kv.transpose(1, 2)) * self.scale
        # Row t of a request's block sees seq_len - query_len + 1 + t tokens; the rows of a token are its heads.
        visible = (self.seq_lens[:, None] + torch.arange(1 - self.query_len, 1)).repeat_interleave(HEADS, dim=1)
        scores.masked_fill_(positions[None, None, :] >= visible[:, :, None], float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), kv[:, :, :KV_LORA_RANK])
        return out.view(requests * self.query_len, HEADS, KV_LORA_RANK).to(self.dtype)


def median_ms(run: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--context", type=int, default=160, help="tokens of context per request (default 160)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    print(f"{args.dtype}, {HEADS} heads, latent {KV_LORA_RANK}+{ROPE_DIM}, context {args.context}, "
          f"k={args.draft_tokens}, {torch.get_num_threads()} threads; median ms per layer over {args.repeats} calls")
    print("| requests | kernel, 1 row each (plain step) | kernel, 1+k rows each (verify) | folded (verify) |")
    print("|---|---|---|---|")
    for requests in args.requests:
        batch = VerifyBatch([args.context] * requests, args.draft_tokens + 1, dtype)
        torch.testing.assert_close(batch.folded(), batch.kernel(), atol=5e-2, rtol=5e-2)
        plain = median_ms(partial(batch.kernel, query_len=1), args.repeats)
        verify = median_ms(batch.kernel, args.repeats)
        folded = median_ms(batch.folded, args.repeats)
        print(f"| {requests} | {plain:.3f} | {verify:.3f} ({verify / plain:.1f}x) "
              f"| {folded:.3f} ({folded / plain:.1f}x) |")


if __name__ == "__main__":
    main()
