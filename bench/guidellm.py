"""`kimi-eagle bench guidellm`: GuideLLM, the vLLM project's benchmark, beside `kimi-eagle loadtest`.

Two servers, one at a time: the profile as `make serve` starts it, and the same profile with `--no-draft`. On each,
for every temperature and number of streams of the plan: GuideLLM on its own synthetic prompts, GuideLLM on the
held-out prompts, and `kimi-eagle loadtest` on the same held-out prompts, each for the same seconds. Both tools read
streamed answers; the held-out rows let the two be compared on one workload, the synthetic rows show what a user who
runs GuideLLM as its README says would see.

GuideLLM is an optional peer, not a dependency: GuideLLM 0.8.1 would take click and multidict back to versions below
the ones requirements/cpu.lock pins for vLLM (8.4.2 for 8.5.1, 6.9.1 for 7.2.1: `pip install --dry-run`), so it
lives in a virtual environment of its own (`make guidellm`, `.venv-guidellm`), found here by `KIMI_EAGLE_GUIDELLM`
or that folder, and runs as a program. Its request body carries the temperature explicitly:
GuideLLM sends none by default, and vLLM then samples at 1.0 (the tiny target's generation config sets none). The
latest run's figures: BENCHMARKS.md (`kimi-eagle bench render`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure
from pydantic import BaseModel, Field

from kimi_eagle import envs
from kimi_eagle.bench.machine import machine_now
from kimi_eagle.bench.plots import Plot, draw, log2_axis, reference
from kimi_eagle.bench.result import Machine, ModeResults, fault_named, run_line
from kimi_eagle.bench.servers import measured_server
from kimi_eagle.bench.subcommand import BenchError, MeasuringRun, add_run_options, plan_of
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.profile import Profile, resolve_model_path

GUIDELLM_ENV = "KIMI_EAGLE_GUIDELLM"
GUIDELLM_VENV = Path(".venv-guidellm")
PROFILE, FIXED, ALONE = "profile", "profile, fixed k", "--no-draft"
CONFIGS = (PROFILE, FIXED, ALONE)  # as `make serve` (the engine measures k), its schedule as written, the target alone
AGREEMENT = 0.15  # the two tools' tokens/s on one server and workload: farther apart than this is called out


class GuideLLMMissingError(BenchError):
    pass


class GuideLLMRunError(BenchError):
    pass


class GuideLLMPlan(BaseModel):
    mode: str
    streams: list[int]
    temperatures: list[float]
    seconds: int = Field(ge=3, description="Of each measurement, GuideLLM's and the load test's alike.")
    max_tokens: int = Field(ge=2, description="Output tokens of every request (ignore_eos).")
    synthetic_prompt_tokens: int = Field(ge=1)
    warmup_seconds: int = Field(0, ge=0, description="Load at each number of streams (T 1, held-out prompts) that "
                                "the profile's server serves before its measurements, so that the engine's measured "
                                "k has seen every batch size it is then measured at, as a server that has served a "
                                "while has; not measured.")


FULL = GuideLLMPlan(mode="guidellm", streams=[1, 4, 16], temperatures=[1.0, 0.0], seconds=20, max_tokens=128,
                    synthetic_prompt_tokens=64, warmup_seconds=120)
QUICK = GuideLLMPlan(mode="guidellm-quick", streams=[1], temperatures=[1.0], seconds=5, max_tokens=32,
                     synthetic_prompt_tokens=64)


class Figures(BaseModel):
    output_tokens_per_s: float
    itl_ms: float | None = Field(description="Mean inter-token latency.")
    requests: int
    client_cpu_s: float | None = Field(None, description="CPU seconds the tool's processes used: on a machine of "
                                                         "few cores, the client competes with the server.")
    measured_k: str | None = Field(None, description="The engine's k per batch-size range at the end of the "
                                                     "measurement, as `kimi-eagle loadtest` read it from /metrics.")


class Row(BaseModel):
    config: str
    temperature: float
    streams: int
    data: str = Field(description="`synthetic` (GuideLLM's) or `held-out` (the pair's held-out prompts).")
    guidellm: Figures
    loadtest: Figures | None = Field(None, description="`kimi-eagle loadtest` on the same server and prompts.")


class GuideLLMResult(BaseModel):
    command: str
    started_utc: str
    duration_s: float
    machine: Machine
    profile: str
    guidellm_version: str
    plan: GuideLLMPlan
    rows: list[Row]
    verdict: str
    fault: str | None = Field(None, description="KIMI_EAGLE_FAULT the servers ran with: a machine made one where "
                                                "drafting costs (`slow-draft`), on purpose.")


def find_guidellm() -> Path:
    """The `guidellm` program: `$KIMI_EAGLE_GUIDELLM`, else `.venv-guidellm/bin/guidellm`."""
    wanted = os.environ.get(GUIDELLM_ENV)
    path = Path(wanted) if wanted else GUIDELLM_VENV / "bin" / "guidellm"
    if not path.is_file():
        raise GuideLLMMissingError(f"GuideLLM is not installed ({path} does not exist): `make guidellm` installs it in "
                              f"{GUIDELLM_VENV}/, apart from vLLM's environment (their pins differ), or set "
                              f"{GUIDELLM_ENV} to a `guidellm` program")
    return path


def guidellm_version(program: Path) -> str:
    done = subprocess.run([str(program), "--version"], capture_output=True, text=True, timeout=120)
    return done.stdout.strip().rsplit(" ", 1)[-1] or "unknown"


def guidellm_command(program: Path, *, url: str, model: str, tokenizer: Path, data: str, streams: int,
                     seconds: int, temperature: float, out: Path) -> list[str]:
    """A `guidellm run` of `streams` concurrent streams for `seconds` on `data` (a GuideLLM data argument)."""
    return [str(program), "run",
            "--backend", f"kind=openai_http,target={url},model={model},request_format=/v1/completions,"
                         f"extras.body.temperature={temperature:g}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
            "--profile", f"kind=concurrent,streams=[{streams}]",
            "--constraint", f"kind=max_duration,seconds={seconds}",
            "--data", data, "--output", f"kind=json,path={out}", "--disable-progress"]


def read_guidellm(path: Path) -> Figures:
    """GuideLLM's figures as its console prints them: output tokens/s of all requests (its server throughput
    table: the run ends mid-request, and that request's tokens count), inter-token latency of completed ones."""
    [benchmark] = json.loads(path.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    return Figures(output_tokens_per_s=metrics["output_tokens_per_second"]["total"]["mean"],
                   itl_ms=metrics["inter_token_latency_ms"]["successful"]["mean"],
                   requests=metrics["request_totals"]["successful"])


def read_loadtest(summary: Path) -> Figures:
    data = json.loads(summary.read_text())
    ranges = (data.get("acceptance") or {}).get("measured_k")
    return Figures(output_tokens_per_s=data["throughput"]["output_tokens_per_s"],
                   itl_ms=data["itl_per_token_ms"]["mean"], requests=data["requests"]["ok"],
                   measured_k=", ".join(f"{r['batch_sizes']}: {r['k']}" for r in ranges) if ranges else None)


def heldout_jsonl(prompts: list[str], out: Path, *, output_tokens: int | None = None) -> Path:
    """The prompts as a JSON-lines file: `{"prompt": ...}` a line, as the load test reads them; with
    `output_tokens`, each line also carries GuideLLM's `output_tokens_count` (it asks for that many, ignore_eos)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [{"prompt": p} | ({"output_tokens_count": output_tokens} if output_tokens else {}) for p in prompts]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


class GuideLLMBench:
    def __init__(self, plan: GuideLLMPlan, profile: Profile, *, target: str | None, draft: str | None,
                 prompts: list[str], files_dir: Path, command_line: str, say: Callable[[str], None]) -> None:
        self.program = find_guidellm()
        self.plan, self.profile, self.target, self.draft = plan, profile, target, draft
        self.files_dir, self.command_line, self.say = files_dir, command_line, say
        self.heldout = heldout_jsonl(prompts, files_dir / "heldout.jsonl")
        self.heldout_guidellm = heldout_jsonl(prompts, files_dir / "heldout-guidellm.jsonl",
                                              output_tokens=plan.max_tokens)
        self.tokenizer = Path(resolve_model_path(target or profile.target))

    def run(self) -> GuideLLMResult:
        started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0, load_before = time.perf_counter(), os.getloadavg()
        rows: list[Row] = []
        for config in CONFIGS:
            rows += self._measure(config)
        return GuideLLMResult(command=self.command_line, started_utc=started_utc,
                              duration_s=time.perf_counter() - t0, machine=machine_now(load_before),
                              profile=self.profile.name, guidellm_version=guidellm_version(self.program),
                              plan=self.plan, rows=rows, verdict=verdict(rows), fault=envs.fault() or None)

    def _measure(self, config: str) -> list[Row]:
        command = build_command(self.profile, target=self.target, draft=self.draft, no_draft=config == ALONE,
                                port=free_port())
        command.env[envs.MEASURED_K.name] = "0" if config == FIXED else "1"
        log = self.files_dir / "logs" / f"{CONFIGS.index(config)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        data = {"synthetic": f"kind=synthetic_text,prompt_tokens={self.plan.synthetic_prompt_tokens},"
                             f"output_tokens={self.plan.max_tokens}",
                "held-out": f"kind=json_file,path={self.heldout_guidellm}"}
        rows = []
        with measured_server(command, config=config, num_speculative_tokens=None, log=log) as live:
            if config == PROFILE and self.plan.warmup_seconds:
                for streams in self.plan.streams:
                    self.say(f"  {config}: {self.plan.warmup_seconds} s of load at {streams} stream(s) before "
                             "measuring (the engine measures its k per batch size meanwhile)")
                    self._loadtest(live.url, 1.0, streams, self.files_dir / f"warmup-s{streams}",
                                   seconds=self.plan.warmup_seconds)
            for temperature in self.plan.temperatures:
                for streams in self.plan.streams:
                    for name, argument in data.items():
                        out = self.files_dir / f"{CONFIGS.index(config)}-t{temperature:g}-s{streams}-{name}.json"
                        cpu = self._run([*guidellm_command(
                            self.program, url=live.url, model=live.model, tokenizer=self.tokenizer, data=argument,
                            streams=streams, seconds=self.plan.seconds, temperature=temperature, out=out)],
                            out.with_suffix(".log"))
                        row = Row(config=config, temperature=temperature, streams=streams, data=name,
                                  guidellm=read_guidellm(out).model_copy(update={"client_cpu_s": cpu}))
                        if name == "held-out":
                            row.loadtest = self._loadtest(live.url, temperature, streams, out.with_suffix(""))
                        rows.append(row)
                        self.say(f"  {config}, T {temperature:g}, {streams} stream(s), {name}: GuideLLM "
                                 f"{row.guidellm.output_tokens_per_s:.0f} tok/s"
                                 + (f", kimi-eagle loadtest {row.loadtest.output_tokens_per_s:.0f} tok/s"
                                    if row.loadtest else ""))
        return rows

    def _loadtest(self, url: str, temperature: float, streams: int, out: Path, seconds: int | None = None) -> Figures:
        seconds = seconds or self.plan.seconds
        cpu = self._run([sys.executable, "-m", "kimi_eagle.cli", "loadtest", "--url", url, "--prompts",
                         str(self.heldout), "--max-tokens", str(self.plan.max_tokens), "--temperature",
                         f"{temperature:g}", "--users", str(streams), "--run-time", f"{seconds}s", "--out",
                         str(out)], out.with_suffix(".loadtest.log"), seconds)
        return read_loadtest(out / "summary.json").model_copy(update={"client_cpu_s": cpu})

    def _run(self, argv: list[str], log: Path, seconds: int | None = None) -> float:
        """Run a tool to its end; the CPU seconds it and its children used."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with log.open("w") as sink:
            done = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT,
                                  timeout=(seconds or self.plan.seconds) + 600)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            tail = log.read_text()[-1500:]
            raise GuideLLMRunError(f"{Path(argv[0]).name} {' '.join(argv[1:3])} exited with {done.returncode} "
                                   f"(log {log}):\n{tail}")
        # Only children that ended count, so the server (still running) is not in it.
        return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def ratio_to_no_draft(rows: list[Row], row: Row, tool: str) -> float | None:
    alone = next((r for r in rows if r.config == ALONE and (r.temperature, r.streams, r.data)
                  == (row.temperature, row.streams, row.data)), None)
    mine, theirs = getattr(row, tool), getattr(alone, tool, None) if alone else None
    return mine.output_tokens_per_s / theirs.output_tokens_per_s if mine and theirs else None


