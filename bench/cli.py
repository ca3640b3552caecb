"""`kimi-eagle bench`: target alone vs target + draft, measured in one run on this machine (see BENCHMARKS.md)."""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from kimi_eagle.cli import fail

if TYPE_CHECKING:
    from rich.console import Console

    from kimi_eagle.serve.profile import Profile

RESULTS_DIR = Path("bench") / "results"


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench` to `kimi-eagle`."""
    p = sub.add_parser("bench", help="benchmark speculation: tokens/s by k and concurrency, acceptance, plugin and "
                                     "harness overhead, cold start; recommends num_speculative_tokens",
                       description="Starts its own vLLM servers (at most two at once) and writes "
                                   "OUT/<mode>-<time>.json and .md. The full run takes about 15 minutes on 2 cores.")
    p.add_argument("--quick", action="store_true",
                   help="k=3 only, 2 rounds, 16 tokens, no checks-off server: proves the benchmark works in under "
                        "3 minutes; its figures are not for comparison")
    p.add_argument("--configs", action="store_true",
                   help="instead: which way of serving the pair is fastest here: float32/bfloat16 x both cores bound/"
                        "vLLM's core layout x alone/with the draft, streamed and not, one server at a time (about 30 "
                        "minutes; with --quick, the two bfloat16 configurations in vLLM's layout, 2 minutes)")
    p.add_argument("--tune", action="store_true",
                   help="instead: the number of draft tokens for each batch size: the target alone and k=1..4 at "
                        "1, 2, 4, 8, 16 and max-num-seqs in flight, one server at a time; the best k per batch-size "
                        "range (0 where speculation loses) becomes a `num_speculative_tokens_per_batch_size` "
                        "schedule, then measured side by side with the target alone and the fixed k it beat, and "
                        "across a schedule boundary (about 20 minutes; with --quick, k=3 at 1 and 4, 3 minutes)")
    p.add_argument("--bypass", action="store_true",
                   help="instead: what the draft fail-safe buys on a random-weight copy of the profile's draft: the "
                        "target alone, that draft with the fail-safe off, and on, at 1, 4 and 16 in flight, streamed "
                        "and not, at T 1, the three servers up together and loaded one at a time, and how long after "
                        "the load began it bypassed the draft (about 30 minutes)")
    p.add_argument("--guidellm", action="store_true",
                   help="instead: GuideLLM (installed apart by `make guidellm`) beside kimi-eagle loadtest against the "
                        "profile and against --no-draft, one server at a time: GuideLLM's synthetic prompts and the "
                        "held-out prompts (both tools), at T 1 and 0, 1 and 4 streams (about 12 minutes; with "
                        "--quick, T 1 and 1 stream, 2 minutes)")
    p.add_argument("--startup", action="store_true",
                   help="instead: how long `kimi-eagle serve PROFILE` (what `make serve` runs) takes to its Ready "
                        "line: each round with an empty compile cache of its own, a first start (nothing compiled) "
                        "and a second (what the first saved); 2 rounds, about 5 minutes (with --quick, 1 round)")
    p.add_argument("--write-profile", action="store_true",
                   help="with --tune: write the schedule into the profile's YAML file")
    p.add_argument("--rounds", type=int, help="with --configs, --bypass or --startup: rounds of the whole run "
                                              "(default 3, 6 and 2): more rounds, a narrower spread")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="with --configs: only this dtype's half of the "
                                                                   "matrix")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})")
    p.add_argument("--profile", default="tiny-cpu", help="serving profile (default tiny-cpu)")
    p.add_argument("--target", help="target checkpoint instead of the profile's")
    p.add_argument("--draft", help="EAGLE-3 draft instead of the profile's")
    p.add_argument("--prompts", type=Path, help="JSON list of prompt strings (default: the fixtures' held-out prompts)")
    p.add_argument("--report", type=Path, metavar="RESULTS_JSON",
                   help="start no server: recompute the recommendation from an earlier results file and rewrite "
                        "its .json and .md (the measured figures are kept as they are)")
    p.set_defaults(handler=run_bench)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)



def _command_line(args: argparse.Namespace) -> str:
    """The command as typed, rebuilt from the parsed options (also right when called from Python)."""
    words = ["kimi-eagle", "bench", *(["--configs"] if args.configs else []), *(["--tune"] if args.tune else []),
             *(["--bypass"] if args.bypass else []), *(["--startup"] if args.startup else []),
             *(["--guidellm"] if args.guidellm else []), *(["--quick"] if args.quick else [])]
    if args.rounds is not None:
        words += ["--rounds", str(args.rounds)]
    if args.dtype is not None:
        words += ["--dtype", args.dtype]
    if args.out != RESULTS_DIR:
        words += ["--out", str(args.out)]
    for option in ("profile", "target", "draft", "prompts"):
        value = getattr(args, option)
        if value is not None and not (option == "profile" and value == "tiny-cpu"):
            words += [f"--{option}", str(value)]
    return shlex.join(words)


def _rewrite_report(path: Path) -> int:
    from kimi_eagle.bench.report import markdown, profile_setting
    from kimi_eagle.bench.result import BenchResult
    from kimi_eagle.bench.run import recommendations
    from kimi_eagle.loadtest.files import write_atomic, write_model

    try:
        data = json.loads(path.read_text())
        # Derived, and recomputed below: a file written by an older model still loads.
        data["recommendations"] = []
        result = BenchResult.model_validate(data)
    except (OSError, ValueError, TypeError) as exc:  # json's and pydantic's errors are ValueErrors
        return fail("bench", f"{path} is not a results file of `kimi-eagle bench`: {exc}")
    result.recommendations, _ = recommendations(result.throughput)
    write_model(path, result)
    write_atomic(path.with_suffix(".md"), markdown(result))
    print(f"rewrote {path} and {path.with_suffix('.md')}", file=sys.stderr)
    print("Profile setting to use (serve/profiles/<profile>.yaml), by concurrency:")
    print(profile_setting(result.recommendations))
    return 0


def _run_mode(plan, bench_class, markdown: Callable, args: argparse.Namespace, profile: Profile,
              prompts: list[str], stamp: str, console: Console):
    """Run one of the one-server-at-a-time modes (configs, tune, bypass, startup) and write its results; returns the
    result and its JSON path, or an exit code when it could not run."""
    from kimi_eagle.bench.client import BenchRequestError
    from kimi_eagle.bench.guidellm import GuideLLMRunError
    from kimi_eagle.loadtest.files import write_atomic, write_model
    from kimi_eagle.serve.command import CommandError
    from kimi_eagle.serve.launch import ServerStartError

    name = f"{plan.mode}-{stamp}"
    bench = bench_class(plan, profile, target=args.target, draft=args.draft, prompts=prompts,
                        files_dir=args.out / f"{name}-files", command_line=_command_line(args), say=console.print)
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        result = bench.run()
    except (ServerStartError, BenchRequestError, CommandError, GuideLLMRunError) as exc:
        return fail("bench", str(exc))
    finally:
        signal.signal(signal.SIGTERM, previous)
    json_path = write_model(args.out / f"{name}.json", result)
    md_path = write_atomic(args.out / f"{name}.md", markdown(result))
    console.print(f"results: {json_path}, {md_path}")
    print(result.verdict)
    return result, json_path


def plan_of(module: ModuleType, args: argparse.Namespace):
    """A mode's QUICK or FULL plan, with the rounds --rounds asks for."""
    plan = module.QUICK if args.quick else module.FULL
    return plan if args.rounds is None else plan.model_copy(update={"rounds": args.rounds})


def _run_configs(args: argparse.Namespace, profile: Profile, prompts: list[str], stamp: str, console: Console) -> int:
    from kimi_eagle.bench import configs

    plan = plan_of(configs, args)
    if args.dtype is not None:
        plan = plan.model_copy(update={"configs": [c for c in plan.configs if c.dtype == args.dtype]})
    outcome = _run_mode(plan, configs.ConfigsBench, configs.markdown, args, profile, prompts, stamp, console)
    return outcome if isinstance(outcome, int) else 0


def _run_tune(args: argparse.Namespace, profile: Profile, prompts: list[str], stamp: str, console: Console) -> int:
    from kimi_eagle.bench import tune
    from kimi_eagle.bench.run import _within_checkout

    plan = tune.QUICK if args.quick else tune.FULL
    outcome = _run_mode(plan, tune.TuneBench, tune.markdown, args, profile, prompts, stamp, console)
    if isinstance(outcome, int):
        return outcome
    result, json_path = outcome
    schedule = tune.recommended_schedule(result)
    if args.write_profile and schedule is not None:
        from kimi_eagle.serve.profile import profile_path, write_schedule

        path = profile_path(args.profile)
        write_schedule(path, schedule, source=_within_checkout(json_path))
        console.print(f"wrote the schedule into {path}")
    print("Profile setting (serve/profiles/<profile>.yaml):")
    print(tune.profile_setting(result))
    return 0


def _run_plain_mode(module: ModuleType, bench_class: type, args: argparse.Namespace, profile: Profile,
                    prompts: list[str], stamp: str, console: Console) -> int:
    """A mode with a FULL and a QUICK plan, a bench class and `markdown` (bypass, startup), and nothing after."""
    outcome = _run_mode(plan_of(module, args), bench_class, module.markdown, args, profile, prompts, stamp, console)
    return outcome if isinstance(outcome, int) else 0


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kimi_eagle.bench.client import BenchRequestError
    from kimi_eagle.bench.plan import FULL, QUICK
    from kimi_eagle.bench.report import markdown, profile_setting
    from kimi_eagle.bench.run import Bench, BenchError, load_prompts
    from kimi_eagle.fixtures.pair_spec import HELDOUT_PROMPTS_FILE
    from kimi_eagle.loadtest import serve_bench
    from kimi_eagle.loadtest.files import write_atomic, write_model
    from kimi_eagle.serve.command import CommandError
    from kimi_eagle.serve.launch import ServerStartError
    from kimi_eagle.serve.profile import ProfileError, load_profile

    console = Console(stderr=True)
    if args.report:
        return _rewrite_report(args.report)
    if args.passthrough:
        return fail("bench", "bench takes no vLLM flags after `--`: put them in a profile (--profile FILE)")
    if args.rounds is not None and (not (args.configs or args.bypass or args.startup) or args.rounds < 1):
        return fail("bench", "--rounds N (N >= 1) goes with --configs, --bypass or --startup")
    if sum((args.configs, args.tune, args.bypass, args.startup, args.guidellm)) > 1:
        return fail("bench", "--configs, --tune, --bypass, --startup and --guidellm are different runs: give one")
    if args.dtype is not None and not args.configs:
        return fail("bench", "--dtype goes with --configs")
    if args.write_profile and not args.tune:
        return fail("bench", "--write-profile goes with --tune")
    plan = QUICK if args.quick else FULL
    try:
        profile = load_profile(args.profile)
        if not (args.draft or profile.draft):
            return fail("bench", f"profile {profile.name} has no draft: give --draft DIR")
        prompts_file = args.prompts or HELDOUT_PROMPTS_FILE
        prompts = load_prompts(prompts_file)
    except (ProfileError, BenchError) as exc:
        return fail("bench", str(exc))
    stamp = time.strftime("%Y%m%d-%H%M%S")
    if args.configs:
        return _run_configs(args, profile, prompts, stamp, console)
    if args.tune:
        return _run_tune(args, profile, prompts, stamp, console)
    if args.bypass:
        from kimi_eagle.bench import bypass

        return _run_plain_mode(bypass, bypass.BypassBench, args, profile, prompts, stamp, console)
    if args.startup:
        from kimi_eagle.bench import startup

        return _run_plain_mode(startup, startup.StartupBench, args, profile, prompts, stamp, console)
    if args.guidellm:
        from kimi_eagle.bench import guidellm

        try:
            guidellm.find_guidellm()
        except guidellm.GuideLLMMissingError as exc:
            return fail("bench", str(exc))
        return _run_plain_mode(guidellm, guidellm.GuideLLMBench, args, profile, prompts, stamp, console)
    name = f"{plan.mode}-{stamp}"
    bench = Bench(plan, profile, target=args.target, draft=args.draft, prompts=prompts, prompts_file=prompts_file,
                  files_dir=args.out / f"{name}-files", command_line=_command_line(args), say=console.print)
    # A CI timeout or `kill` sends SIGTERM, which would end this process without unwinding: the servers it started
    # (each in its own session) would keep running. As an exception, it stops them on the way out.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        result = bench.run()
    except (ServerStartError, BenchRequestError, CommandError, BenchError) as exc:
        return fail("bench", str(exc))
    finally:
        signal.signal(signal.SIGTERM, previous)
    json_path = write_model(args.out / f"{name}.json", result)
    md_path = write_atomic(args.out / f"{name}.md", markdown(result))
    # Each point and side as one `vllm bench serve --append-result` line, to be put beside a GPU host's runs.
    vllm_path = serve_bench.write(args.out / f"{name}.vllm_bench_serve.jsonl", bench.vllm_bench_form)
    console.print(f"results: {json_path}, {md_path}, {vllm_path}")
    print("Profile setting to use (serve/profiles/<profile>.yaml), by concurrency:")
    print(profile_setting(result.recommendations))
    return 0
