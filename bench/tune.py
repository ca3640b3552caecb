"""`kimi-eagle bench tune`: how many draft tokens to propose at each batch size, measured on this machine.

Speculation pays at low load and costs at high load; vLLM 0.32 can follow the load with a schedule
(`num_speculative_tokens_per_batch_size`: batch-size ranges -> k, 0 allowed) but ships none and measures none.
1. Sweep: the target alone and the draft at k = 1..K, one server at a time (two would share the cores), each round
   in an order rotated by round; at each concurrency of the sweep, the median tokens/s of each. The best k at each
   concurrency (0 where the target alone is fastest; the k of the concurrency below where it ties the best within
   the noise band) becomes the schedule: concurrency c_i's k covers batch sizes (c_(i-1), c_i], the last range up
   to max-num-seqs.
2. Proof: the tuned schedule served side by side with the target alone and every fixed k that won somewhere, rotated
   by round again; at each concurrency the tuned server against the fastest of the others, within the noise band.
   Where it falls behind, the proof's fastest there replaces the sweep's choice: the schedule after the proof, which
   the profile gets (the proof has more rounds than the sweep, and one slow round of the sweep can pick a k).
3. Threshold: on the tuned server, a load that alternates between the two concurrencies on either side of a schedule
   boundary (vLLM issue 49548: throughput collapsing where the batch crosses one), against what the steady loads
   of phase 2 predict for the same requests.
The latest run's figures: BENCHMARKS.md (`kimi-eagle bench render`).
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from collections.abc import Callable
from pathlib import Path

from matplotlib.figure import Figure
from pydantic import BaseModel, Field

from kimi_eagle.bench.client import BenchClient
from kimi_eagle.bench.machine import machine_now
from kimi_eagle.bench.plan import StreamsPlan, rotated
from kimi_eagle.bench.plots import TARGET_ALONE, Plot, draw, log2_axis, reference
from kimi_eagle.bench.result import Machine, ModeResults, run_line
from kimi_eagle.bench.servers import measured_server
from kimi_eagle.bench.stats import Spread, spread
from kimi_eagle.bench.subcommand import MeasuringRun, add_run_options, plan_of, within_checkout
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.profile import Profile

Schedule = list[tuple[int, int, int]]
ALONE = 0  # k of the target alone in the sweep's tables
COLLAPSE_RATIO = 0.8  # crossing-load tokens/s below this share of the steady loads' prediction is a collapse


class TunePlan(StreamsPlan):
    mode: str
    ks: list[int] = Field(description="Fixed k swept besides the target alone.")
    concurrency: list[int] = Field(description="Requests in flight of each sample; max-num-seqs is added.")
    rounds: int = Field(ge=1, description="Rounds of the sweep.")
    proof_rounds: int = Field(default=2, ge=1, description="Rounds of the proof: more than the sweep's, because the "
                              "proof judges differences of a few percent, and servers started minutes apart differ "
                              "by that much (2 rounds gave a band of 1-3% against 323-348 tok/s for one "
                              "configuration).")
    max_tokens: int = Field(ge=2)
    crossing_s: float = Field(description="Length of the threshold-crossing load.")
    proof_against_sweep: bool = Field(default=False, description="Only the tuned server is started for the proof; "
                                      "the others are the sweep's own samples (one round each: a quick run).")


FULL = TunePlan(mode="tune", ks=[1, 2, 3, 4], concurrency=[1, 2, 4, 8, 16], rounds=2, proof_rounds=4, max_tokens=64,
                requests_per_stream=6, crossing_s=60)
# One k: choosing among several is the unit tests' (tests/unit/bench/test_tune.py); the quick run proves the stages
# end to end (sweep, schedule, proof, crossing, the profile written) with three servers started, not five: its proof
# judges the tuned server against the sweep's samples of the others.
QUICK = TunePlan(mode="tune-quick", ks=[3], concurrency=[1, 4], rounds=1, proof_rounds=1, max_tokens=16,
                 requests_per_stream=2, crossing_s=6, proof_against_sweep=True)


class TunePoint(BaseModel):
    config: str = Field(description="`alone`, `k=N` or `tuned`.")
    concurrency: int
    per_round: list[float] = Field(description="Output tokens/s in each round, in round order.")
    tokens_per_s: Spread


class ProofPoint(BaseModel):
    concurrency: int
    tuned: Spread
    best_other: str = Field(description="The fastest of the target alone and the fixed k at this concurrency.")
    best_other_tokens_per_s: Spread
    noise_band_percent: float = Field(description="Half the wider relative range of the two: what one round moves.")
    ratio: float = Field(description="median(tuned) / median(best_other).")
    holds: bool = Field(description="ratio >= 1 - noise band.")


class Crossing(BaseModel):
    concurrencies: tuple[int, int] = Field(description="The two loads it alternates between (either side of a "
                                                       "boundary of the schedule).")
    seconds: float
    segments: int
    tokens_per_s: float
    predicted_tokens_per_s: float = Field(description="The same segments at phase 2's steady medians.")
    ratio: float
    collapsed: bool = Field(description=f"ratio < {COLLAPSE_RATIO}.")


class TuneResult(BaseModel):
    command: str
    started_utc: str
    duration_s: float
    machine: Machine
    profile: str
    plan: TunePlan
    max_num_seqs: int
    sweep: list[TunePoint]
    best_k: dict[int, int] = Field(description="Concurrency -> the k with the highest median in the sweep (0: alone).")
    schedule: Schedule | None = Field(description="[first, last, k] batch-size ranges; None when no k beat the "
                                                  "target alone anywhere (serve without the draft).")
    proof: list[TunePoint]
    proof_points: list[ProofPoint]
    schedule_after_proof: Schedule | None = Field(
        default=None, description="The schedule with the proof's fastest configuration wherever the tuned one fell "
                                  "behind it beyond the noise band; None when the proof held at every concurrency.")
    crossing: Crossing | None
    verdict: str


def best_k_by_concurrency(points: list[TunePoint]) -> dict[int, int]:
    """The k with the highest median at each concurrency, except that the k of the concurrency below is kept where
    its median is within the noise band of the best (half the wider relative range of the two, as the proof
    judges): a tie is not a reason to split the schedule, and its largest k sizes vLLM's drafter
    (`num_speculative_tokens`) for every batch."""
    out: dict[int, int] = {}
    below = None
    for c in sorted({p.concurrency for p in points}):
        at_c = [p for p in points if p.concurrency == c]
        best = max(at_c, key=lambda p: p.tokens_per_s.median)
        chosen = config_k(best.config)
        kept = next((p for p in at_c if below is not None and config_k(p.config) == below), None)
        if kept is not None:
            noise = max(best.tokens_per_s.relative_range, kept.tokens_per_s.relative_range) / 2
            if kept.tokens_per_s.median >= best.tokens_per_s.median * (1 - noise):
                chosen = below
        out[c] = below = chosen
    return out


def config_k(config: str) -> int:
    return ALONE if config == "alone" else int(config.removeprefix("k="))


def schedule_from(best_k: dict[int, int], max_num_seqs: int) -> Schedule | None:
    """Concurrency c_i's k for batch sizes (c_(i-1), c_i], the last range to max_num_seqs; equal neighbours merged."""
    if not any(best_k.values()):
        return None
    ranges: list[list[int]] = []
    first = 1
    sizes = sorted(c for c in best_k if c <= max_num_seqs)
    for i, c in enumerate(sizes):
        last = max_num_seqs if i == len(sizes) - 1 else c
        if ranges and ranges[-1][2] == best_k[c]:
            ranges[-1][1] = last
        else:
            ranges.append([first, last, best_k[c]])
        first = last + 1
    return [(a, b, k) for a, b, k in ranges]