NEVER_BELOW = 0.98  # of --no-draft's tokens/s: what "speculation never costs" allows for measuring noise


def never_costs(rows: list[Row]) -> str:
    """The profile's worst ratio to --no-draft per tool, and how it fares against its schedule as written where that
    schedule beats --no-draft: the two things the measured k must show."""
    parts = []
    for tool, name in (("guidellm", "GuideLLM"), ("loadtest", "kimi-eagle loadtest")):
        mine = [(r, ratio) for r in rows if r.config == PROFILE and (ratio := ratio_to_no_draft(rows, r, tool))]
        if not mine:
            continue
        worst, lowest = min(mine, key=lambda pair: pair[1])
        below = sum(ratio < NEVER_BELOW for _, ratio in mine)
        text = (f"{name}: the profile's lowest {lowest:.2f}x --no-draft (T {worst.temperature:g}, {worst.streams} "
                f"stream(s), {worst.data}), {below} of {len(mine)} row(s) below {NEVER_BELOW:g}x")
        fixed = {(r.temperature, r.streams, r.data): ratio for r in rows if r.config == FIXED
                 and (ratio := ratio_to_no_draft(rows, r, tool))}
        wins = [(ratio, fixed[key]) for r, ratio in mine
                if (key := (r.temperature, r.streams, r.data)) in fixed and fixed[key] > 1]
        if wins:
            share = [ratio / theirs for ratio, theirs in wins]
            text += (f"; where the fixed k beats --no-draft ({len(wins)} row(s)) the profile has {min(share):.2f}-"
                     f"{max(share):.2f} of its ratio")
        parts.append(text)
    return "; ".join(parts)


