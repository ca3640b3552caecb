"""`kimi-eagle bench bypass`: what the draft fail-safe buys when the draft matches nothing.

The draft served is a copy of the profile's own with every weight matrix replaced by random values of the same shape
and scale (norms, vocabulary maps and config kept): it loads, passes every shape check and accepts almost nothing,
the failure this project grew out of. Three servers: the target alone; that draft with the fail-safe off
(`KIMI_EAGLE_BYPASS=0`, what vLLM does by itself); and with it on. Each round starts the three (about 2 GiB each),
and each gets a first batch that is not measured (on the fail-safe's server it is the load that trips it: the
seconds from its first request until /metrics shows `kimi_eagle:draft_bypassed 1` are recorded); then every load,
streamed and not, at the temperature clients send by default (1: GuideLLM and the OpenAI clients set none), is
sampled on one server at a time: the target alone and the fail-safe's server in turns, `pairs` short samples each
(A C C A ...), the server without the fail-safe once, first or last in turn.

The goal is the fail-safe's promise: once bypassed, within noise of the target alone (0.98x, the median of the
ratios of each of the fail-safe server's samples to the target alone's beside it), at every load and both ways of
reading the answer. The latest run's figures: BENCHMARKS.md (`kimi-eagle bench render`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests
from matplotlib.figure import Figure
from pydantic import AliasChoices, BaseModel, Field

from kimi_eagle import envs
from kimi_eagle.bench.client import BenchClient
from kimi_eagle.bench.machine import machine_now
from kimi_eagle.bench.plots import TARGET_ALONE, Plot, draw, log2_axis, reference, spread_line
from kimi_eagle.bench.result import Machine, ModeResults, run_line
from kimi_eagle.bench.servers import measured_server
from kimi_eagle.bench.stats import Spread, paired_ratios, spread
from kimi_eagle.bench.subcommand import MeasuringRun, add_run_options, plan_of
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.profile import Profile, resolve_model_path

CONFIGS = ("target alone", "random draft, fail-safe off", "random draft, fail-safe on")
BYPASSED_GAUGE = "kimi_eagle:draft_bypassed"
GOAL = 0.98  # the fail-safe's goal: at least this share of the target alone's tokens/s once bypassed


class BypassPlan(BaseModel):
    mode: str
    concurrency: list[int]
    rounds: int = Field(ge=1)
    pairs: int = Field(1, ge=1, description="Per round and load: samples of the target alone and of the fail-safe's "
                                            "server, alternated (A C C A A C ...); the random draft without the "
                                            "fail-safe, the reference of what is at stake, is sampled once.")
    requests_per_sample: int | None = Field(None, ge=1, description="Requests in one sample, rounded up to whole "
                                                                      "waves of the load's concurrency.")
    requests_per_stream: int | None = Field(None, description="Runs before 2026-12-06: max(12, this x concurrency) "
                                                               "requests a sample.")
    max_tokens: int = Field(ge=2)
    temperature: float = Field(1.0, ge=0, description="Of every measured request (the trip batch is greedy).")
    streamed: list[bool] = Field([False, True], description="Each load is sampled once per entry: not streamed, "
                                                            "streamed.")

    @property
    def alternated(self) -> bool:
        """Runs since 2026-12-06 sample the target alone and the fail-safe's server in turns."""
        return self.requests_per_sample is not None

    def requests_at(self, concurrency: int) -> int:
        if not self.alternated:
            return max(12, (self.requests_per_stream or 1) * concurrency)
        return -(-max(self.requests_per_sample, concurrency) // concurrency) * concurrency


# A 2% cost is far less than what a 2-core machine's throughput moves by from one sample to the next (the spread of
# the per-pair ratios: BENCHMARKS.md). Short samples, alternated seconds apart, cancel the drift, and many pairs a cell
# (rounds x pairs) narrow the median's own noise; rounds of fresh servers, started in turns (`start_order`), keep one
# start's luck, and its place in the order, from deciding a cell.
FULL = BypassPlan(mode="bypass", concurrency=[1, 4, 16], rounds=4, pairs=22, requests_per_sample=8, max_tokens=64)
QUICK = BypassPlan(mode="bypass-quick", concurrency=[1], rounds=1, max_tokens=16, requests_per_sample=2,
                   streamed=[True])


class BypassPoint(BaseModel):
    config: str
    streamed: bool = False
    concurrency: int
    samples: list[float] = Field(validation_alias=AliasChoices("samples", "per_round"),
                                 description="Tokens/s of every sample, in the order taken.")
    tokens_per_s: Spread
    ratio_to_target_alone: Spread | None = Field(
        None, description="Over the target alone's: for the fail-safe's server pair by pair (each sample over the "
                          "target alone's right beside it), for the other server over the round's median.")
    server_cpu_s_per_1k_tokens: Spread | None = Field(
        None, description="CPU seconds of the server's processes per 1,000 output tokens: the work a token costs, "
                          "which the scheduling noise of a 2-core machine moves less than tokens/s.")
    cpu_ratio_to_target_alone: Spread | None = Field(None, description="Paired as `ratio_to_target_alone`.")


class BypassResult(BaseModel):
    command: str
    started_utc: str
    duration_s: float
    machine: Machine
    profile: str
    plan: BypassPlan
    points: list[BypassPoint]
    seconds_to_bypass: list[float | None] = Field(description="Per round: first request of the load to the gauge "
                                                              "reading 1 (None: it never did during the batch).")
    verdict: str


def start_order(round_no: int) -> list[str]:
    """The servers of round r in the order they start: the target alone first and the fail-safe's server last in odd
    rounds, the other way round in even ones, so that over an even number of rounds neither starts before the other
    more often: where one server started before the other more often, the order showed in the ratio, and two servers
    of one configuration started one after the other differ by a few percent (BENCHMARKS.md, the fail-safe's runs).
    More rounds average a start's luck out."""
    alone, off, on = CONFIGS
    return [alone, off, on] if round_no % 2 else [on, off, alone]


def random_draft(draft_dir: Path, out: Path, seed: int = 0) -> Path:
    """The draft with each weight matrix (2-D floating tensor) redrawn at its own standard deviation."""
    import torch  # here: `kimi-eagle bench` builds every mode's options, and this mode alone needs torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    for file in draft_dir.iterdir():
        if file.suffix == ".safetensors":
            tensors = load_file(file)
            for name, t in tensors.items():
                if t.ndim == 2 and t.is_floating_point():
                    std = t.float().std().item() or 0.02
                    tensors[name] = (torch.randn(t.shape, generator=generator) * std).to(t.dtype)
            save_file(tensors, out / file.name, metadata={"format": "pt"})
        elif file.is_file():
            (out / file.name).write_bytes(file.read_bytes())
    return out


class BypassBench:
    def __init__(self, plan: BypassPlan, profile: Profile, *, target: str | None, draft: str | None,
                 prompts: list[str], files_dir: Path, command_line: str, say: Callable[[str], None]) -> None:
        self.plan, self.profile, self.prompts, self.files_dir = plan, profile, prompts, files_dir
        self.target, self.command_line, self.say = target, command_line, say
        self.draft = str(random_draft(Path(resolve_model_path(draft or profile.draft)), files_dir / "random-draft"))
        # per (configuration, streamed, concurrency): every sample's tokens/s and CPU per 1,000 tokens, and ratios
        self.samples: dict[tuple[str, bool, int], list[float]] = {}
        self.cpu_per_1k: dict[tuple[str, bool, int], list[float]] = {}
        self.ratios: dict[tuple[str, bool, int], list[float]] = {}
        self.cpu_ratios: dict[tuple[str, bool, int], list[float]] = {}
        self.seconds_to_bypass: list[float | None] = []

    def run(self) -> BypassResult:
        started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0, load_before = time.perf_counter(), os.getloadavg()
        for round_no in range(1, self.plan.rounds + 1):
            self._round(round_no)
        points = []
        for config in CONFIGS:
            for streamed in self.plan.streamed:
                for c in self.plan.concurrency:
                    key = (config, streamed, c)
                    points.append(BypassPoint(
                        config=config, streamed=streamed, concurrency=c, samples=self.samples[key],
                        tokens_per_s=spread(self.samples[key]), ratio_to_target_alone=spread(self.ratios.get(key, [])),
                        server_cpu_s_per_1k_tokens=spread(self.cpu_per_1k[key]),
                        cpu_ratio_to_target_alone=spread(self.cpu_ratios.get(key, []))))
        return BypassResult(command=self.command_line, started_utc=started_utc, duration_s=time.perf_counter() - t0,
                            machine=machine_now(load_before), profile=self.profile.name, plan=self.plan,
                            points=points, seconds_to_bypass=self.seconds_to_bypass,
                            verdict=verdict(points, self.seconds_to_bypass))

    def _round(self, round_no: int) -> None:
        """The three servers up together, only one of them loaded at a time. At each load the target alone and the
        fail-safe's server are sampled in turns (A C C A ...: a linear drift weighs on both alike), so that each
        ratio compares samples seconds apart: minutes apart, a 2-core machine drifts by several times the 2% this
        bench has to resolve (BENCHMARKS.md).
        The server without the fail-safe is sampled once, first or last in turn. An idle server costs next to
        nothing (uniprocess engine core)."""
        alone, off, on = CONFIGS
        with contextlib.ExitStack() as stack:
            live = {}
            for config in start_order(round_no):
                live[config] = stack.enter_context(self._server(config, round_no))
                self._first_batch(config, live[config])
            figures: dict[str, list[str]] = {config: [] for config in CONFIGS}
            loads = [(streamed, c) for streamed in self.plan.streamed for c in self.plan.concurrency]
            for i, (streamed, c) in enumerate(loads):
                turn = (round_no + i) % 2 == 0
                taken: dict[str, list[tuple[float, float]]] = {config: [] for config in CONFIGS}
                if turn:
                    taken[off].append(self._sample(live[off], streamed, c))
                for pair in range(self.plan.pairs):
                    for config in ((alone, on) if (pair % 2 == 0) == turn else (on, alone)):
                        taken[config].append(self._sample(live[config], streamed, c))
                if not turn:
                    taken[off].append(self._sample(live[off], streamed, c))
                alone_tps, alone_cpu = map(list, zip(*taken[alone]))
                for config, values in taken.items():
                    key = (config, streamed, c)
                    tps, cpu = map(list, zip(*values))
                    self.samples.setdefault(key, []).extend(tps)
                    self.cpu_per_1k.setdefault(key, []).extend(cpu)
                    figures[config].append(f"{statistics.median(tps):.0f}")
                    if config == on:  # each sample over the target alone's beside it
                        ratios, cpu_ratios = paired_ratios(tps, alone_tps), paired_ratios(cpu, alone_cpu)
                    elif config == off:  # sampled once: over the round's median
                        ratios = [t / statistics.median(alone_tps) for t in tps]
                        cpu_ratios = [u / statistics.median(alone_cpu) for u in cpu]
                    else:
                        continue
                    self.ratios.setdefault(key, []).extend(ratios)
                    self.cpu_ratios.setdefault(key, []).extend(cpu_ratios)
        names = [f"{c}{' streamed' if streamed else ''}" for streamed, c in loads]
        for config in CONFIGS:
            self.say(f"  round {round_no}/{self.plan.rounds} {config}: tok/s {' / '.join(figures[config])} (in "
                     f"flight {' / '.join(names)})")

    def _sample(self, live, streamed: bool, c: int) -> tuple[float, float]:
        """One sample: tokens/s, and the server's CPU seconds per 1,000 output tokens."""
        sampler = BenchClient(live.url, live.model, self.plan.max_tokens, stream=streamed,
                              temperature=self.plan.temperature)
        cpu_before = live.cpu_seconds()
        sample = sampler.measure(self.prompts, c, self.plan.requests_at(c))
        return sample.tokens_per_s, 1000 * (live.cpu_seconds() - cpu_before) / sample.completion_tokens

    def _server(self, config: str, round_no: int):
        command = build_command(self.profile, target=self.target, draft=self.draft, no_draft=config == CONFIGS[0],
                                port=free_port())
        if config == CONFIGS[1]:
            command.env[envs.BYPASS.name] = "0"
        log = self.files_dir / "logs" / f"{CONFIGS.index(config)}-r{round_no}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        return measured_server(command, config=config, num_speculative_tokens=None, log=log)

    def _first_batch(self, config: str, live) -> None:
        """Not measured: warms the server up, and on the fail-safe's server it is the load that trips it."""
        client = BenchClient(live.url, live.model, self.plan.max_tokens)
        # At the fewest in flight: a profile's schedule may draft nothing at the most (tiny-cpu's k is 0 above 8),
        # and a fail-safe that saw no drafts would trip inside a measured sample. At least two alarm windows of
        # drafts (a draft that accepts nothing drafts once per token).
        fewest = min(self.plan.concurrency)
        first = max(self.plan.requests_at(fewest), -(-2 * envs.alarm_window_drafts() // self.plan.max_tokens))
        if config == CONFIGS[2]:
            self.seconds_to_bypass.append(time_to_bypass(live.url, lambda: client.measure(self.prompts, fewest,
                                                                                          first)))
        else:
            client.measure(self.prompts, fewest, first)


def time_to_bypass(url: str, load: Callable[[], object]) -> float | None:
    """Run `load` while polling the gauge; seconds from its start to the gauge reading 1."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (load(), done.set()), daemon=True)
    t0 = time.perf_counter()
    worker.start()
    seen = None
    while seen is None and not done.is_set():
        text = requests.get(f"{url}/metrics", timeout=10).text
        if any(line.startswith(BYPASSED_GAUGE) and line.rstrip().endswith(" 1.0") for line in text.splitlines()):
            seen = time.perf_counter() - t0
        time.sleep(0.05)
    worker.join()
    return seen


def verdict(points: list[BypassPoint], seconds: list[float | None]) -> str:
    parts = []
    for p in points:
        if p.config == CONFIGS[2] and p.ratio_to_target_alone is not None:
            off = next(q for q in points if q.config == CONFIGS[1] and q.concurrency == p.concurrency
                       and q.streamed == p.streamed)
            ratio = p.ratio_to_target_alone.median
            parts.append(f"{p.concurrency} in flight{', streamed' if p.streamed else ''}: "
                         f"{off.ratio_to_target_alone.median:.2f}x of the target alone without the fail-safe, "
                         f"{ratio:.3f}x with it ({'meets' if ratio >= GOAL else 'misses'} the {GOAL}x goal)")
    known = [s for s in seconds if s is not None]
    when = (f"bypassed {min(known):.1f}-{max(known):.1f} s after the load began" if known
            else "never bypassed during the first batch")
    return "; ".join(parts) + f"; {when}"


def markdown(result: BypassResult) -> str:
    digits = 3 if result.plan.alternated else 2  # against the 0.98x goal, 0.976 is no 0.98
    lines = [f"# The draft fail-safe on a random draft, profile {result.profile}", "",
             run_line(result.command, result.started_utc, result.duration_s, result.machine)
             + f"{_design(result.plan)}, {result.plan.max_tokens} tokens per request (ignore_eos, temperature "
             f"{result.plan.temperature:g}), the three servers up together and loaded one at a time.", "",
             f"Output tokens/s, median [min-max]; then the ratio to the target alone ({_pairing(result.plan)}).", "",
             *_table(result, lambda p: p.tokens_per_s.cell(p.ratio_to_target_alone, ratio_digits=digits)),
             "", f"**{result.verdict}.**", ""]
    if all(p.server_cpu_s_per_1k_tokens is not None for p in result.points):  # measured since 2026-12-05
        lines += ["CPU seconds of the server's processes per 1,000 output tokens, median [min-max]; then the ratio to "
                  "the target alone, paired alike (below 1: less work a token).", "",
                  *_table(result, lambda p: p.server_cpu_s_per_1k_tokens.cell(p.cpu_ratio_to_target_alone, digits=2)),
                  ""]
    return "\n".join(lines)


def _design(plan: BypassPlan) -> str:
    if not plan.alternated:
        return f"{plan.rounds} rounds, order rotated by load and round"
    return (f"{plan.rounds} rounds of fresh servers; at each load, {plan.pairs} samples of the target alone and of the "
            f"fail-safe's server in turns and one of the server without it, {plan.requests_per_sample} requests or "
            "more a sample (whole waves of the load)")


def _pairing(plan: BypassPlan) -> str:
    if not plan.alternated:
        return "paired round by round"
    return ("the median of each sample's ratio to the target alone's beside it; for the server without the fail-safe, "
            "to the round's median")


def _table(result: BypassResult, cell: Callable[[BypassPoint], str]) -> list[str]:
    """One row per configuration and read, one column per load."""
    cs = result.plan.concurrency
    lines = ["| configuration | read | " + " | ".join(f"{c} in flight" for c in cs) + " |",
             "|---" * (len(cs) + 2) + "|"]
    for config in CONFIGS:
        for streamed in result.plan.streamed:
            points = [next(q for q in result.points if q.config == config and q.concurrency == c
                           and q.streamed == streamed) for c in cs]
            lines.append(f"| {config} | {'streamed' if streamed else 'whole'} | "
                         + " | ".join(cell(p) for p in points) + " |")
    return lines


def plots(result: BypassResult, folder: Path) -> list[Plot]:
    """The random draft's tokens/s over the target alone by load, with the fail-safe off and on, whole and streamed,
    against the goal."""
    def paint(figure: Figure) -> None:
        ax = figure.subplots()
        for config, colour in zip(CONFIGS[1:], ("tab:red", "tab:green")):
            for streamed in result.plan.streamed:
                points = sorted((p for p in result.points if p.config == config and p.streamed == streamed
                                 and p.ratio_to_target_alone is not None), key=lambda p: p.concurrency)
                if points:
                    spread_line(ax, [p.concurrency for p in points], [p.ratio_to_target_alone for p in points],
                                f"{config}, {'streamed' if streamed else 'whole'}", color=colour,
                                linestyle="--" if streamed else "-")
        reference(ax, 1.0, TARGET_ALONE)
        reference(ax, GOAL, f"goal: {GOAL}x", color="tab:green")
        log2_axis(ax, result.plan.concurrency, "requests in flight")
        ax.set_ylabel("tokens/s over the target alone (x)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")

    return [draw(folder / "bypass-ratio-to-target-alone.png",
                 f"The draft fail-safe on a random draft ({result.started_utc[:10]}, median and range)", paint)]


RESULTS = ModeResults(mode="bypass", prefix=FULL.mode, model=BypassResult, markdown=markdown, plots=plots)


def register(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("bypass", help="what the draft fail-safe buys on a random-weight copy of the profile's draft",
                         description="The target alone, a random-weight copy of the profile's draft with the "
                                     "fail-safe off, and on, at 1, 4 and 16 in flight, streamed and not, at T 1, the "
                                     "three servers up together and loaded one at a time, and how long after the load "
                                     "began it bypassed the draft (about 30 minutes). Writes OUT/bypass-<time>.json "
                                     "and .md.")
    add_run_options(p, quick="1 in flight, streamed, 1 round: proves the mode runs; its figures are not for "
                             "comparison", rounds=FULL.rounds)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_of(FULL, QUICK, args)
    measuring = MeasuringRun.start(args, plan.mode)
    result = BypassBench(plan, measuring.profile, **measuring.bench_options).run()
    measuring.write(result, markdown)
    print(result.verdict)
    return 0