def boundary(schedule: Schedule, concurrency: list[int]) -> tuple[int, int] | None:
    """Two neighbouring concurrencies of the sweep whose batch sizes the schedule gives different k, preferring one
    where speculation turns off (the switch vLLM issue 49548 saw collapse, and where the draft's KV cache misses the
    tokens of the k=0 steps); None when the schedule has one k."""
    def k_at(c: int) -> int:
        return next(k for a, b, k in schedule if a <= c <= b)

    pairs = [(lo, hi) for lo, hi in itertools.pairwise(sorted(concurrency)) if k_at(lo) != k_at(hi)]
    return next((pair for pair in pairs if 0 in (k_at(pair[0]), k_at(pair[1]))), next(iter(pairs), None))


def after_proof(best_k: dict[int, int], proof: list[ProofPoint], max_num_seqs: int) -> Schedule | None:
    """The schedule from the sweep's best k, except at each concurrency where the proof did not hold: there the k of
    the configuration the proof found fastest (0: the target alone). None when the proof held everywhere."""
    overruled = {p.concurrency: config_k(p.best_other) for p in proof if not p.holds}
    if not overruled:
        return None
    return schedule_from({**best_k, **overruled}, max_num_seqs) or []


def recommended_schedule(result: TuneResult) -> Schedule | None:
    """What the profile should carry: the schedule after the proof where it overruled the sweep, else the sweep's;
    None when speculation paid nowhere (serve without the draft)."""
    schedule = result.schedule if result.schedule_after_proof is None else result.schedule_after_proof
    return schedule or None


