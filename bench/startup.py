"""`kimi-eagle bench startup`: how long `make serve` takes to its `Ready` line, the first time and every later time.

A user's first start compiles the target and the draft (torch.compile); every later start loads what the first one
saved (vLLM's cache, made reusable on CPU and keyed by the capture in `adapter/compile_cache.py`). Each round gives
`kimi-eagle serve PROFILE` (what `make serve` runs once the venv is in place) an empty `VLLM_CACHE_ROOT` of its own
and starts it twice: the first start with nothing compiled, the second with what the first saved. Each start is
timed as a user sees it, from the command to its `Ready in` line (pre-flight checks, vLLM's start-up, the model
answering /health). Each start then answers one greedy request, and is stopped as Ctrl-C would (SIGTERM takes the
same path): a second start that loaded the compiled graphs must answer as the first, which compiled them. The latest
run's figures: BENCHMARKS.md (`kimi-eagle bench render`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import psutil
import yaml
from matplotlib.figure import Figure
from pydantic import BaseModel, Field

from kimi_eagle.bench.client import BenchClient
from kimi_eagle.bench.machine import machine_now, torch_compile_cache
from kimi_eagle.bench.plots import Plot, draw, reference
from kimi_eagle.bench.result import Machine, ModeResults, run_line
from kimi_eagle.bench.stats import Spread, spread
from kimi_eagle.bench.subcommand import MeasuringRun, add_run_options, plan_of
from kimi_eagle.processes import free_port
from kimi_eagle.serve.launch import ServerStartError
from kimi_eagle.serve.profile import Profile
from kimi_eagle.serve.server_log import describe_failure

SECOND_START_GOAL_S = 45.0  # issue 18: every start after the first, to Ready, on this 2-core machine
READY_PREFIX = "Ready in "  # the line `kimi-eagle serve` prints once the server answers (serve/launch.py)
LOADED_MARK = "[backbone] Directly load AOT compilation"  # vLLM's line for a target graph read from its cache
ANSWER_TOKENS = 32
START_TIMEOUT_S = 600.0


class StartupPlan(BaseModel):
    mode: str
    rounds: int = Field(ge=1, description="Each round: a fresh compile cache, a first start and a second start.")
    shared_kernels: bool = Field(False, description="Each round's cache links the inductor kernels of the servers' "
                                 "own cache (`VLLM_CACHE_ROOT`): the first start traces the graphs and saves them "
                                 "without compiling the kernels they share with graphs compiled before.")


FULL = StartupPlan(mode="startup", rounds=2)
# The suite's run of the bench: half of a first start was compiling kernels (gcc) that the suite's own servers of the
# same profile compile too; it still proves that a first start traces and saves what a second loads and answers by.
QUICK = StartupPlan(mode="startup-quick", rounds=1, shared_kernels=True)


class Start(BaseModel):
    round: int
    start: Literal["first", "second"]
    seconds_to_ready: float = Field(description="From the command to its `Ready in` line.")
    cache_files_before: int = Field(description="Files in the round's VLLM_CACHE_ROOT when the start began.")
    loaded_compiled_target: bool | None = Field(default=None, description="vLLM read the target's compiled graph "
                                                "from the cache (its log says so) instead of compiling it.")
    answer_token_ids: list[int] | None = Field(default=None, description="The token ids of a greedy answer to the "
                                               "first prompt, asked once the start was Ready.")


class StartupResult(BaseModel):
    command: str
    started_utc: str
    duration_s: float
    machine: Machine
    profile: str
    plan: StartupPlan
    starts: list[Start]
    first: Spread
    second: Spread
    verdict: str


class StartupBench:
    def __init__(self, plan: StartupPlan, profile: Profile, *, target: str | None, draft: str | None,
                 prompts: list[str], files_dir: Path, command_line: str, say: Callable[[str], None]) -> None:
        self.plan, self.profile, self.files_dir = plan, profile, files_dir
        self.target, self.draft, self.command_line, self.say = target, draft, command_line, say
        self.prompt = prompts[0] if prompts else "The"
        # The profile as loaded, as a file of its own: `serve` takes a name or a file, and a name is not kept.
        self.profile_file = files_dir / f"{profile.name}.yaml"
        files_dir.mkdir(parents=True, exist_ok=True)
        self.profile_file.write_text(yaml.safe_dump(profile.model_dump(mode="json"), sort_keys=False))

    def run(self) -> StartupResult:
        started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0, load_before = time.perf_counter(), os.getloadavg()
        starts = []
        for round_no in range(1, self.plan.rounds + 1):
            cache = self.files_dir / f"vllm-cache-r{round_no}"  # empty: this round's first start compiles
            if self.plan.shared_kernels:
                link_shared_kernels(cache)
            for which in ("first", "second"):
                files = sum(1 for p in cache.rglob("*") if p.is_file()) if cache.exists() else 0
                log = self.files_dir / "logs" / f"{which}-r{round_no}.log"
                seconds, answer = self._start(cache, log)
                starts.append(Start(round=round_no, start=which, seconds_to_ready=seconds, cache_files_before=files,
                                    loaded_compiled_target=LOADED_MARK in log.read_text(errors="replace"),
                                    answer_token_ids=answer))
                self.say(f"  round {round_no}/{self.plan.rounds}, {which} start: Ready after {seconds:.1f}s "
                         f"({files} files in the compile cache before)")
            shutil.rmtree(cache, ignore_errors=True)  # compiled graphs, tens of MB a round; the logs stay
        first = spread([s.seconds_to_ready for s in starts if s.start == "first"])
        second = spread([s.seconds_to_ready for s in starts if s.start == "second"])
        return StartupResult(command=self.command_line, started_utc=started_utc, duration_s=time.perf_counter() - t0,
                             machine=machine_now(load_before), profile=self.profile.name, plan=self.plan,
                             starts=starts, first=first, second=second, verdict=verdict(first, second, starts))

    def _start(self, cache: Path, log: Path) -> tuple[float, list[int]]:
        """`kimi-eagle serve` as a user runs it; seconds to its Ready line and the token ids of its greedy answer to
        the first prompt; stopped before returning."""
        port = free_port()
        argv = [sys.executable, "-m", "kimi_eagle.cli", "serve", str(self.profile_file), "--port", str(port)]
        argv += [*(["--target", self.target] if self.target else []), *(["--draft", self.draft] if self.draft else [])]
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_CACHE_ROOT": str(cache)}
        with log.open("w") as out:
            t0 = time.perf_counter()
            process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            try:
                seconds = None
                for line in process.stdout:
                    out.write(line)
                    if line.startswith(READY_PREFIX):
                        seconds = time.perf_counter() - t0
                        break
                    if time.perf_counter() - t0 > START_TIMEOUT_S:
                        break
                if seconds is None:
                    out.flush()
                    raise ServerStartError(f"`{' '.join(argv)}` did not print its Ready line; "
                                           f"{describe_failure(log, None)}")
                client = BenchClient(f"http://{self.profile.host}:{port}", self.profile.served_model_name,
                                     ANSWER_TOKENS, timeout_s=120)
                return seconds, client.complete(self.prompt).token_ids
            finally:
                _stop(process)


def link_shared_kernels(cache: Path) -> None:
    """`cache`'s inductor cache, which every compile key's links to (`adapter/compile_cache.py`), as a link to the
    ambient cache's: inductor keys its kernels by their code and this machine, so another cache's are valid here. A
    link is no file: the round's cache still counts none before its first start (and `rmtree` removes the link)."""
    from kimi_eagle.adapter.compile_cache import SHARED_INDUCTOR_CACHE  # imports torch: only where it is used

    shared = torch_compile_cache() / SHARED_INDUCTOR_CACHE
    shared.mkdir(parents=True, exist_ok=True)
    link = cache / "torch_compile_cache" / SHARED_INDUCTOR_CACHE
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink():
        link.symlink_to(shared.resolve(), target_is_directory=True)


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM, as `kimi-eagle serve` stops on Ctrl-C; then whatever it left behind is killed."""
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.communicate(timeout=60)  # drains its output, so that a full pipe cannot block its stop
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
    _, alive = psutil.wait_procs(children, timeout=30)
    for child in alive:
        child.kill()


def verdict(first: Spread, second: Spread, starts: Sequence[Start] = ()) -> str:
    met = "meets" if second.max <= SECOND_START_GOAL_S else "misses"
    said = (f"first start (nothing compiled) {_seconds(first)} to Ready, every later start {_seconds(second)} "
            f"({met} the {SECOND_START_GOAL_S:.0f} s goal)")
    seconds = [s for s in starts if s.start == "second"]
    if any(s.loaded_compiled_target is False for s in seconds):
        said += "; a second start compiled the target again instead of loading it (its log, under logs/, says why)"
    firsts = _first_answers(starts)
    if any(s.answer_token_ids != firsts[s.round] for s in seconds):
        said += ("; a second start answered otherwise than the first, greedy: the graphs it loaded from the compile "
                 "cache compute something else (delete the cache's torch_compile_cache folder, and report it)")
    return said


def _first_answers(starts: Sequence[Start]) -> dict[int, list[int] | None]:
    """Each round's answer of the start that compiled the graphs."""
    return {s.round: s.answer_token_ids for s in starts if s.start == "first"}


