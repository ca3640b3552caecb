"""`kimi-eagle sglang-command`: the SGLang side of the A/B."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from kimi_eagle.exit_status import fail
from kimi_eagle.serve.cli import add_pair_options
from kimi_eagle.serve.command import ServeCommand
from kimi_eagle.serve.profile import ProfileError, load_profile


def register(sub: argparse._SubParsersAction) -> None:
    """Add this module's subcommands to `kimi-eagle`."""
    add_sglang_parser(sub)


def add_sglang_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sglang-command", help="the SGLang server command for a profile's target and draft (the A/B's other side)",
        description="Print (and with --launch run) SGLang's server for the same target and EAGLE-3 draft as a vLLM "
                    "profile: EAGLE3 with k steps, top-k 1, k+1 draft tokens, metrics on. A speculators draft gets "
                    "a view SGLang can read: a sibling folder with a flat config and links to the original weights. "
                    "Anything after `--` goes to SGLang unchanged.")
    add_pair_options(p)
    p.add_argument("--out", type=Path, help="where to write the draft view (default: <draft>-sglang beside it)")
    p.add_argument("--host", help="address to bind (default the profile's; others need an API key)")
    p.add_argument("--port", type=int, help="port (default 30000, SGLang's own)")
    p.add_argument("--api-key", help="require this key from clients (or set VLLM_API_KEY)")
    p.add_argument("--python", help="the Python that has SGLang installed (default: this one)")
    p.add_argument("--launch", action="store_true", help="run the server and wait until it answers /health")
    p.add_argument("--ready-timeout", type=float, default=1800, help="seconds to wait for /health (default 1800)")
    p.set_defaults(handler=run_sglang_command)



def run_sglang_command(args: argparse.Namespace) -> int:
    started_at = time.perf_counter()
    from kimi_eagle.serve.command import CommandError
    from kimi_eagle.serve.sglang import ViewError, build_sglang_command

    if args.num_speculative_tokens is not None and args.num_speculative_tokens < 1:
        return fail("sglang-command", "--num-speculative-tokens must be at least 1")
    try:
        plan = build_sglang_command(
            load_profile(args.profile), target=args.target, draft=args.draft, no_draft=args.no_draft,
            num_speculative_tokens=args.num_speculative_tokens, host=args.host, port=args.port,
            api_key=args.api_key, out=args.out, python=args.python, extra_args=args.passthrough)
    except (ProfileError, CommandError, ViewError) as exc:
        return fail("sglang-command", str(exc))
    for note in plan.view.notes if plan.view else []:
        print(f"note: {note}", file=sys.stderr)
    for flag, why in plan.dropped_flags.items():
        print(f"note: vLLM flag --{flag} left out: {why}", file=sys.stderr)
    if not args.launch:
        print(plan.command.printable())
        return 0
    return _launch(plan.command, args.ready_timeout, started_at)


def _launch(command: ServeCommand, ready_timeout: float, started_at: float) -> int:
    from kimi_eagle.serve.launch import ServerStartError, serve_in_foreground

    python = command.argv[0]
    if subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode != 0:
        return fail("sglang-command", f"{python} cannot import sglang: give --python /path/to/an-sglang-env/bin/python")
    try:
        return serve_in_foreground(command, "SGLang", ready_timeout, started_at=started_at)
    except ServerStartError as exc:
        return fail("sglang-command", str(exc))