def judge_proof(points: list[TunePoint]) -> list[ProofPoint]:
    out = []
    for c in sorted({p.concurrency for p in points}):
        tuned = next(p for p in points if p.concurrency == c and p.config == "tuned")
        others = [p for p in points if p.concurrency == c and p.config != "tuned"]
        best = max(others, key=lambda p: p.tokens_per_s.median)
        noise = max(tuned.tokens_per_s.relative_range, best.tokens_per_s.relative_range) / 2
        ratio = tuned.tokens_per_s.median / best.tokens_per_s.median
        out.append(ProofPoint(concurrency=c, tuned=tuned.tokens_per_s, best_other=best.config,
                              best_other_tokens_per_s=best.tokens_per_s, noise_band_percent=100 * noise,
                              ratio=ratio, holds=ratio >= 1 - noise))
    return out


class TuneBench:
    def __init__(self, plan: TunePlan, profile: Profile, *, target: str | None, draft: str | None,
                 prompts: list[str], files_dir: Path, command_line: str, say: Callable[[str], None]) -> None:
        self.plan, self.profile, self.prompts, self.files_dir = plan, profile, prompts, files_dir
        self.target, self.draft, self.command_line, self.say = target, draft, command_line, say
        self.max_num_seqs = int(profile.vllm_args.get("max-num-seqs", profile.vllm_args.get("max_num_seqs", 256)))
        self.concurrency = sorted({c for c in plan.concurrency if c <= self.max_num_seqs} | {self.max_num_seqs})

    def run(self) -> TuneResult:
        started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0, load_before = time.perf_counter(), os.getloadavg()
        self.say("phase 1: the sweep (target alone, k = " + ", ".join(map(str, self.plan.ks)) + ")")
        sweep, _ = self._rounds(["alone", *(f"k={k}" for k in self.plan.ks)], self.plan.rounds, schedule=None)
        best_k = best_k_by_concurrency(sweep)
        schedule = schedule_from(best_k, self.max_num_seqs)
        self.say(f"best k by concurrency: {best_k}; schedule {schedule}")
        proof, crossing = [], None
        if schedule is not None:
            others = ["alone", *dict.fromkeys(f"k={k}" for k in best_k.values() if k != ALONE)]
            self.say("phase 2: the tuned schedule against " + ", ".join(others)
                     + (" (the sweep's samples of them)" if self.plan.proof_against_sweep else ""))
            started = ["tuned"] if self.plan.proof_against_sweep else [*others, "tuned"]
            proof, crossing = self._rounds(started, self.plan.proof_rounds, schedule=schedule,
                                           crossing=boundary(schedule, self.concurrency))
            if self.plan.proof_against_sweep:
                proof = [*(p for p in sweep if p.config in others), *proof]
        proof_points = judge_proof(proof) if proof else []
        corrected = after_proof(best_k, proof_points, self.max_num_seqs)
        return TuneResult(command=self.command_line, started_utc=started_utc, duration_s=time.perf_counter() - t0,
                          machine=machine_now(load_before), profile=self.profile.name, plan=self.plan,
                          max_num_seqs=self.max_num_seqs, sweep=sweep, best_k=best_k, schedule=schedule, proof=proof,
                          proof_points=proof_points, schedule_after_proof=corrected, crossing=crossing,
                          verdict=verdict(schedule, proof_points, crossing, corrected))

    def _rounds(self, configs: list[str], rounds: int, *, schedule: Schedule | None,
                crossing: tuple[int, int] | None = None) -> tuple[list[TunePoint], Crossing | None]:
        """Every configuration at every concurrency, rotated by round; in the last round the tuned server also runs
        the crossing load, when one is asked for."""
        samples: dict[tuple[str, int], list[float]] = {}
        crossed = None
        for round_no in range(1, rounds + 1):
            for config in rotated(configs, round_no):
                last = round_no == rounds and config == "tuned"
                crossed = (self._measure(config, schedule, samples, (round_no, rounds), crossing if last else None)
                           or crossed)
        points = [TunePoint(config=config, concurrency=c, per_round=samples[config, c],
                            tokens_per_s=spread(samples[config, c])) for config in configs for c in self.concurrency]
        return points, crossed

    def _profile_for(self, config: str, schedule: Schedule | None) -> tuple[Profile, int | None]:
        if config != "tuned":
            return self.profile, None if config == "alone" else config_k(config)
        speculative = self.profile.speculative.model_copy(update={
            "num_speculative_tokens": max(k for _, _, k in schedule),
            "num_speculative_tokens_per_batch_size": schedule})
        return self.profile.model_copy(update={"speculative": speculative}), None

    def _measure(self, config: str, schedule: Schedule | None, samples: dict, round_of: tuple[int, int],
                 crossing: tuple[int, int] | None) -> Crossing | None:
        round_no, rounds = round_of
        profile, k = self._profile_for(config, schedule)
        command = build_command(profile, target=self.target, draft=self.draft, no_draft=config == "alone",
                                num_speculative_tokens=k, port=free_port())
        log = self.files_dir / "logs" / f"{config.replace('=', '')}-r{round_no}-{len(samples)}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with measured_server(command, config=config, num_speculative_tokens=k, log=log) as live:
            client = BenchClient(live.url, live.model, self.plan.max_tokens)
            widest = max(self.concurrency)
            client.measure(self.prompts, widest, widest)  # unmeasured: each batch shape's first run is slower
            figures = []
            for c in self.concurrency:
                sample = client.measure(self.prompts, c, self.plan.requests_at(c))
                samples.setdefault((config, c), []).append(sample.tokens_per_s)
                figures.append(f"{sample.tokens_per_s:.0f}")
            crossed = self._cross(client, crossing, samples) if crossing is not None else None
        self.say(f"  round {round_no}/{rounds} {config}: ready in {live.cold_start.seconds_to_healthy:.0f}s;"
                 f" tok/s {' / '.join(figures)} (concurrency {' / '.join(map(str, self.concurrency))})")
        return crossed

    def _cross(self, client: BenchClient, pair: tuple[int, int], samples: dict) -> Crossing:
        tokens, seconds, predicted_s, segments = 0, 0.0, 0.0, 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < self.plan.crossing_s:
            c = pair[segments % 2]
            sample = client.measure(self.prompts, c, 2 * c)
            tokens += sample.completion_tokens
            seconds += sample.seconds
            predicted_s += sample.completion_tokens / spread(samples["tuned", c]).median
            segments += 1
        ratio = (tokens / seconds) / (tokens / predicted_s)
        crossing = Crossing(concurrencies=pair, seconds=seconds, segments=segments, tokens_per_s=tokens / seconds,
                            predicted_tokens_per_s=tokens / predicted_s, ratio=ratio,
                            collapsed=ratio < COLLAPSE_RATIO)
        self.say(f"  crossing {pair[0]} <-> {pair[1]} in flight for {seconds:.0f}s: {crossing.tokens_per_s:.0f} tok/s, "
                 f"{ratio:.2f}x what the steady loads predict")
        return crossing