def _graph(loaded: bool | None) -> str:
    return "-" if loaded is None else "loaded" if loaded else "compiled"


def _answer(start: Start, first: list[int] | None) -> str:
    if start.answer_token_ids is None:
        return "-"
    if start.start == "first":
        return f"{len(start.answer_token_ids)} tokens"
    return "as the first" if start.answer_token_ids == first else "DIFFERS from the first"


def _seconds(s: Spread) -> str:
    return f"{s.median:.1f} s" if s.n == 1 else f"{s.median:.1f} s [{s.min:.1f}-{s.max:.1f}]"


def markdown(result: StartupResult) -> str:
    lines = [f"# Start-up of `kimi-eagle serve {result.profile}` to its Ready line", "",
             run_line(result.command, result.started_utc, result.duration_s, result.machine)
             + f"{result.plan.rounds} rounds, each with an empty VLLM_CACHE_ROOT of its own: a first start with "
             "nothing compiled, then a second start with what the first saved. Each start answers one greedy "
             f"request of {ANSWER_TOKENS} tokens once Ready."
             + (" The rounds' caches link the inductor kernels of the servers' own cache: the first start traces and "
                "saves every graph, but compiles only the kernels not compiled before (not a user's first start)."
                if result.plan.shared_kernels else ""), "",
             "| round | start | seconds to Ready | files in the compile cache before | target graph | answer |",
             "|---|---|---|---|---|---|"]
    firsts = _first_answers(result.starts)
    lines += [f"| {s.round} | {s.start} | {s.seconds_to_ready:.1f} | {s.cache_files_before} | "
              f"{_graph(s.loaded_compiled_target)} | {_answer(s, firsts[s.round])} |" for s in result.starts]
    lines += ["", f"**{result.verdict}.**", ""]
    return "\n".join(lines)


