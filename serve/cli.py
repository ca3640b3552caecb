"""`kimi-eagle serve` and `kimi-eagle fixtures`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kimi_eagle.adapter import compat
from kimi_eagle.adapter.compat import UNGUARDED_FLAG
from kimi_eagle.cpu_kernels import kernel_report
from kimi_eagle.exit_status import fail
from kimi_eagle.serve.command import CommandError, ServeCommand, build_command
from kimi_eagle.serve.launch import ServerStartError, build_fixture_weights, serve_in_foreground
from kimi_eagle.serve.profile import DEFAULT_PROFILE, ProfileError, available_profiles, load_profile
from kimi_eagle.serve.validate import validate_with_vllm


def register(sub: argparse._SubParsersAction) -> None:
    add_serve_parser(sub)
    add_fixtures_parser(sub)


def add_pair_options(p: argparse.ArgumentParser) -> None:
    """The profile, and what may override its pair: the options every command that starts a server takes."""
    p.add_argument("profile", nargs="?", default=DEFAULT_PROFILE,
                   help=f"profile name ({', '.join(available_profiles())}) or a YAML path")
    p.add_argument("--target", help="target checkpoint folder or hub name (overrides the profile)")
    p.add_argument("--draft", help="EAGLE-3 draft folder (overrides the profile)")
    p.add_argument("--no-draft", action="store_true", help="the target alone, without speculation")
    p.add_argument("--num-speculative-tokens", "-k", type=int, help="draft tokens per step (overrides the profile)")


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a profile with vLLM's OpenAI-compatible server",
                       description="Serve target + EAGLE-3 draft from a profile. Anything after `--` goes to vLLM "
                                   "unchanged and overrides the profile's flags.")
    add_pair_options(p)
    p.add_argument("--host", help="address to bind (default 127.0.0.1; others need an API key)")
    p.add_argument("--port", type=int, help="port (default from the profile)")
    p.add_argument("--api-key", help="require this key from clients; prefer VLLM_API_KEY=KEY in the environment "
                                     "(a key on the command line shows in `ps` to every user of the machine)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the vLLM command, validated by vLLM's parser, and exit")
    p.add_argument("--ready-timeout", type=float, default=600, help="seconds to wait for /health (default 600)")
    p.add_argument(UNGUARDED_FLAG, action="store_true",
                   help="serve a draft on a vLLM release kimi-eagle's guards were not written for, with every guard "
                        "and fix off (refused without it)")
    p.set_defaults(handler=run_serve)



def run_serve(args: argparse.Namespace) -> int:
    started_at = time.perf_counter()
    extra = args.passthrough
    try:
        profile = load_profile(args.profile)
        command = build_command(profile, target=args.target, draft=args.draft, no_draft=args.no_draft,
                                num_speculative_tokens=args.num_speculative_tokens, host=args.host,
                                port=args.port, api_key=args.api_key, extra_args=extra)
    except (ProfileError, CommandError) as exc:
        return fail("serve", str(exc))
    from kimi_eagle.serve.preflight import address_is_free, flag_value, preflight

    machine = kernel_report()  # first: a speed or a fault seen here may be this ISA's (BENCHMARKS.md names each)
    if machine:
        named = flag_value(command.argv, "--attention-backend")
        print(f"kimi-eagle serve: {machine.line(named)}", file=sys.stderr, flush=True)

    print(f"kimi-eagle serve: {guards_line()}", file=sys.stderr, flush=True)
    if command.draft and not compat.supported():
        if not args.unguarded:
            return fail("serve", f"{compat.unsupported_reason()}. With this draft its guards would be off, and the "
                                 "silent failures they refuse (aux layers the draft was not trained on, unfilled "
                                 "draft parameters, a collapsed acceptance) would go unnoticed: nothing was "
                                 f"started. Install a supported vLLM (`make setup`), or serve unguarded anyway with "
                                 f"{UNGUARDED_FLAG}.")
        print(f"kimi-eagle serve: {UNGUARDED_FLAG}: serving the draft with every guard and fix off",
              file=sys.stderr, flush=True)

    build_fixture_weights(command)  # the real-width fixture pair, on its first use (minutes)
    # The files first: seconds, and nothing is started when they are wrong.
    if not preflight(command):
        return fail("serve", "pre-flight found problems that would make the served pair fail or run crippled (above); "
                     "fix them, or run `kimi-eagle doctor` for the full report")
    if args.dry_run:
        try:
            report = validate_with_vllm(command)
        except CommandError as exc:
            return fail("serve", str(exc))
        print(report.render(), file=sys.stderr)  # stdout keeps only the command, for scripts
        print(command.printable())
        return 0
    if not address_is_free(command):
        return fail("serve", f"{command.url} is taken: nothing was started")
    note = f"  draft: {command.draft}" if command.draft else "  (no speculation)"
    try:
        # vLLM's own checks of the flags and the engine config take seconds, most of them importing vLLM, which the
        # server does too before it loads anything: both at once, and a refusal stops the server.
        return serve_in_foreground(command, "vLLM", args.ready_timeout, ready_note=note,
                                   check_while_starting=lambda: vllm_refusal(command), started_at=started_at)
    except ServerStartError as exc:
        return fail("serve", str(exc))


def guards_line() -> str:
    """The installed vLLM, the runner it serves EAGLE-3 with here, and how many of the plugin's guards act on it."""
    from kimi_eagle.adapter.runners import runner_here
    from kimi_eagle.adapter.surface import FEATURES

    version = compat.vllm_version()
    if not compat.supported():
        return f"vLLM {version}: none of kimi-eagle's guards and fixes (written for " \
               f"{', '.join(compat.SUPPORTED_VLLM_VERSIONS)})"
    runner, why = runner_here()
    active = sum(f.active_on(runner) for f in FEATURES)
    return (f"vLLM {version}, Model Runner {runner} here ({why}): {active} of {len(FEATURES)} guards and fixes "
            "active on it (`kimi-eagle doctor` shows which)")