def verdict(schedule: Schedule | None, proof: list[ProofPoint], crossing: Crossing | None,
            corrected: Schedule | None = None) -> str:
    if schedule is None:
        return "no k beat the target alone at any concurrency: serve this pair without its draft"
    misses = [f"{p.concurrency} in flight: {p.ratio:.2f}x {p.best_other} (noise band {p.noise_band_percent:.1f}%)"
              for p in proof if not p.holds]
    held = ("the tuned schedule is at least the fastest of the target alone and the fixed k at every concurrency, "
            "within the noise" if not misses else "the tuned schedule falls behind at " + "; ".join(misses))
    if crossing is None:
        cross = "no boundary of the schedule lies between two loads of the sweep"
    else:
        cross = (f"alternating {crossing.concurrencies[0]} <-> {crossing.concurrencies[1]} in flight gave "
                 f"{crossing.ratio:.2f}x the steady prediction ("
                 + ("a collapse" if crossing.collapsed else "no collapse") + ")")
    text = f"schedule {[list(r) for r in schedule]}: {held}; {cross}"
    if corrected is not None:
        text += ("; after the proof: " + (f"{[list(r) for r in corrected]}, the proof's fastest where the tuned "
                                          "schedule fell behind (run `kimi-eagle bench tune` again to prove it whole)"
                                          if corrected else "no k beat the target alone: serve without the draft"))
    return text


