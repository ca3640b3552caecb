"""`python -m tests.helpers.kernel_probe`: what the CPU fixes run on in this process's CPU, as one JSON line.

Run by tests/unit/kimi_eagle/test_cpu_kernels.py under `qemu-x86_64 -cpu EPYC-Milan`, an AMD EPYC Zen 3 (AVX2, no
AVX-512) emulated on whatever x86 machine runs the suite: which kernel build vLLM loads there, upstream's expand op
and our fix on it, and CPU_MLA's decode kernel, fed the rows our verification path gives it, against a reference.
Under emulation each second of work takes about ten, so this runs the kernels, not an engine."""

from __future__ import annotations

import json

import torch

from kimi_eagle import cpu_kernels


def causal_reference(q: torch.Tensor, cache: torch.Tensor, blocks: list[int], extent: int) -> torch.Tensor:
    """MLA decode of one query row over the first `extent` latent (512) + rope (64) entries of its blocks."""
    kv = torch.cat([cache[b] for b in blocks])[:extent]
    return torch.softmax(q @ kv.T * 0.1, dim=-1) @ kv[:, :512]


def mla_decode_error(query_len: int = 2) -> float:
    """The largest difference between vLLM's CPU MLA decode kernel, one row per query token, and the reference.

    The rows are those `cpu_mla_spec_decode.decode_rows` gives (test_plugin.py checks it natively), written out: its
    module imports vLLM's attention layers, half a minute more under emulation."""
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    heads, cache = 4, torch.randn(12, 16, 576)
    block_table = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11]], dtype=torch.int32)
    seq_lens = [37, 50]
    q = torch.randn(2 * query_len, heads, 576)
    rows = block_table.repeat_interleave(query_len, dim=0)
    extents = torch.tensor([n - query_len + 1 + t for n in seq_lens for t in range(query_len)])
    out = torch.zeros(2 * query_len, heads, 512)
    ops.mla_decode_kvcache_cpu(out, q, cache, 0.1, rows.to(torch.int32), extents.to(torch.int32))
    return max(float((out[row] - causal_reference(q[row], cache, rows[row].tolist(), int(extents[row]))).abs().max())
               for row in range(q.shape[0]))


def expand(kernel, replace_from: float, replace_to: float) -> list[float]:
    """Per-request temperatures [0.8, 0.5, 1.0] over 2, 3 and 1 tokens, into a buffer of -123."""
    out = torch.full((6,), -123.0)
    kernel(out, torch.tensor([0.8, 0.5, 1.0]), torch.tensor([2, 5, 6], dtype=torch.int32), replace_from, replace_to)
    return out.tolist()


def main() -> None:
    from kimi_eagle.adapter.cpu_fixes import expand_kernel, upstream_expand_kernel

    isa = cpu_kernels.this_cpu()
    build = cpu_kernels.load_vllm_kernels()
    print(json.dumps({"isa": isa.name, "expected_build": cpu_kernels.expected_build(isa), "loaded_build": build,
                      "upstream_expand": expand(upstream_expand_kernel(), 0, 1),  # its op takes integers only
                      "fixed_expand": expand(expand_kernel, 0.5, 0.7),
                      "mla_decode_error": mla_decode_error()}))


if __name__ == "__main__":
    main()
