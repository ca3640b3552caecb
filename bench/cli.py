"""`kimi-eagle bench MODE`: what speculation buys on this machine, one subcommand per mode, as `vllm bench
serve|latency|throughput` lays them out: each mode's module registers its own (its options, its run), over the
helpers they share (`subcommand.py`); `render` shows each mode's latest run in BENCHMARKS.md.

The modes were flags before (`kimi-eagle bench --tune`; plain `kimi-eagle bench` was the speed-up run): those
spellings are refused with the spelling of now, never run under a guess."""

from __future__ import annotations

import argparse
import shlex
import signal

from kimi_eagle.exit_status import fail

MEASURING_MODES = ("speedup", "configs", "tune", "bypass", "guidellm", "startup")  # as `--help` lists them
OLD_FLAGS = {"--configs": "configs", "--tune": "tune", "--bypass": "bypass", "--guidellm": "guidellm",
             "--startup": "startup"}
HELP = ("-h", "--help")


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` to `kimi-eagle`. Its words are parsed by `bench_parser` once bench runs: it imports every mode,
    which `kimi-eagle serve` need not (vLLM parses `vllm bench`'s subcommands only when it runs too)."""
    p = sub.add_parser("bench", help="benchmark speculation: `kimi-eagle bench MODE` (speedup, configs, tune, bypass, "
                                     "guidellm, startup; render)",
                       description="`kimi-eagle bench --help` lists the modes.",
                       prefix_chars="+", add_help=False)  # no option of its own: every word goes to bench_parser
    p.add_argument("words", nargs="*")
    p.set_defaults(handler=run_bench)


def bench_parser() -> argparse.ArgumentParser:
    from kimi_eagle.bench import bypass, configs, guidellm, render, speedup, startup, tune

    parser = argparse.ArgumentParser(
        prog="kimi-eagle bench", description="Each measuring mode starts its own vLLM servers and writes "
        "OUT/<mode>-<time>.json (every figure, the plan, the machine, the command) and .md (the tables); `render` "
        "puts the latest run of each into BENCHMARKS.md. `kimi-eagle bench MODE --help`: a mode's options.")
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)
    measuring = (speedup, configs, tune, bypass, guidellm, startup)
    for module in measuring:
        module.register(modes)
    render.register(modes, [module.RESULTS for module in measuring])
    return parser


def old_spelling(words: list[str]) -> str | None:
    """Why `kimi-eagle bench WORDS` is refused when it is a spelling of before the modes were subcommands, with the
    spelling of now; None for any other words (a mode, --help, a typo that argparse names)."""
    old = [w for w in words if w in OLD_FLAGS]
    if not old and words and (words[0] in HELP or not words[0].startswith("-")
                              or any(w in MEASURING_MODES for w in words)):
        return None
    rest = [w for w in words if w not in OLD_FLAGS]
    if old and rest and rest[0] in MEASURING_MODES:
        rest = rest[1:]  # `make bench ARGS=--tune` runs `kimi-eagle bench speedup --tune`
    now = [_spelling(OLD_FLAGS[flag], rest) for flag in old] or [_spelling("speedup", rest)]
    was = shlex.join(["kimi-eagle", "bench", *words])
    return (f"the modes are subcommands now (`kimi-eagle bench --help`): `{was}` is "
            + " and ".join(now) + (" (two runs: one at a time)" if len(now) > 1 else ""))


def _spelling(mode: str, rest: list[str]) -> str:
    make = f"`make bench MODE={mode}" + (f" ARGS={shlex.quote(shlex.join(rest))}" if rest else "") + "`"
    return f"`{shlex.join(['kimi-eagle', 'bench', mode, *rest])}` ({make})"


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_bench(args: argparse.Namespace) -> int:
    from kimi_eagle.bench.client import BenchRequestError
    from kimi_eagle.bench.subcommand import BenchError
    from kimi_eagle.serve.command import CommandError
    from kimi_eagle.serve.launch import ServerStartError
    from kimi_eagle.serve.profile import ProfileError

    refused = old_spelling(args.words)
    if refused is not None:
        return fail("bench", refused)
    mode_args = bench_parser().parse_args(args.words)
    if args.passthrough:
        return fail("bench", "bench takes no vLLM flags after `--`: put them in a profile (--profile FILE)")
    mode_args.command_line = shlex.join(["kimi-eagle", "bench", *args.words])  # recorded in the results
    # A CI timeout or `kill` sends SIGTERM, which would end this process without unwinding: the servers a mode
    # started (each in its own session) would keep running. As an exception, it stops them on the way out.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return mode_args.run(mode_args)
    except (BenchError, BenchRequestError, CommandError, ProfileError, ServerStartError) as exc:
        return fail("bench", str(exc))
    finally:
        signal.signal(signal.SIGTERM, previous)
