"""`kimi-eagle bench --bypass`: what the draft fail-safe buys when the draft matches nothing.

The draft served is a copy of the profile's own with every weight matrix replaced by random values of the same shape
and scale (norms, vocabulary maps and config kept): it loads, passes every shape check and accepts almost nothing,
the failure this project grew out of. Three servers: the target alone; that draft with the fail-safe off
(`KIMI_EAGLE_BYPASS=0`, what vLLM does by itself); and with it on. Each round starts the three (about 2 GiB each),
and each gets a first batch that is not measured (on the fail-safe's server it is the load that trips it: the
seconds from its first request until /metrics shows `kimi_eagle:draft_bypassed 1` are recorded); then every load,
streamed and not, at the temperature clients send by default (1: GuideLLM and the OpenAI clients set none), is
sampled on one server at a time, the three back to back in an order rotated by load and round (and reversed every
other cycle: `configs.rotated`).

The goal is the fail-safe's promise: once bypassed, within noise of the target alone (0.98x, the median of the
ratios paired round by round), at every load and both ways of reading the answer.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import requests
import torch
from pydantic import BaseModel, Field
from safetensors.torch import load_file, save_file

from kimi_eagle import envs
from kimi_eagle.bench.client import BenchClient
from kimi_eagle.bench.configs import rotated
from kimi_eagle.bench.plan import StreamsPlan
from kimi_eagle.bench.result import Machine, run_line
from kimi_eagle.bench.run import machine_now
from kimi_eagle.bench.servers import measured_server
from kimi_eagle.bench.stats import Spread, paired_ratios, spread
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.profile import Profile, resolve_model_path

CONFIGS = ("target alone", "random draft, fail-safe off", "random draft, fail-safe on")
BYPASSED_GAUGE = "kimi_eagle:draft_bypassed"
GOAL = 0.98  # the fail-safe's goal: at least this share of the target alone's tokens/s once bypassed


class BypassPlan(StreamsPlan):
    mode: str
    concurrency: list[int]
    rounds: int = Field(ge=1)
    max_tokens: int = Field(ge=2)
    temperature: float = Field(1.0, ge=0, description="Of every measured request (the trip batch is greedy).")
    streamed: list[bool] = Field([False, True], description="Each load is sampled once per entry: not streamed, "
                                                            "streamed.")


# Six rounds: the three servers each first twice, and each loaded right after each other one equally often.
FULL = BypassPlan(mode="bypass", concurrency=[1, 4, 16], rounds=6, max_tokens=64, requests_per_stream=16)
QUICK = BypassPlan(mode="bypass-quick", concurrency=[1], rounds=1, max_tokens=16, requests_per_stream=2,
                   streamed=[True])


class BypassPoint(BaseModel):
    config: str
    streamed: bool = False
    concurrency: int
    per_round: list[float]
    tokens_per_s: Spread
    ratio_to_target_alone: Spread | None = Field(None, description="Round by round, over the target alone's.")
    server_cpu_s_per_1k_tokens: Spread | None = Field(
        None, description="CPU seconds of the server's processes per 1,000 output tokens: the work a token costs, "
                          "which the scheduling noise of a 2-core machine moves less than tokens/s.")
    cpu_ratio_to_target_alone: Spread | None = Field(None, description="Round by round, over the target alone's.")


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


def random_draft(draft_dir: Path, out: Path, seed: int = 0) -> Path:
    """The draft with each weight matrix (2-D floating tensor) redrawn at its own standard deviation."""
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
        self.samples: dict[tuple[str, bool, int], list[float]] = {}
        self.cpu_per_1k: dict[tuple[str, bool, int], list[float]] = {}
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
                    values, alone = self.samples[config, streamed, c], self.samples[CONFIGS[0], streamed, c]
                    cpu, cpu_alone = self.cpu_per_1k[config, streamed, c], self.cpu_per_1k[CONFIGS[0], streamed, c]
                    alone_config = config == CONFIGS[0]
                    points.append(BypassPoint(
                        config=config, streamed=streamed, concurrency=c, per_round=values,
                        tokens_per_s=spread(values),
                        ratio_to_target_alone=None if alone_config else spread(paired_ratios(values, alone)),
                        server_cpu_s_per_1k_tokens=spread(cpu),
                        cpu_ratio_to_target_alone=None if alone_config else spread(paired_ratios(cpu, cpu_alone))))
        return BypassResult(command=self.command_line, started_utc=started_utc, duration_s=time.perf_counter() - t0,
                            machine=machine_now(load_before), profile=self.profile.name, plan=self.plan,
                            points=points, seconds_to_bypass=self.seconds_to_bypass,
                            verdict=verdict(points, self.seconds_to_bypass))

    def _round(self, round_no: int) -> None:
        """The three servers up together, only one of them loaded at a time: each load is sampled on each server
        back to back (order rotated), so that a ratio compares seconds-apart samples. Minutes apart, this 2-core
        machine drifts by 10-25% (the target alone gave 179 and 233 tok/s at one stream in two runs an hour apart),
        ten times the 2% this bench has to resolve. An idle server costs next to nothing (uniprocess engine core)."""
        with contextlib.ExitStack() as stack:
            live = {}
            for config in rotated(list(CONFIGS), round_no):
                live[config] = stack.enter_context(self._server(config, round_no))
                self._first_batch(config, live[config])
            figures: dict[str, list[str]] = {config: [] for config in CONFIGS}
            loads = [(streamed, c) for streamed in self.plan.streamed for c in self.plan.concurrency]
            for i, (streamed, c) in enumerate(loads):
                for config in rotated(list(CONFIGS), round_no + i):
                    sampler = BenchClient(live[config].url, live[config].model, self.plan.max_tokens,
                                          stream=streamed, temperature=self.plan.temperature)
                    cpu_before = live[config].cpu_seconds()
                    sample = sampler.measure(self.prompts, c, self.plan.requests_at(c))
                    cpu_s = live[config].cpu_seconds() - cpu_before
                    self.samples.setdefault((config, streamed, c), []).append(sample.tokens_per_s)
                    self.cpu_per_1k.setdefault((config, streamed, c), []).append(
                        1000 * cpu_s / sample.completion_tokens)
                    figures[config].append(f"{sample.tokens_per_s:.0f}")
        names = [f"{c}{' streamed' if streamed else ''}" for streamed, c in loads]
        for config in CONFIGS:
            self.say(f"  round {round_no}/{self.plan.rounds} {config}: tok/s {' / '.join(figures[config])} (in "
                     f"flight {' / '.join(names)})")

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
                         f"{ratio:.2f}x with it ({'meets' if ratio >= GOAL else 'misses'} the {GOAL}x goal)")
    known = [s for s in seconds if s is not None]
    when = (f"bypassed {min(known):.1f}-{max(known):.1f} s after the load began" if known
            else "never bypassed during the first batch")
    return "; ".join(parts) + f"; {when}"


def markdown(result: BypassResult) -> str:
    lines = [f"# The draft fail-safe on a random draft, profile {result.profile}", "",
             run_line(result.command, result.started_utc, result.duration_s, result.machine)
             + f"{result.plan.rounds} rounds, {result.plan.max_tokens} tokens per request (ignore_eos, temperature "
             f"{result.plan.temperature:g}), the three servers up together and loaded one at a time, order rotated "
             "by load and round.", "",
             "Output tokens/s, median [min-max]; then the ratio to the target alone, paired round by round.", "",
             *_table(result, lambda p: p.tokens_per_s.cell(p.ratio_to_target_alone)),
             "", f"**{result.verdict}.**", ""]
    if all(p.server_cpu_s_per_1k_tokens is not None for p in result.points):  # measured since 2026-12-05
        lines += ["CPU seconds of the server's processes per 1,000 output tokens, median [min-max]; then the ratio to "
                  "the target alone, paired round by round (below 1: less work a token).", "",
                  *_table(result, lambda p: p.server_cpu_s_per_1k_tokens.cell(p.cpu_ratio_to_target_alone, digits=2)),
                  ""]
    return "\n".join(lines)


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