def verdict(rows: list[Row]) -> str:
    parts = []
    for row in rows:
        if row.config == ALONE:
            continue
        ratio = ratio_to_no_draft(rows, row, "guidellm")
        if ratio is not None:
            parts.append(f"{row.config}, T {row.temperature:g}, {row.streams} stream(s), {row.data}: "
                         f"{ratio:.2f}x --no-draft")
    apart = [r for r in rows if r.loadtest and abs(r.guidellm.output_tokens_per_s / r.loadtest.output_tokens_per_s
                                                    - 1) > AGREEMENT]
    agree = f"GuideLLM and kimi-eagle loadtest within {AGREEMENT:.0%} of each other on every held-out row"
    if apart:
        agree = f"the two tools differ by more than {AGREEMENT:.0%} on {len(apart)} held-out row(s)"
        cpu = [r.guidellm.client_cpu_s / r.loadtest.client_cpu_s for r in apart
               if r.guidellm.client_cpu_s and r.loadtest.client_cpu_s]
        if cpu:
            # On a machine of few cores the client's CPU is the server's loss.
            agree += (f" (there GuideLLM's client used {min(cpu):.1f}-{max(cpu):.1f}x the CPU of the load test's, "
                      f"{os.cpu_count()} CPUs shared with the server)")
    costs = never_costs(rows)
    return (f"{costs}. " if costs else "") + "GuideLLM: " + "; ".join(parts) + f"; {agree}"