def vllm_refusal(command: ServeCommand) -> str | None:
    """Why vLLM's parser or config classes refuse the command (`validate_with_vllm`), or None."""
    try:
        validate_with_vllm(command)
    except CommandError as exc:
        return str(exc)
    return None


def add_fixtures_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fixtures", help="the tiny Kimi-K2.5 model pair shipped with the project, and its lift to "
                                        "Kimi-K2.5's real widths")
    p.add_argument("--where", action="store_true", help="print target=DIR and draft=DIR")
    p.add_argument("--rebuild", action="store_true",
                   help="train the pair again from the local corpus (about an hour on 2 cores)")
    p.add_argument("--work", type=Path, default=Path(".fixtures-work"), help="scratch folder for --rebuild")
    p.add_argument("--real-width", action="store_true",
                   help="the tiny pair lifted to Kimi-K2.5's widths (hidden 7168, vocabulary 163840, fc 21504 -> "
                        "7168): built on this machine on first use (about 13 GB, a few minutes), then reused")
    p.set_defaults(handler=run_fixtures)


def run_fixtures(args: argparse.Namespace) -> int:
    from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR

    if args.rebuild:
        from kimi_eagle.fixtures.build import rebuild

        rebuild(args.work)
    if args.real_width:
        from kimi_eagle.fixtures.real_width import ensure_built

        built = ensure_built()
        print(f"target={built.target}\ndraft={built.draft}")
        return 0
    if args.where or not args.rebuild:
        missing = [str(d) for d in (TARGET_DIR, DRAFT_DIR) if not (d / "model.safetensors").is_file()]
        if missing:
            print(f"missing: {', '.join(missing)}: run `kimi-eagle fixtures --rebuild`", file=sys.stderr)
            return 1
        print(f"target={TARGET_DIR}\ndraft={DRAFT_DIR}")
    return 0
