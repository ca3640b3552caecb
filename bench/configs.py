"""`kimi-eagle bench configs`: which way of serving the same pair is fastest on this machine, streamed and not.

The matrix is dtype (float32, bfloat16) x process and core layout x target alone or with its draft. The layouts:
both cores bound to the engine's worker; vLLM's own default, which leaves a core to the API server, with the engine
core on the worker's cores as the plugin puts it, or floating, as vLLM leaves it; and vLLM's uniprocess executor,
the worker inside the engine core process (`--distributed-executor-backend uni` with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's own switches), which saves the engine core's round trips to a worker
process on every step. Plain `vllm serve MODEL` is "bfloat16, alone, vLLM's default layout". One server runs at a
time (two would share the 2 cores); each round starts every configuration once, in an order rotated by round, so
that the machine's drift (this one's speed moves by a third within minutes) spreads over all of them. At each load,
a draft configuration is compared round by round with the configuration without a draft whose median there is
highest (not with the best of them in each round: the highest of several noisy samples is biased upwards). The latest
run's figures: BENCHMARKS.md (`kimi-eagle bench render`).
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from matplotlib.figure import Figure
from pydantic import BaseModel, Field

from kimi_eagle import envs
from kimi_eagle.bench.client import BenchClient, Sample
from kimi_eagle.bench.machine import machine_now
from kimi_eagle.bench.plan import StreamsPlan, rotated
from kimi_eagle.bench.plots import Plot, draw, reference
from kimi_eagle.bench.result import Machine, ModeResults, run_line, summed_acceptance
from kimi_eagle.bench.servers import measured_server
from kimi_eagle.bench.stats import Spread, spread
from kimi_eagle.bench.subcommand import BenchError, MeasuringRun, add_run_options, plan_of
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.profile import Profile

BIND_ENV = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU")
# vLLM's CPU platform turns `uni` back into `mp` unless V1 multiprocessing is off (vllm/platforms/cpu.py); the API
# server still runs the engine core in a process of its own either way.
IN_PROCESS_ARGS = {"distributed-executor-backend": "uni"}
IN_PROCESS_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# The reference MLA kernel: fp32 runs only there (AMX_MLA, which vLLM picks where the CPU has AMX, needs bf16).
FLOAT32_ATTENTION = "CPU_MLA"


class ServingConfig(BaseModel):
    dtype: Literal["float32", "bfloat16"]
    cores: Literal["bound", "vllm-default", "vllm-floating", "in-process"] = Field(
        description="`bound`: every core to the worker's OpenMP threads (none reserved); `vllm-default`: vLLM's own "
                    "layout, the engine core on the worker's cores (the plugin's `adapter/cpu_layout.py`); "
                    "`vllm-floating`: vLLM's layout as vLLM leaves it, the engine core unbound; `in-process`: "
                    "vLLM's uniprocess executor, the worker inside the engine core process, nothing bound.")
    draft: bool

    @property
    def name(self) -> str:
        return f"{self.dtype} {'+ draft' if self.draft else 'alone'}, cores {self.cores}"

    def profile(self, base: Profile) -> Profile:
        """The base profile served this way (its model, KV cache and limits unchanged)."""
        named_here = {"attention-backend", *IN_PROCESS_ARGS}
        vllm_args = {k: v for k, v in base.vllm_args.items() if k.replace("_", "-") not in named_here}
        vllm_args["dtype"] = self.dtype
        if self.dtype == "float32":
            vllm_args["attention-backend"] = FLOAT32_ATTENTION
        env = {k: v for k, v in base.env.items() if k not in {*BIND_ENV, *IN_PROCESS_ENV}}
        if self.cores == "in-process":
            vllm_args |= IN_PROCESS_ARGS
            env |= IN_PROCESS_ENV
        if self.cores == "vllm-floating":
            env[envs.CPU_LAYOUT.name] = "vllm"
        if self.cores == "bound":
            cpus = sorted(os.sched_getaffinity(0))
            env |= {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        return base.model_copy(update={"vllm_args": vllm_args, "env": env})


MATRIX = [ServingConfig(dtype=d, cores=c, draft=s)
          for d in ("float32", "bfloat16") for c in ("bound", "vllm-default", "vllm-floating", "in-process")
          for s in (False, True)]


class LoadPoint(BaseModel):
    stream: bool
    concurrency: int = Field(ge=1)

    @property
    def name(self) -> str:
        return f"{'streamed' if self.stream else 'not streamed'}, {self.concurrency} in flight"


class ConfigsPlan(StreamsPlan):
    mode: str
    configs: list[ServingConfig]
    points: list[LoadPoint]
    rounds: int = Field(ge=1)
    max_tokens: int = Field(ge=2)


FULL = ConfigsPlan(mode="configs", configs=MATRIX, rounds=3, max_tokens=64, requests_per_stream=8,
                   points=[LoadPoint(stream=True, concurrency=1), LoadPoint(stream=True, concurrency=4),
                           LoadPoint(stream=False, concurrency=1), LoadPoint(stream=False, concurrency=16)])
QUICK = ConfigsPlan(mode="configs-quick", rounds=1, max_tokens=16, requests_per_stream=2,
                    configs=[c for c in MATRIX if c.dtype == "bfloat16" and c.cores == "in-process"],
                    points=[LoadPoint(stream=True, concurrency=1), LoadPoint(stream=False, concurrency=4)])


class ConfigPoint(BaseModel):
    config: str
    load: str
    per_round: list[float] = Field(description="Output tokens/s in each round, in round order.")
    tokens_per_s: Spread
    compared_with: str | None = Field(None, description="Draft configurations only: the configuration without a "
                                                        "draft with the highest median tokens/s at this load.")
    ratio_to_fastest_without_draft: Spread | None = Field(
        None, description="Round by round: this configuration's tokens/s over `compared_with`'s in the same round.")


class ConfigStart(BaseModel):
    config: str
    round: int
    seconds_to_healthy: float
    peak_rss_bytes: int | None


class ConfigsResult(BaseModel):
    command: str
    started_utc: str
    duration_s: float
    machine: Machine
    profile: str
    plan: ConfigsPlan
    points: list[ConfigPoint]
    starts: list[ConfigStart]
    mean_acceptance_length: dict[str, float] = Field(description="Per draft configuration, over all its samples, "
                                                                 "from vLLM's counters.")
    fastest: str | None = Field(description="The draft configuration whose worst ratio to the fastest configuration "
                                            "without a draft, over every load, is highest.")
    verdict: str


class ConfigsBench:
    def __init__(self, plan: ConfigsPlan, profile: Profile, *, target: str | None, draft: str | None,
                 prompts: list[str], files_dir: Path, command_line: str, say: Callable[[str], None]) -> None:
        self.plan, self.profile, self.prompts, self.files_dir = plan, profile, prompts, files_dir
        self.target, self.draft = target, draft
        self.command_line, self.say = command_line, say
        self.samples: dict[tuple[str, str], list[float]] = {}  # (config, load) -> tokens/s, one per round
        self.acceptance: dict[str, list[Sample]] = {}
        self.starts: list[ConfigStart] = []

    def run(self) -> ConfigsResult:
        started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0, load_before = time.perf_counter(), os.getloadavg()
        for round_no in range(1, self.plan.rounds + 1):
            for config in rotated(self.plan.configs, round_no):
                self._measure(config, round_no)
        points = compare(self.plan, self.samples)
        fastest, verdict = judge(points, self.plan)
        return ConfigsResult(command=self.command_line, started_utc=started_utc,
                             duration_s=time.perf_counter() - t0, machine=machine_now(load_before),
                             profile=self.profile.name, plan=self.plan, points=points, starts=self.starts,
                             mean_acceptance_length={name: figures.mean_acceptance_length
                                                     for name, samples in self.acceptance.items()
                                                     if (figures := summed_acceptance(samples))},
                             fastest=fastest, verdict=verdict)

    def _measure(self, config: ServingConfig, round_no: int) -> None:
        command = build_command(config.profile(self.profile), target=self.target, draft=self.draft,
                                no_draft=not config.draft, port=free_port())
        log = self.files_dir / "logs" / f"{config.name.replace(' ', '_').replace(',', '')}-r{round_no}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with measured_server(command, config=config.name, num_speculative_tokens=None, log=log) as live:
            # Unmeasured: a fresh server's first batch of each size is slower (one-off work per shape).
            widest = max(p.concurrency for p in self.plan.points)
            BenchClient(live.url, live.model, self.plan.max_tokens).measure(self.prompts, widest, 2 * widest)
            figures = []
            for point in self.plan.points:
                client = BenchClient(live.url, live.model, self.plan.max_tokens, stream=point.stream)
                n = self.plan.requests_at(point.concurrency)
                sample = client.measure(self.prompts, point.concurrency, n, with_acceptance=config.draft)
                self.samples.setdefault((config.name, point.name), []).append(sample.tokens_per_s)
                if sample.acceptance is not None:
                    self.acceptance.setdefault(config.name, []).append(sample)
                figures.append(f"{sample.tokens_per_s:.0f}")
        self.starts.append(ConfigStart(config=config.name, round=round_no,
                                       seconds_to_healthy=live.cold_start.seconds_to_healthy,
                                       peak_rss_bytes=live.finish().peak_rss_bytes))
        self.say(f"  round {round_no}/{self.plan.rounds} {config.name}: ready in "
                 f"{live.cold_start.seconds_to_healthy:.0f}s; tok/s {' / '.join(figures)} "
                 f"({'; '.join(p.name for p in self.plan.points)})")


def compare(plan: ConfigsPlan, samples: dict[tuple[str, str], list[float]]) -> list[ConfigPoint]:
    """Every configuration at every load; each draft configuration paired, round by round, with the fastest
    configuration without a draft at that load (by median)."""
    out = []
    plain = [c.name for c in plan.configs if not c.draft]
    for point in plan.points:
        best = max(plain, key=lambda name: spread(samples[name, point.name]).median) if plain else None
        for config in plan.configs:
            values = samples[config.name, point.name]
            paired = config.draft and best is not None
            ratio = spread([v / b for v, b in zip(values, samples[best, point.name])]) if paired else None
            out.append(ConfigPoint(config=config.name, load=point.name, per_round=values,
                                   tokens_per_s=spread(values), compared_with=best if paired else None,
                                   ratio_to_fastest_without_draft=ratio))
    return out


def judge(points: list[ConfigPoint], plan: ConfigsPlan) -> tuple[str | None, str]:
    """The draft configuration with the best worst-case ratio, and how it stands against the issue's goals:
    >= 1.5x the fastest configuration without a draft on one stream, >= 1.2x at 4-16 in flight, never below 1x."""
    worst: dict[str, float] = {}
    for p in points:
        if p.ratio_to_fastest_without_draft is not None:
            worst[p.config] = min(worst.get(p.config, float("inf")), p.ratio_to_fastest_without_draft.median)
    if not worst:
        return None, "no draft configuration was measured"
    fastest = max(worst, key=worst.get)
    misses = []
    for p in points:
        if p.config != fastest or p.ratio_to_fastest_without_draft is None:
            continue
        load = next(lp for lp in plan.points if lp.name == p.load)
        goal = 1.5 if load.concurrency == 1 else 1.2
        ratio = p.ratio_to_fastest_without_draft.median
        if ratio < goal:
            misses.append(f"{p.load}: {ratio:.2f}x (goal {goal}x)")
    verdict = (f"fastest with a draft: {fastest} (worst ratio {worst[fastest]:.2f}x to the fastest configuration "
               f"without a draft); " + ("meets every goal" if not misses else "misses " + ", ".join(misses)))
    return fastest, verdict


def markdown(result: ConfigsResult) -> str:
    loads = [p.name for p in result.plan.points]
    lines = [f"# Serving configurations of profile {result.profile}, side by side", "",
             run_line(result.command, result.started_utc, result.duration_s, result.machine)
             + f"{result.plan.rounds} rounds, {result.plan.max_tokens} tokens per request (ignore_eos, greedy), "
             "one server at a time, configuration order rotated by round.", "",
             "Output tokens/s, median [min-max] over the rounds; for a draft configuration, then its ratio to the "
             "configuration without a draft that is fastest at that load (by median), paired round by round (median "
             "of the rounds' ratios).", "",
             "| configuration | " + " | ".join(loads) + " | ready (s) |",
             "|---" * (len(loads) + 2) + "|"]
    for config in dict.fromkeys(p.config for p in result.points):
        cells = []
        for load in loads:
            p = next(q for q in result.points if q.config == config and q.load == load)
            cells.append(p.tokens_per_s.cell(p.ratio_to_fastest_without_draft))
        ready = [s.seconds_to_healthy for s in result.starts if s.config == config]
        lines.append(f"| {config} | " + " | ".join(cells) + f" | {min(ready):.0f}-{max(ready):.0f} |")
    acceptance = [f"{name}: {value:.2f}" for name, value in result.mean_acceptance_length.items()]
    lines += ["", "Mean acceptance length (all loads and rounds, from vLLM's counters): "
              + ("; ".join(acceptance) if acceptance else "n/a") + ".", "", f"**{result.verdict}.**", ""]
    return "\n".join(lines)


def plots(result: ConfigsResult, folder: Path) -> list[Plot]:
    """Each configuration with a draft over the fastest without one, at each load."""
    loads = [p.name for p in result.plan.points]
    drafts = list(dict.fromkeys(p.config for p in result.points if p.ratio_to_fastest_without_draft))
    width = 0.8 / max(1, len(drafts))

    def paint(figure: Figure) -> None:
        ax = figure.subplots()
        for i, config in enumerate(drafts):
            ratios = [next(p.ratio_to_fastest_without_draft.median for p in result.points
                           if p.config == config and p.load == load) for load in loads]
            ax.bar([j + (i - (len(drafts) - 1) / 2) * width for j in range(len(loads))], ratios, width, label=config)
        reference(ax, 1.0, "the fastest configuration without a draft")
        ax.set_xticks(range(len(loads)), labels=loads, fontsize="small")
        ax.set_ylabel("tokens/s over the fastest without a draft (x)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))

    return [draw(folder / "configs-ratio-to-fastest-without-draft.png",
                 f"Serving configurations with the draft, by load ({result.started_utc[:10]}, median of "
                 f"{result.plan.rounds} rounds)", paint, size=(10.0, 4.5))]


RESULTS = ModeResults(mode="configs", prefix=FULL.mode, model=ConfigsResult, markdown=markdown, plots=plots)


def register(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("configs", help="which way of serving the pair is fastest here: dtype x core layout x alone/"
                                         "with the draft, streamed and not",
                         description="float32/bfloat16 x both cores bound/vLLM's core layout (the engine core pinned "
                                     "or floating)/the worker inside the engine core x alone/with the draft, streamed "
                                     "and not, one server at a time (about 30 minutes). Writes "
                                     "OUT/configs-<time>.json and .md.")
    add_run_options(p, quick="the two bfloat16 configurations in vLLM's layout, 2 minutes; its figures are not for "
                             "comparison", rounds=FULL.rounds)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="only this dtype's half of the matrix")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_of(FULL, QUICK, args)
    if args.dtype is not None:
        plan = plan.model_copy(update={"configs": [c for c in plan.configs if c.dtype == args.dtype]})
        if not plan.configs:
            raise BenchError(f"the {plan.mode} plan serves no {args.dtype} configuration: leave out --dtype")
    measuring = MeasuringRun.start(args, plan.mode)
    result = ConfigsBench(plan, measuring.profile, **measuring.bench_options).run()
    measuring.write(result, markdown)
    print(result.verdict)
    return 0