def profile_setting(result: TuneResult) -> str:
    schedule = recommended_schedule(result)
    if schedule is None:
        return "# no schedule: no k beat the target alone"
    return "\n".join(["speculative:", f"  num_speculative_tokens: {max(k for _, _, k in schedule)}",
                      f"  num_speculative_tokens_per_batch_size: {[list(r) for r in schedule]}"])


def markdown(result: TuneResult) -> str:
    cs = sorted({p.concurrency for p in result.sweep})
    header = ["| configuration | " + " | ".join(f"{c} in flight" for c in cs) + " |", "|---" * (len(cs) + 1) + "|"]

    def table(points: list[TunePoint]) -> list[str]:
        rows = []
        for config in dict.fromkeys(p.config for p in points):
            cells = [next(p for p in points if p.config == config and p.concurrency == c).tokens_per_s for c in cs]
            rows.append(f"| {config} | " + " | ".join(s.cell() for s in cells) + " |")
        return header + rows

    lines = [f"# Draft tokens by batch size for profile {result.profile}", "",
             run_line(result.command, result.started_utc, result.duration_s, result.machine)
             + f"{result.plan.rounds} rounds in the sweep, {result.plan.proof_rounds} in the proof, "
             f"{result.plan.max_tokens} tokens per request (ignore_eos, "
             "greedy, not streamed), one server at a time, order rotated by round.", "",
             "## Sweep: output tokens/s, median [min-max]", "", *table(result.sweep), "",
             "Best k by concurrency (0: the target alone): "
             + ", ".join(f"{c}: {k}" for c, k in result.best_k.items()) + ".", "",
             f"Schedule: `num_speculative_tokens_per_batch_size: "
             f"{[list(r) for r in result.schedule] if result.schedule else None}`.", ""]
    if result.proof:
        lines += ["## Proof: the tuned schedule side by side", "", *table(result.proof), "",
                  "| in flight | tuned | fastest other | ratio | noise band | holds |", "|---|---|---|---|---|---|"]
        lines += [f"| {p.concurrency} | {p.tuned.median:.0f} | {p.best_other} {p.best_other_tokens_per_s.median:.0f} | "
                  f"{p.ratio:.2f}x | {p.noise_band_percent:.1f}% | {'yes' if p.holds else 'no'} |"
                  for p in result.proof_points]
        lines.append("")
        if result.schedule_after_proof is not None:
            lines += ["Schedule after the proof (the proof's fastest where the tuned schedule fell behind): "
                      f"`{[list(r) for r in result.schedule_after_proof] or None}`.", ""]
    if result.crossing:
        x = result.crossing
        lines += [f"Threshold crossing: {x.segments} segments alternating {x.concurrencies[0]} and "
                  f"{x.concurrencies[1]} in flight for {x.seconds:.0f} s on the tuned server: {x.tokens_per_s:.0f} "
                  f"tok/s against {x.predicted_tokens_per_s:.0f} predicted from the steady loads ({x.ratio:.2f}x).", ""]
    lines += [f"**{result.verdict}.**", ""]
    return "\n".join(lines)


