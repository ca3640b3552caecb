"""`kimi-eagle sizing`: GPU memory per GPU for a Kimi-K2.5 + EAGLE-3 deployment (weights, KV cache, draft)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SIZING_CONTEXTS = (8192, 32768, 131072, 262144)
SIZING_CONCURRENCIES = (1, 8, 32, 64)


def register(sub: argparse._SubParsersAction) -> None:
    """Add `sizing` to `kimi-eagle`."""
    add_sizing_parser(sub)


def add_sizing_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sizing", help="GPU memory per GPU for Kimi-K2.5 + EAGLE-3: weights, KV cache, draft",
        description="Memory per GPU of the target weights (INT4 experts with group scales, the rest bf16), the "
                    "draft, and the KV cache (MLA latent, not split by TP; the draft's split over its KV heads) "
                    "for each context length and concurrency. Shapes: the published Kimi-K2.5 and "
                    "lightseekorg-family draft (serve/sizing.py), or the config.json files given.")
    p.add_argument("--target-config", type=Path, help="a target config.json (default: the published Kimi-K2.5)")
    p.add_argument("--draft-config", type=Path, help="a draft config.json (default: the lightseekorg-family draft)")
    p.add_argument("--no-draft", action="store_true", help="size the target alone")
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=8, help="GPUs the model is split over (8)")
    p.add_argument("--context", type=int, nargs="+", default=list(SIZING_CONTEXTS), help="tokens per sequence")
    p.add_argument("--concurrency", type=int, nargs="+", default=list(SIZING_CONCURRENCIES),
                   help="sequences resident at once")
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16", help="KV cache precision (bf16)")
    p.add_argument("--gpu-memory-gib", type=float, default=139.0,
                   help="memory of one GPU in GiB (default 139: an H200 as this project's GPU host reports it)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.92, help="vLLM's share of each GPU (0.92)")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table (for docs/production.md)")
    p.set_defaults(handler=run_sizing)


def run_sizing(args: argparse.Namespace) -> int:
    import json

    from kimi_eagle.serve.sizing import GIB, DraftShape, SizingError, TargetShape, kimi_k25_shapes, size_deployment

    try:
        target, draft = kimi_k25_shapes()
        if args.target_config:
            config = json.loads(args.target_config.read_text())
            target = TargetShape.from_text_config(config.get("text_config") or config)
        if args.draft_config:
            draft = DraftShape.from_config(json.loads(args.draft_config.read_text()),
                                           target_hidden_size=target.hidden_size)
        rows = [size_deployment(target, None if args.no_draft else draft, context_tokens=context,
                                concurrency=concurrency, tensor_parallel_size=args.tensor_parallel_size,
                                kv_cache_bytes=1 if args.kv_cache_dtype == "fp8" else 2,
                                gpu_memory_gib=args.gpu_memory_gib,
                                gpu_memory_utilization=args.gpu_memory_utilization)
                for context in args.context for concurrency in args.concurrency]
    except (OSError, ValueError, SizingError) as exc:
        print(f"kimi-eagle sizing: {exc}", file=sys.stderr)
        return 2
    first = rows[0]
    print(f"Per GPU at TP {args.tensor_parallel_size}: target weights {first.target_weights_bytes / GIB:.1f} GiB, "
          f"draft weights {first.draft_weights_bytes / GIB:.2f} GiB; KV cache per token "
          f"{first.target_kv_bytes_per_token} B (target, MLA) + {first.draft_kv_bytes_per_token} B (draft); budget "
          f"{args.gpu_memory_gib:g} GiB x {args.gpu_memory_utilization:g} = "
          f"{args.gpu_memory_gib * args.gpu_memory_utilization:.1f} GiB")
    header = ("context", "concurrency", "KV cache GiB", "total GiB", "headroom GiB", "max concurrency")
    table = [(f"{r.context_tokens:,}", str(r.concurrency), f"{r.kv_cache_bytes / GIB:.1f}",
              f"{r.total_bytes / GIB:.1f}", f"{r.headroom_bytes / GIB:.1f}", str(r.max_concurrency_at_context))
             for r in rows]
    if args.markdown:
        print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in table:
            print("| " + " | ".join(row) + " |")
        return 0
    from rich.console import Console
    from rich.table import Table

    rich_table = Table(*header, caption="headroom < 0: does not fit; activations and CUDA graphs need some too")
    for row in table:
        rich_table.add_row(*row)
    Console().print(rich_table)
    return 0