def markdown(result: GuideLLMResult) -> str:
    lines = [f"# GuideLLM {result.guidellm_version} beside kimi-eagle loadtest, profile {result.profile}"
             f"{_made_with(result)}", "",
             run_line(result.command, result.started_utc, result.duration_s, result.machine)
             + f"{result.plan.seconds} s per measurement, {result.plan.max_tokens} output tokens per request "
             "(ignore_eos), streamed, one server at a time"
             + (f"; the profile's server first served {result.plan.warmup_seconds} s at each number of streams"
                if result.plan.warmup_seconds else "")
             + (f"; every server ran with {envs.FAULT.name}={result.fault} (a machine where drafting costs, made on "
                "purpose)" if result.fault else "") + ".", "",
             "Output tokens/s (mean inter-token latency, ms; CPU seconds the client used); `x` is the ratio to the "
             "same row with `--no-draft`.", "",
             "| server | T | streams | prompts | GuideLLM | x | kimi-eagle loadtest | x | loadtest / GuideLLM | k in "
             "force at the end (batch sizes: k) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def cell(f: Figures | None) -> str:
        if f is None:
            return ""
        details = [f"{f.itl_ms:.2f} ms" if f.itl_ms is not None else None,
                   f"{f.client_cpu_s:.0f} CPU s" if f.client_cpu_s is not None else None]
        shown = "; ".join(d for d in details if d)
        return f"{f.output_tokens_per_s:.0f}" + (f" ({shown})" if shown else "")

    def x(row: Row, tool: str) -> str:
        ratio = ratio_to_no_draft(result.rows, row, tool) if row.config != ALONE else None
        return "" if ratio is None else f"{ratio:.2f}"

    for r in result.rows:
        agreement = (f"{r.loadtest.output_tokens_per_s / r.guidellm.output_tokens_per_s:.2f}" if r.loadtest else "")
        lines.append(f"| {r.config} | {r.temperature:g} | {r.streams} | {r.data} | {cell(r.guidellm)} | "
                     f"{x(r, 'guidellm')} | {cell(r.loadtest)} | {x(r, 'loadtest')} | {agreement} | "
                     f"{r.loadtest.measured_k or '' if r.loadtest else ''} |")
    lines += ["", f"**{result.verdict}.**", ""]
    return "\n".join(lines)


def plots(result: GuideLLMResult, folder: Path) -> list[Plot]:
    """Each tool's tokens/s over the same row with --no-draft, by streams, one panel per temperature."""
    temperatures = result.plan.temperatures
    series = [(config, tool, data) for config in CONFIGS if config != ALONE
              for tool, data in (("guidellm", "synthetic"), ("guidellm", "held-out"), ("loadtest", "held-out"))
              if any(r.config == config for r in result.rows)]
    names = {"guidellm": "GuideLLM", "loadtest": "kimi-eagle loadtest"}

    def paint(figure: Figure) -> None:
        axes = figure.subplots(1, len(temperatures), sharey=True, squeeze=False)[0]
        for ax, temperature in zip(axes, temperatures):
            for config, tool, data in series:
                rows = sorted((r for r in result.rows if (r.config, r.temperature, r.data) == (config, temperature,
                                                                                               data)),
                              key=lambda r: r.streams)
                points = [(r.streams, ratio) for r in rows if (ratio := ratio_to_no_draft(result.rows, r, tool))]
                if points:
                    ax.plot(*zip(*points), marker="o", linestyle="-" if config == PROFILE else "--",
                            label=f"{config}: {names[tool]}, {data}")
            reference(ax, 1.0, ALONE)
            log2_axis(ax, result.plan.streams, "streams")
            ax.set_title(f"T {temperature:g}", fontsize="small")
            ax.grid(axis="y", alpha=0.3)
        axes[0].set_ylabel("tokens/s over --no-draft (x)")
        axes[-1].legend(fontsize="x-small")

    return [draw(folder / f"{fault_named('guidellm', result.fault)}-speedup-over-no-draft.png",
                 f"GuideLLM {result.guidellm_version} beside kimi-eagle loadtest ({result.started_utc[:10]}"
                 f"{_made_with(result)})", paint, size=(9.0, 4.0))]


def _made_with(result: GuideLLMResult) -> str:
    return f", {envs.FAULT.name}={result.fault}" if result.fault else ""


RESULTS = ModeResults(mode="guidellm", prefix=FULL.mode, model=GuideLLMResult, markdown=markdown, plots=plots)


def register(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("guidellm", help="GuideLLM (installed apart by `make guidellm`) beside kimi-eagle loadtest, "
                                          "against the profile and --no-draft",
                         description="GuideLLM, the vLLM project's benchmark, beside kimi-eagle loadtest against the "
                                     "profile and against --no-draft, one server at a time: GuideLLM's synthetic "
                                     "prompts and the held-out prompts (both tools), at T 1 and 0, 1, 4 and 16 "
                                     "streams. Writes OUT/guidellm-<time>.json and .md.")
    add_run_options(p, quick="T 1 and 1 stream, 2 minutes; its figures are not for comparison")
    p.add_argument("--streams", type=_numbers(int), help=f"streams to measure at, e.g. 1,4 (default "
                                                         f"{','.join(map(str, FULL.streams))})")
    p.add_argument("--temperatures", type=_numbers(float), help="temperatures, e.g. 1,0 (default 1,0)")
    p.add_argument("--warmup", type=int, metavar="SECONDS",
                   help=f"load the profile's server serves at each number of streams before it is measured (default "
                        f"{FULL.warmup_seconds}; with --quick 0)")
    p.set_defaults(run=run)


def _numbers(kind: type) -> Callable[[str], list]:
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
        if not values or any(v < 0 for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: give numbers of 0 or more, comma-separated")
        return values

    return parse


def run(args: argparse.Namespace) -> int:
    find_guidellm()  # before anything starts: it is installed apart
    plan = plan_of(FULL, QUICK, args)
    chosen = {"streams": args.streams, "temperatures": args.temperatures, "warmup_seconds": args.warmup}
    plan = plan.model_copy(update={key: value for key, value in chosen.items() if value is not None})
    # guidellm-slow-draft-<time>.json: `bench render` never takes it for the plain mode's latest run.
    measuring = MeasuringRun.start(args, fault_named(plan.mode, envs.fault()))
    result = GuideLLMBench(plan, measuring.profile, **measuring.bench_options).run()
    measuring.write(result, markdown)
    print(result.verdict)
    return 0