def plots(result: TuneResult, folder: Path) -> list[Plot]:
    """Each fixed k of the sweep over the target alone by concurrency, and the tuned schedule over the target alone
    in the proof (each over the target alone of its own phase)."""
    def ratios(points: list[TunePoint], config: str) -> tuple[list[int], list[float]]:
        alone = {p.concurrency: p.tokens_per_s.median for p in points if p.config == "alone"}
        mine = sorted((p for p in points if p.config == config), key=lambda p: p.concurrency)
        return [p.concurrency for p in mine], [p.tokens_per_s.median / alone[p.concurrency] for p in mine]

    def paint(figure: Figure) -> None:
        ax = figure.subplots()
        for config in dict.fromkeys(p.config for p in result.sweep if p.config != "alone"):
            ax.plot(*ratios(result.sweep, config), marker="o", linewidth=1, label=f"{config}, sweep")
        if any(p.config == "tuned" for p in result.proof):
            ax.plot(*ratios(result.proof, "tuned"), marker="s", color="black", linewidth=2.5,
                    label="tuned schedule, proof")
        reference(ax, 1.0, TARGET_ALONE)
        log2_axis(ax, sorted({p.concurrency for p in result.sweep}), "requests in flight")
        ax.set_ylabel("tokens/s over the target alone (x)")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize="small")

    return [draw(folder / "tune-speedup-by-concurrency.png",
                 f"Draft tokens by batch size: speed-up by concurrency ({result.started_utc[:10]}, medians)", paint)]


RESULTS = ModeResults(mode="tune", prefix=FULL.mode, model=TuneResult, markdown=markdown, plots=plots)


def register(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("tune", help="the number of draft tokens for each batch size, as a vLLM schedule for the "
                                      "profile, proven side by side",
                         description="The target alone and k=1..4 at 1, 2, 4, 8, 16 and max-num-seqs in flight, one "
                                     "server at a time; the best k per batch-size range (0 where speculation loses) "
                                     "becomes a `num_speculative_tokens_per_batch_size` schedule, then measured side "
                                     "by side with the target alone and the fixed k it beat, and across a schedule "
                                     "boundary (about 20 minutes). Writes OUT/tune-<time>.json and .md.")
    add_run_options(p, quick="k=3 at 1 and 4 in flight, 3 minutes; its figures are not for comparison")
    p.add_argument("--write-profile", action="store_true", help="write the schedule into the profile's YAML file")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    plan = plan_of(FULL, QUICK, args)
    measuring = MeasuringRun.start(args, plan.mode)
    result = TuneBench(plan, measuring.profile, **measuring.bench_options).run()
    json_path = measuring.write(result, markdown)
    print(result.verdict)
    schedule = recommended_schedule(result)
    if args.write_profile and schedule is not None:
        from kimi_eagle.serve.profile import profile_path, write_schedule

        path = profile_path(args.profile)
        write_schedule(path, schedule, source=within_checkout(json_path))
        measuring.console.print(f"wrote the schedule into {path}")
    print("Profile setting (serve/profiles/<profile>.yaml):")
    print(profile_setting(result))
    return 0
