"""`kimi-eagle loadtest` (Locust against one server, or a sweep) and `kimi-eagle ab` (two servers in turn)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pydantic import ValidationError

from kimi_eagle.exit_status import fail
from kimi_eagle.loadtest import serve_bench
from kimi_eagle.loadtest.engines import ENGINES, EngineError, get_engine
from kimi_eagle.loadtest.prompts import PromptError, load_prompts
from kimi_eagle.loadtest.runner import LoadTestError, LoadTestInterrupted, LocustRun, run_locust
from kimi_eagle.loadtest.summary import EXIT_INTERRUPTED, RunSummary
from kimi_eagle.loadtest.workload import Workload, add_workload_options, workload_from_options
from kimi_eagle.processes import sigterm_as_keyboard_interrupt
from kimi_eagle.serve.profile import DEFAULT_PROFILE, load_profile


def register(sub: argparse._SubParsersAction) -> None:
    """Add `loadtest` and `ab` to `kimi-eagle`."""
    p = sub.add_parser("loadtest", help="drive a running server with Locust and report latency, throughput and "
                                        "speculative acceptance", description=__doc__)
    p.add_argument("--url", help="server base URL (default: where `make serve` listens, "
                                 f"{default_server_url()})")
    p.add_argument("--engine", default="vllm", choices=sorted(ENGINES), help="engine behind the URL")
    _workload_args(p)
    p.add_argument("--users", default="1", help="concurrent users; a comma list sweeps them (1,2,4)")
    p.add_argument("--request-rate", default="", help="open loop: total req/s (Poisson); a comma list sweeps")
    p.add_argument("--out", type=Path, help="results folder (default results/loadtest-<time>)")
    p.add_argument("--label", help="name of the run in the report")
    p.set_defaults(handler=run_loadtest)

    ab = sub.add_parser("ab", help="the same Locust workload against two servers in turn, side by side",
                        description="Runs A B A B ... (--rounds) with the same prompts, seed and output lengths, "
                                    "and writes DIR/report.md with ratios B/A and fairness checks.")
    for side in ("a", "b"):
        given = ab.add_mutually_exclusive_group(required=True)
        given.add_argument(f"--{side}", metavar="URL", help=f"server {side.upper()}, run here")
        given.add_argument(f"--{side}-result", metavar="FILE", type=Path,
                           help=f"side {side.upper()} recorded elsewhere: a `vllm bench serve --save-result` file "
                                "(or --append-result, one run a line: each is a round), e.g. from a GPU host")
        ab.add_argument(f"--{side}-engine", default="vllm", choices=sorted(ENGINES),
                        help="the engine behind it (for a recorded side: the engine it measured)")
    ab.add_argument("--rounds", type=int, default=2, help="rounds per side (2+ for verdicts; default 2)")
    _workload_args(ab)
    ab.add_argument("--users", type=int, default=1, help="concurrent users (same for both sides)")
    ab.add_argument("--request-rate", type=float, default=None, help="open loop: total req/s")
    ab.add_argument("--out", type=Path, help="results folder (default results/ab-<time>)")
    ab.set_defaults(handler=run_ab)


def default_server_url() -> str:
    """Where `make serve` (the default profile) listens, so that `make loadtest` needs no arguments beside it."""
    profile = load_profile(DEFAULT_PROFILE)
    return f"http://{profile.host}:{profile.port}"


def _workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    add_workload_options(g)
    g.add_argument("--run-time", default="30s", help="per run, Locust syntax (30s, 2m; default 30s)")
    g.add_argument("--spawn-rate", type=float, default=10.0, help="users started per second")
    g.add_argument("--max-requests", type=int, help="stop sending after this many requests")
    g.add_argument("--workers", type=int, default=0, help="Locust distributed mode: a master and N workers")



def _workload(args: argparse.Namespace, url: str, engine: str, rate: float | None) -> Workload:
    workload = workload_from_options(args, url=url, engine=engine, request_rate_per_s=rate)
    load_prompts(workload.prompts or "", workload.api, workload.seed)  # bad prompt files fail here, not in Locust
    # Always asked, --model or not: an unreachable server or a refused key fails here, in one clear line.
    served = get_engine(engine, url).served_model()
    workload.model = workload.model or served
    return workload


def _numbers(text: str, kind: type) -> list:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{text!r} is not a comma-separated list of numbers") from None


def print_summary(s: RunSummary) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{s.label or s.workload.url}: {s.requests.ok} ok, {s.requests.failed} failed")
    for column in ("figure", "mean", "p50", "p90", "p99"):
        table.add_column(column, justify="right" if column != "figure" else "left")
    for name, d in (("TTFT ms", s.ttft_ms), ("TPOT ms", s.tpot_ms), ("ITL/token ms", s.itl_per_token_ms),
                    ("inter-chunk ms", s.inter_chunk_latency_ms), ("latency ms", s.e2e_latency_ms),
                    ("tokens/chunk", s.tokens_per_chunk)):
        cells = [f"{v:.2f}" if d and (v := getattr(d, k)) is not None else "n/a" for k in ("mean", "p50", "p90", "p99")]
        table.add_row(name, *cells)
    console = Console(stderr=True)
    console.print(table)
    t, a = s.throughput, s.acceptance
    console.print(f"throughput: {t.output_tokens_per_s or 0:.1f} output tok/s, {t.requests_per_s or 0:.2f} req/s; "
                  f"tokens match server usage: {s.tokens.per_chunk_counts_match_usage}")
    if a is not None:
        console.print("acceptance: no speculation" if a.speculation == "off" else
                      f"acceptance: length {a.mean_acceptance_length}, rate {a.acceptance_rate}, per position "
                      f"{a.per_position_acceptance_rate}")


def _interrupted(command: str, exc: KeyboardInterrupt) -> None:
    summary = exc.summary if isinstance(exc, LoadTestInterrupted) else None
    if summary is not None:
        print_summary(summary)
    where = (f"; results so far in {exc.out_dir} (summary.json says interrupted)" if summary is not None else
             f"; Locust wrote no results in {exc.out_dir}" if isinstance(exc, LoadTestInterrupted) else "")
    print(f"kimi-eagle {command}: interrupted{where}", file=sys.stderr)


def run_loadtest(args: argparse.Namespace) -> int:
    try:
        with sigterm_as_keyboard_interrupt():
            return _run_loadtest(args)
    except KeyboardInterrupt:  # while the server is probed, or a second Ctrl-C while writing: nothing more to do
        print("kimi-eagle loadtest: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run_loadtest(args: argparse.Namespace) -> int:
    out = args.out or Path("results") / time.strftime("loadtest-%Y%m%d-%H%M%S")
    try:
        users = _numbers(args.users, int)
        rates = _numbers(args.request_rate, float) or [None]
        if len(users) > 1 and rates != [None]:
            return fail("loadtest", "sweep either --users or --request-rate, not both")
        if args.url is None:
            args.url = default_server_url()
            print(f"kimi-eagle loadtest: no --url: using {args.url}, where `make serve` listens", file=sys.stderr)
        workload = _workload(args, args.url, args.engine, None)
    except (ValueError, PromptError, EngineError, ValidationError) as exc:
        return fail("loadtest", str(exc))
    points = [(u, None) for u in users] if rates == [None] else [(users[0], r) for r in rates]
    summaries: list[RunSummary] = []
    folders: list[str] = []
    worst = 0
    try:
        for u, rate in points:
            folder = out if len(points) == 1 else out / (f"rate-{rate:g}" if rate else f"users-{u}")
            run = LocustRun(workload=workload.model_copy(update={"request_rate_per_s": rate}), out_dir=folder,
                            users=u, spawn_rate=args.spawn_rate, run_time=args.run_time, workers=args.workers,
                            max_requests=args.max_requests, label=args.label)
            name = str(folder.relative_to(out)) if folder != out else "."
            try:
                code, summary = run_locust(run)
            except LoadTestError as exc:
                return fail("loadtest", str(exc))
            except LoadTestInterrupted as exc:
                if exc.summary is not None:  # an interrupted point is kept, marked so in its summary
                    summaries.append(exc.summary)
                    folders.append(name)
                raise
            summaries.append(summary)
            folders.append(name)
            worst = max(worst, code)
            print_summary(summary)
    except KeyboardInterrupt as exc:
        _interrupted("loadtest", exc)
        if len(points) > 1 and summaries:
            _write_sweep(out, summaries, folders)
        return EXIT_INTERRUPTED
    if len(points) > 1:
        _write_sweep(out, summaries, folders)
    each = "" if len(points) == 1 else "*/"
    print(f"results: {out}/summary.json, {out}/report.md, {out}/{each}{serve_bench.FILE_NAME} (as `vllm bench serve` "
          "writes it)")
    return worst


def _write_sweep(out: Path, summaries: list[RunSummary], folders: list[str]) -> None:
    from kimi_eagle.loadtest.files import write_atomic, write_model
    from kimi_eagle.loadtest.report import plot_sweep, sweep_markdown
    from kimi_eagle.loadtest.summary import SweepSummary

    write_model(out / "summary.json", SweepSummary(points=summaries, folders=folders))
    plot_sweep(summaries, out / "throughput.png")
    write_atomic(out / "report.md", sweep_markdown(summaries, folders))


def run_ab(args: argparse.Namespace) -> int:
    try:
        with sigterm_as_keyboard_interrupt():
            return _run_ab(args)
    except KeyboardInterrupt:  # while the servers are probed, or a second Ctrl-C while writing
        print("kimi-eagle ab: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _run_ab(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        return fail("ab", "--rounds must be at least 1 (2 or more for verdicts)")
    out = args.out or Path("results") / time.strftime("ab-%Y%m%d-%H%M%S")
    rounds: dict[str, list[RunSummary]] = {"A": [], "B": []}
    folders: dict[str, list[str]] = {"A": [], "B": []}
    live: dict[str, Workload] = {}
    try:
        for side in ("A", "B"):
            url, recorded, engine = (getattr(args, f"{side.lower()}{suffix}") for suffix in ("", "_result", "_engine"))
            if recorded is None:
                live[side] = _workload(args, url, engine, args.request_rate)
                continue
            results = serve_bench.read(recorded)
            rounds[side] = [serve_bench.as_run_summary(r, engine, recorded) for r in results]
            folders[side] = [f"{recorded} (run {i + 1})" for i in range(len(results))]
    except (ValueError, PromptError, EngineError, ValidationError) as exc:
        return fail("ab", str(exc))
    worst = 0
    try:
        for r in range(1, args.rounds + 1):
            for side, workload in live.items():
                folder = f"round{r}-{side}"
                run = LocustRun(workload=workload, out_dir=out / folder, users=args.users,
                                spawn_rate=args.spawn_rate, run_time=args.run_time, workers=args.workers,
                                max_requests=args.max_requests, label=f"{side} round {r}")
                try:
                    code, summary = run_locust(run)
                except LoadTestError as exc:
                    return fail("ab", f"{side} round {r}: {exc}")
                rounds[side].append(summary)
                folders[side].append(folder)
                worst = max(worst, code)
                print_summary(summary)
    except KeyboardInterrupt as exc:
        _interrupted("ab", exc)
        # Only whole rounds are compared: an interrupted one stays in its folder, out of the report.
        complete = min(len(rounds[side]) for side in live) if live else 0
        if complete:
            _write_ab(args, out, {k: v[:complete] if k in live else v for k, v in rounds.items()},
                      {k: v[:complete] if k in live else v for k, v in folders.items()})
        return EXIT_INTERRUPTED
    _write_ab(args, out, rounds, folders)
    return worst


def _write_ab(args: argparse.Namespace, out: Path, rounds: dict[str, list[RunSummary]],
              folders: dict[str, list[str]]) -> None:
    from kimi_eagle.loadtest.ab import AbSummary, SideRounds, fairness_checks, write_ab

    summary = AbSummary(
        a=SideRounds(url=args.a or f"recorded: {args.a_result}", engine=args.a_engine, rounds=rounds["A"],
                     folders=folders["A"]),
        b=SideRounds(url=args.b or f"recorded: {args.b_result}", engine=args.b_engine, rounds=rounds["B"],
                     folders=folders["B"]),
        fairness=fairness_checks(rounds["A"][-1].server_config, rounds["B"][-1].server_config, rounds["A"],
                                 rounds["B"]))
    for check in summary.fairness:
        print(f"fairness: {check.setting}: A={check.a} B={check.b}: {check.verdict}")
    write_ab(out, summary)
    print(f"report: {out}/report.md")