def plots(result: StartupResult, folder: Path) -> list[Plot]:
    """Each round's first and second start to Ready, against the goal of every later start."""
    rounds = sorted({s.round for s in result.starts})

    def paint(figure: Figure) -> None:
        ax = figure.subplots()
        for offset, which, colour in ((-0.2, "first", "tab:orange"), (0.2, "second", "tab:blue")):
            seconds = {s.round: s.seconds_to_ready for s in result.starts if s.start == which}
            ax.bar([r + offset for r in rounds], [seconds[r] for r in rounds], 0.4, color=colour,
                   label=f"{which} start" + (" (nothing compiled)" if which == "first" else " (graphs loaded)"))
        reference(ax, SECOND_START_GOAL_S, f"goal of every later start: {SECOND_START_GOAL_S:.0f} s", color="tab:blue")
        ax.set_xticks(rounds, labels=[f"round {r}" for r in rounds])
        ax.set_ylim(0, 1.3 * max(SECOND_START_GOAL_S, *(s.seconds_to_ready for s in result.starts)))  # legend room
        ax.set_ylabel("seconds to Ready")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")

    return [draw(folder / "startup-seconds-to-ready.png",
                 f"kimi-eagle serve {result.profile} to its Ready line ({result.started_utc[:10]})", paint,
                 size=(6.0, 4.0))]


RESULTS = ModeResults(mode="startup", prefix=FULL.mode, model=StartupResult, markdown=markdown, plots=plots)


def register(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("startup", help="how long `kimi-eagle serve PROFILE` takes to its Ready line, the first "
                                         "time and every later time",
                         description="What `make serve` runs, timed to its Ready line: each round with an empty "
                                     "compile cache of its own, a first start (nothing compiled) and a second (what "
                                     "the first saved); about 5 minutes. Writes OUT/startup-<time>.json and .md.")
    add_run_options(p, quick="1 round, its cache linked to the inductor kernels compiled before: proves the mode "
                             "runs; its figures are not for comparison", rounds=FULL.rounds)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_of(FULL, QUICK, args)
    measuring = MeasuringRun.start(args, plan.mode)
    result = StartupBench(plan, measuring.profile, **measuring.bench_options).run()
    measuring.write(result, markdown)
    print(result.verdict)
    return 0
