"""`kimi-eagle bench speedup`: what the draft buys, the target alone against the target + draft at each k, by
concurrency, beside what an always-right draft would buy; the speed-up model fitted to it and the k it recommends.

Order (at most two servers up at once, each start measured as a cold start):
  1. the plain target (A) starts and stays up;
  2. for each k (the profile's k last): a spec server (B) starts; for `repeats` rounds, at every concurrency, one
     A sample then one B sample (A B A B), on the held-out prompts and on the "ceiling" prompts, those the draft
     predicts (almost) always;
  3. after the last k, A stops; the same spec configuration starts again with the runtime checks off, and on/off
     are interleaved the same way; then Locust runs against the spec server at the highest concurrency.
The speed-up model is calibrated on the largest k and checked against the other k of the sweep. The latest run's
figures: BENCHMARKS.md (`kimi-eagle bench render`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kimi_eagle import envs
from kimi_eagle.acceptance import Acceptance
from kimi_eagle.bench import report
from kimi_eagle.bench.client import BenchClient, Sample
from kimi_eagle.bench.machine import compile_cache_note, machine_now
from kimi_eagle.bench.plan import FULL, QUICK, BenchPlan
from kimi_eagle.bench.result import (
    BenchResult,
    CeilingProbe,
    ChecksOverhead,
    HarnessOverhead,
    ModeResults,
    ThroughputPoint,
    summed_acceptance,
)
from kimi_eagle.bench.servers import ColdStart, LiveServer, measured_server
from kimi_eagle.bench.speedup_model import Recommendation, recommend
from kimi_eagle.bench.stats import paired_ratios, spread
from kimi_eagle.bench.subcommand import BenchError, MeasuringRun, add_run_options, within_checkout
from kimi_eagle.fixtures.pair_spec import PREDICTABLE_PROMPTS_FILE
from kimi_eagle.loadtest import serve_bench
from kimi_eagle.loadtest.serve_bench import ServeBenchResult
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.profile import Profile

RESULTS = ModeResults(mode="speedup", prefix=FULL.mode, model=BenchResult, markdown=report.markdown,
                      plots=report.plots)


def register(modes: argparse._SubParsersAction) -> None:
    p = modes.add_parser("speedup", help="what the draft buys: the target alone against target + draft, k = 1..5, by "
                                         "concurrency, beside an always-right draft; recommends num_speculative_tokens",
                         description="Starts its own vLLM servers (at most two at once) and writes "
                                     "OUT/full-<time>.json and .md. The full run takes about 15 minutes on 2 cores.")
    add_run_options(p, quick="k=3 only, 2 rounds, 16 tokens, no checks-off server: proves the benchmark works in "
                              "under 3 minutes; its figures are not for comparison")
    p.add_argument("--report", type=Path, metavar="RESULTS_JSON",
                   help="start no server: recompute the recommendation from an earlier results file and rewrite "
                        "its .json and .md (the measured figures are kept as they are)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.report:
        return rewrite_report(args.report)
    plan = QUICK if args.quick else FULL
    measuring = MeasuringRun.start(args, plan.mode)
    bench = Bench(plan, measuring.profile, prompts_file=measuring.prompts_file, **measuring.bench_options)
    result = bench.run()
    json_path = measuring.write(result, report.markdown)
    # Each point and side as one `vllm bench serve --append-result` line, to be put beside a GPU host's runs.
    vllm_path = serve_bench.write(json_path.with_suffix(".vllm_bench_serve.jsonl"), bench.vllm_bench_form)
    measuring.console.print(f"results in `vllm bench serve` form: {vllm_path}")
    print("Profile setting to use (serve/profiles/<profile>.yaml), by concurrency:")
    print(report.profile_setting(result.recommendations))
    return 0


def rewrite_report(path: Path) -> int:
    """The recommendation of an earlier results file recomputed, its .json and .md rewritten."""
    from kimi_eagle.loadtest.files import write_atomic, write_model

    try:
        data = json.loads(path.read_text())
        # Derived, and recomputed below: a file written by an older model still loads.
        data["recommendations"] = []
        result = BenchResult.model_validate(data)
    except (OSError, ValueError, TypeError) as exc:  # json's and pydantic's errors are ValueErrors
        raise BenchError(f"{path} is not a results file of `kimi-eagle bench speedup`: {exc}") from None
    result.recommendations, _ = recommendations(result.throughput)
    write_model(path, result)
    write_atomic(path.with_suffix(".md"), report.markdown(result))
    print(f"rewrote {path} and {path.with_suffix('.md')}", file=sys.stderr)
    print("Profile setting to use (serve/profiles/<profile>.yaml), by concurrency:")
    print(report.profile_setting(result.recommendations))
    return 0


def ceiling_candidates(prompts: list[str], count: int) -> list[str]:
    """Prompts whose greedy continuation a draft may predict almost always, to be measured: those the shipped draft
    predicts best (`fixtures/data/predictable_prompts.json`, for the tiny pair), then prompts that repeat a short
    phrase of the held-out ones, which a target that loops keeps repeating. No draft proposes a target's greedy
    tokens in general; this is how an "always right" draft can be measured with the real pair, same servers, same
    requests."""
    out = json.loads(PREDICTABLE_PROMPTS_FILE.read_text()) if PREDICTABLE_PROMPTS_FILE.exists() else []
    for prompt in prompts[:count]:
        phrase = " ".join(prompt.split()[:6])
        out.append(" ".join([phrase] * 10))
    return out


def ceiling_prompts(probes: list[CeilingProbe], tolerance: float = 0.05) -> list[str]:
    """The probed prompts within `tolerance` of the best acceptance rate, best first: several, so that the ceiling
    at a concurrency above 1 is not one request repeated (whose shared prefix and identical steps flatter it)."""
    rates = {p.prompt: p.acceptance_rate or 0.0 for p in probes}
    best = max(rates.values())
    return sorted((prompt for prompt, rate in rates.items() if rate >= best - tolerance), key=rates.get, reverse=True)


@dataclass
class PairedSamples:
    a: list[Sample] = field(default_factory=list)
    b: list[Sample] = field(default_factory=list)


class Bench:
    def __init__(self, plan: BenchPlan, profile: Profile, *, target: str | None, draft: str | None,
                 prompts: list[str], prompts_file: Path, files_dir: Path, command_line: str,
                 say: Callable[[str], None]) -> None:
        self.plan, self.profile, self.target, self.draft = plan, profile, target, draft
        self.prompts, self.prompts_file, self.files_dir = prompts, prompts_file, files_dir
        self.command_line, self.say = command_line, say
        self.cold_starts: list[ColdStart] = []
        self.points: list[ThroughputPoint] = []
        self.checks: list[ChecksOverhead] = []
        self.harness: HarnessOverhead | None = None
        self.ceiling_prompts: list[str] = []
        self.probes: list[CeilingProbe] = []
        self.notes: list[str] = []
        self.vllm_bench_form: list[ServeBenchResult] = []  # each point and side as `vllm bench serve` writes a run

    # --- servers -------------------------------------------------------------------------------------------------

    @contextmanager
    def _server(self, config: str, k: int | None, *, checks: bool = True, others: int = 0) -> Iterator[LiveServer]:
        command = build_command(self.profile, target=self.target, draft=self.draft, no_draft=k is None,
                                num_speculative_tokens=k, port=free_port(),
                                extra_args=[w for name, value in self.plan.vllm_overrides.items()
                                            for w in (f"--{name}", value)])
        if not checks:
            command.env[envs.RUNTIME_CHECKS.name] = "0"
        log = self.files_dir / "logs" / f"{config}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        self.say(f"starting {config} ({'with' if k else 'without'} the draft{f', k={k}' if k else ''}; log {log})")
        live = None
        try:
            with measured_server(command, config=config, num_speculative_tokens=k, log=log,
                                 others_running=others) as live:
                self.say(f"  {config}: healthy after {live.cold_start.seconds_to_healthy:.1f}s, first token after "
                         f"{live.cold_start.seconds_to_first_token:.1f}s")
                yield live
        finally:
            if live is not None:
                self.cold_starts.append(live.finish())

    def _client(self, live: LiveServer) -> BenchClient:
        return BenchClient(live.url, live.model, self.plan.max_tokens)

    # --- the run -------------------------------------------------------------------------------------------------

    def run(self) -> BenchResult:
        started_utc = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        t0, load_before = time.perf_counter(), os.getloadavg()
        profile_k = self.profile.speculative.num_speculative_tokens
        last_k = profile_k if profile_k in self.plan.ks else max(self.plan.ks)
        order = [k for k in self.plan.ks if k != last_k] + [last_k]
        self.notes.append(compile_cache_note())
        with ExitStack() as plain_stack:
            plain = plain_stack.enter_context(self._server("plain", None))
            for k in order:
                with self._server(f"spec-k{k}", k, others=1) as spec:
                    if not self.ceiling_prompts:
                        self._probe_ceiling(self._client(spec))
                    self._sweep(self._client(plain), self._client(spec), k)
                    if k == last_k:
                        plain_stack.close()  # two servers at most: the checks-off twin replaces the plain one
                        if self.plan.checks_concurrency:
                            self._checks_phase(spec, k)
                        self._harness_phase(spec, k)
        result = BenchResult(
            mode=self.plan.mode, command=self.command_line, started_utc=started_utc,
            duration_s=time.perf_counter() - t0, machine=machine_now(load_before), profile=self.profile.name,
            target=self.target or self.profile.target, draft=self.draft or str(self.profile.draft),
            prompts_file=within_checkout(self.prompts_file), plan=self.plan,
            ceiling_prompt=self.ceiling_prompts[0] if self.ceiling_prompts else None,
            ceiling_prompts=self.ceiling_prompts, ceiling_probes=self.probes, throughput=self.points,
            cold_starts=self.cold_starts, checks=self.checks, harness=self.harness,
            recommendations=self._recommendations(), notes=self.notes)
        return result

    def _probe_ceiling(self, spec: BenchClient) -> None:
        for candidate in ceiling_candidates(self.prompts, self.plan.ceiling_candidates):
            acceptance = spec.measure([candidate], 1, 1, with_acceptance=True).acceptance
            self.probes.append(CeilingProbe(prompt=candidate, acceptance_rate=acceptance and acceptance.acceptance_rate,
                                            mean_acceptance_length=acceptance and acceptance.mean_acceptance_length))
        self.ceiling_prompts = ceiling_prompts(self.probes)
        best = max(self.probes, key=lambda p: p.acceptance_rate or 0.0)
        rate = "n/a" if best.acceptance_rate is None else f"{best.acceptance_rate:.2f}"
        self.say(f"  ceiling: {len(self.ceiling_prompts)} of {len(self.probes)} probed prompts (best acceptance "
                 f"rate {rate}, {best.prompt[:40]!r}...)")

    def _sweep(self, plain: BenchClient, spec: BenchClient, k: int) -> None:
        cells: dict[tuple[str, int], PairedSamples] = {}
        workloads = [("held-out", c, self.prompts) for c in self.plan.concurrency]
        workloads += [("ceiling", c, self.ceiling_prompts or self.prompts) for c in self.plan.concurrency]
        for round_no in range(1, self.plan.repeats + 1):
            for name, c, prompts in workloads:
                n = self.plan.ceiling_requests_at(c) if name == "ceiling" else self.plan.requests_at(c)
                cell = cells.setdefault((name, c), PairedSamples())
                cell.a.append(plain.measure(prompts, c, n))
                cell.b.append(spec.measure(prompts, c, n, with_acceptance=True))
            line = ", ".join(f"{name} c={c}: {cells[name, c].a[-1].tokens_per_s:.0f} -> "
                             f"{cells[name, c].b[-1].tokens_per_s:.0f}" for name, c, _ in workloads)
            self.say(f"  k={k} round {round_no}/{self.plan.repeats} (tok/s plain -> spec): {line}")
        for (name, c), cell in cells.items():
            a = [s.tokens_per_s for s in cell.a]
            b = [s.tokens_per_s for s in cell.b]
            identical = None
            if c == 1:
                pairs = list(zip(cell.a[0].token_ids, cell.b[0].token_ids))
                identical = [sum(x == y for x, y in pairs), len(pairs)]
            self.points.append(ThroughputPoint(
                workload=name, num_speculative_tokens=k, concurrency=c, requests_per_sample=cell.a[0].requests,
                plain_tokens_per_s=spread(a), spec_tokens_per_s=spread(b),
                speedup_of_medians=spread(b).median / spread(a).median,
                paired_speedup=spread(paired_ratios(b, a)), acceptance=summed_acceptance(cell.b),
                identical_outputs=identical))
            for side, client, samples in (("plain", plain, cell.a), (f"spec k={k}", spec, cell.b)):
                self.vllm_bench_form.append(_in_vllm_bench_form(f"{name} c={c} {side}", client.model, samples))

    def _checks_phase(self, spec_on: LiveServer, k: int) -> None:
        with self._server(f"spec-k{k}-checks-off", k, checks=False, others=1) as spec_off:
            on, off = self._client(spec_on), self._client(spec_off)
            for c in self.plan.checks_concurrency:
                n = self.plan.requests_at(c)
                cell = PairedSamples()
                for _ in range(self.plan.repeats):
                    cell.a.append(on.measure(self.prompts, c, n))
                    cell.b.append(off.measure(self.prompts, c, n))
                self.checks.append(checks_overhead(k, c, [s.tokens_per_s for s in cell.a],
                                                   [s.tokens_per_s for s in cell.b]))
                self.say(f"  runtime checks at c={c}: {self.checks[-1].verdict}")

    def _harness_phase(self, spec: LiveServer, k: int) -> None:
        from kimi_eagle.loadtest.runner import LoadTestError, LocustRun, run_locust
        from kimi_eagle.loadtest.workload import Workload

        c = max(self.plan.concurrency)
        client = self._client(spec)
        own = [client.measure(self.prompts, c, self.plan.requests_at(c)) for _ in range(self.plan.repeats)]
        prompts_jsonl = self.files_dir / "heldout_prompts.jsonl"
        prompts_jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in self.prompts))
        workload = Workload(url=spec.url, model=spec.model, stream=False, prompts=str(prompts_jsonl),
                            max_tokens=self.plan.max_tokens, ignore_eos=True, temperature=0.0)
        out = self.files_dir / "locust"
        run = LocustRun(workload=workload, out_dir=out, users=c, spawn_rate=float(4 * c),
                        run_time=self.plan.locust_run_time, label=f"bench harness overhead, spec k={k}")
        self.say(f"  Locust: {c} users for {self.plan.locust_run_time} against spec-k{k}")
        # Locust runs as a child process: getrusage(RUSAGE_CHILDREN) grows by exactly its CPU time once it is reaped.
        before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        try:
            _, summary = run_locust(run, timeout_s=600)
        except LoadTestError as exc:
            self.notes.append(f"Locust harness run failed: {exc}")
            summary = None
        after, locust_wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
        locust_cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        own_tps = spread([s.tokens_per_s for s in own])
        own_cpu = 1000 * sum(s.client_cpu_s for s in own) / sum(s.completion_tokens for s in own)
        locust_tps = summary.throughput.output_tokens_per_s if summary else None
        locust_tokens = summary.tokens.completion_tokens_total if summary else None
        self.harness = HarnessOverhead(
            concurrency=c, server=f"spec-k{k}", own_client_tokens_per_s=own_tps,
            own_client_cpu_s_per_1k_tokens=own_cpu,
            own_client_cpu_percent=100 * sum(s.client_cpu_s for s in own) / sum(s.seconds for s in own),
            locust_tokens_per_s=locust_tps, locust_cpu_percent=100 * locust_cpu / locust_wall,
            locust_wall_s=locust_wall,
            locust_cpu_s_per_1k_tokens=1000 * locust_cpu / locust_tokens if locust_tokens else None,
            locust_requests_ok=summary.requests.ok if summary else None,
            locust_harness_cpu_percent_max=summary.client_overhead.harness_cpu_percent_max if summary else None,
            locust_results=str(out),
            tokens_per_s_lost_percent=(1 - locust_tps / own_tps.median) * 100 if locust_tps else None)

    def _recommendations(self) -> list[Recommendation]:
        recs, notes = recommendations(self.points)
        self.notes += notes
        return recs


def recommendations(points: list[ThroughputPoint]) -> tuple[list[Recommendation], list[str]]:
    """At each concurrency: the speed-up model from the held-out sweep, its best k, checked against the sweep.
    Pure: `kimi-eagle bench speedup --report FILE` recomputes it from a results file."""
    out, notes = [], []
    for c in sorted({p.concurrency for p in points}):
        by_k = {p.num_speculative_tokens: p for p in points
                if p.workload == "held-out" and p.concurrency == c and p.acceptance is not None}
        if not by_k:
            notes.append(f"no recommendation at concurrency {c}: no acceptance figures")
            continue
        largest = by_k[max(by_k)]
        measured = {k: (p.paired_speedup.median, p.paired_speedup.min, 1 + sum(p.acceptance.per_position))
                    for k, p in by_k.items()}
        out.append(recommend(c, largest.acceptance.per_position, measured))
    return out, notes


def checks_overhead(k: int, concurrency: int, on: list[float], off: list[float]) -> ChecksOverhead:
    s_on, s_off = spread(on), spread(off)
    cost = (s_off.median / s_on.median - 1) * 100
    noise = max(s_on.relative_range, s_off.relative_range) / 2 * 100
    goal = "meets the 1% goal" if abs(cost) <= 1 else "misses the 1% goal"
    where = "inside" if abs(cost) <= noise else "outside"
    verdict = (f"checks cost {cost:+.2f}% of tokens/s ({goal}); noise band +/-{noise:.2f}%, so the difference is "
               f"{where} the noise")
    return ChecksOverhead(num_speculative_tokens=k, concurrency=concurrency, checks_on_tokens_per_s=s_on,
                          checks_off_tokens_per_s=s_off, cost_percent=cost,
                          paired_off_over_on=spread(paired_ratios(off, on)), noise_band_percent=noise,
                          verdict=verdict)


def _in_vllm_bench_form(label: str, model: str, samples: list[Sample]) -> ServeBenchResult:
    figures = summed_acceptance(samples)
    acceptance = None if figures is None else Acceptance(
        speculation="on", source="vLLM's counters around each sample", num_verify_steps=figures.verify_steps,
        num_draft_tokens=figures.draft_tokens, num_accepted_tokens=figures.accepted_tokens,
        acceptance_rate=figures.acceptance_rate, mean_acceptance_length=figures.mean_acceptance_length,
        per_position_acceptance_rate=figures.per_position)
    return serve_bench.from_batches(
        label=label, model=model, concurrency=samples[0].concurrency, seconds=sum(s.seconds for s in samples),
        requests=sum(s.requests for s in samples), input_tokens=sum(s.prompt_tokens for s in samples),
        output_tokens=sum(s.completion_tokens for s in samples),
        latencies_ms=[1000 * t for s in samples for t in s.latencies_s], acceptance=acceptance)
