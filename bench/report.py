"""The speed-up run's report: its Markdown, its plots and the profile setting it recommends."""

from __future__ import annotations

from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure

from kimi_eagle.bench.plots import TARGET_ALONE, Plot, draw, log2_axis, reference, spread_line
from kimi_eagle.bench.result import BenchResult, ThroughputPoint, isa_note
from kimi_eagle.bench.speedup_model import Recommendation, tokens_per_step
from kimi_eagle.bench.stats import Spread


def _s(s: Spread | None, digits: int = 1) -> str:
    if s is None:
        return "n/a"
    return f"{s.median:.{digits}f} [{s.min:.{digits}f}, {s.max:.{digits}f}]"


def _x(s: Spread) -> str:
    return f"{s.median:.2f}x [{s.min:.2f}, {s.max:.2f}]"


def _positions(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def _largest(by_process: dict[str, int], count: int = 3) -> str:
    top = sorted(by_process.items(), key=lambda item: -item[1])[:count]
    return ", ".join(f"{name.split(' (')[0]} {rss / 2**30:.2f}" for name, rss in top)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|",
            *("| " + " | ".join(row) + " |" for row in rows), ""]


def profile_setting(recs: list[Recommendation]) -> str:
    """The setting to put in the serving profile, one line per concurrency."""
    lines = []
    for r in recs:
        if r.recommended_k is None:
            lines.append(f"concurrency {r.concurrency:>3}: turn speculation off (`kimi-eagle serve --no-draft`, or "
                         f"`draft: null` in the profile): no k is predicted to beat the target alone")
        else:
            predicted = r.predicted_speedup_by_k[r.recommended_k]
            measured = r.measured_speedup_by_k.get(r.recommended_k)
            seen = f", measured {measured:.2f}x" if measured is not None else ""
            lines.append(f"concurrency {r.concurrency:>3}: speculative.num_speculative_tokens: {r.recommended_k}   "
                         f"(predicted {predicted:.2f}x{seen}; {r.verdict or 'not checked'})")
    return "\n".join(lines)


def _point_rows(points: list[ThroughputPoint]) -> list[list[str]]:
    rows = []
    for p in points:
        acc = p.acceptance
        same = f"{p.identical_outputs[0]}/{p.identical_outputs[1]}" if p.identical_outputs else ""
        rows.append([str(p.num_speculative_tokens), str(p.concurrency), _s(p.plain_tokens_per_s),
                     _s(p.spec_tokens_per_s), _x(p.paired_speedup),
                     f"{acc.mean_acceptance_length:.2f}" if acc and acc.mean_acceptance_length else "n/a", same])
    return rows


POINT_HEADER = ["k", "conc.", "target tok/s", "target+draft tok/s", "speed-up", "mean acc. length",
                "same greedy output"]


def markdown(result: BenchResult) -> str:
    sections = (_heading, _single_stream, _by_concurrency, _acceptance, _checks, _cold_starts, _harness,
                _recommendation)
    return "\n".join(line for section in sections for line in section(result))


def _heading(result: BenchResult) -> list[str]:
    m = result.machine
    return [f"# kimi-eagle bench speedup ({result.mode})", "",
            f"Command: `{result.command}`  ",
            f"Machine: {m.cpu_model}, {m.cpus} CPUs{isa_note(m)}, {m.memory_gib} GiB; vLLM {m.vllm_version}, torch "
            f"{m.torch_version}  ",
            f"Started {result.started_utc}, took {result.duration_s / 60:.1f} min; load average before "
            f"{' '.join(f'{x:.2f}' for x in m.load_average_before)}, after "
            f"{' '.join(f'{x:.2f}' for x in m.load_average_after)}  ",
            f"Profile {result.profile}: target `{result.target}`, draft `{result.draft}`; prompts "
            f"`{result.prompts_file}`; greedy, ignore_eos, {result.plan.max_tokens} output tokens per request, "
            f"{result.plan.repeats} interleaved rounds (A = target alone, B = with the draft).  ",
            *([f"vLLM flags over the profile's, for every server: "
               f"`{' '.join(f'--{k} {v}' for k, v in result.plan.vllm_overrides.items())}`  "]
              if result.plan.vllm_overrides else []),
            "Figures: median [min, max] over the rounds; speed-ups are round-by-round B/A.", ""]


def _held_out(result: BenchResult) -> list[ThroughputPoint]:
    return [p for p in result.throughput if p.workload == "held-out"]


def _single_stream(result: BenchResult) -> list[str]:
    out = ["## 1. Single stream: target alone vs target + draft", ""]
    out += _table(POINT_HEADER, _point_rows([p for p in _held_out(result) if p.concurrency == 1]))
    ceiling = [p for p in result.throughput if p.workload == "ceiling"]
    if ceiling:
        probe = next((p for p in result.ceiling_probes if p.prompt == result.ceiling_prompt), None)
        rate = f"{probe.acceptance_rate:.2f}" if probe and probe.acceptance_rate is not None else "n/a"
        count = len(result.ceiling_prompts) or 1
        out += ["Ceiling (a draft that is (almost) always right), at every concurrency: the same servers and "
                f"requests on the {count} probed prompt(s) whose greedy continuation the draft predicted best (best "
                f"probe acceptance rate {rate}: `{(result.ceiling_prompt or '')[:60]}...`). What speculation at "
                "most buys here at each load, whatever the draft.", ""]
        out += _table(POINT_HEADER, _point_rows(ceiling))
    return out


def _by_concurrency(result: BenchResult) -> list[str]:
    return ["## 2. Throughput by concurrency", "",
            *_table(POINT_HEADER, _point_rows([p for p in _held_out(result) if p.concurrency != 1]))]


def _acceptance(result: BenchResult) -> list[str]:
    out = ["## 3. Acceptance vs k, and the speed-up it allows", "",
           "Limit = E_k = 1 + sum of per-position acceptance (a free draft). Step cost c(k) = E_k / measured "
           "speed-up, in target steps. Model = E_k / (1 + s + k r): s, the fixed overhead of a speculative step, and "
           "r, the cost of one draft token, both in target steps, fitted through the smallest and largest k "
           "(bench/speedup_model.py); the k in between are predictions.", ""]
    recs = {r.concurrency: r for r in result.recommendations}
    rows = []
    for p in _held_out(result):
        if p.acceptance is None:
            continue
        k, rec = p.num_speculative_tokens, recs.get(p.concurrency)
        limit = tokens_per_step(p.acceptance.per_position, k)
        model = f"{rec.cost.speedup(p.acceptance.per_position, k):.2f}x" if rec else "n/a"
        cost = f"{limit / p.paired_speedup.median:.2f}"
        rows.append([str(k), str(p.concurrency), f"{p.acceptance.mean_acceptance_length:.2f}",
                     _positions(p.acceptance.per_position), f"{limit:.2f}x", cost, model, _x(p.paired_speedup)])
    out += _table(["k", "conc.", "mean acc. length", "per-position acceptance", "limit", "step cost c(k)",
                   "model (own acceptance)", "measured"], rows)
    return out + _table(["conc.", "s (fixed, target steps)", "r (per draft token, target steps)", "fitted at k",
                         "model with the largest k's acceptance, k = 1.."],
                        [[str(r.concurrency), f"{r.cost.fixed:.2f}", f"{r.cost.per_draft_token:.3f}",
                          ", ".join(map(str, r.cost.calibrated_at_k)),
                          " / ".join(f"{v:.2f}x" for v in r.predicted_speedup_by_k.values())]
                         for r in result.recommendations])


def _checks(result: BenchResult) -> list[str]:
    out = ["## 4. Overhead of the plugin's runtime checks", ""]
    if not result.checks:
        return [*out, "Not measured in this run (the quick mode skips it: it needs one more server start).", ""]
    return out + _table(["k", "conc.", "checks on tok/s", "checks off tok/s", "cost", "noise band", "verdict"],
                        [[str(c.num_speculative_tokens), str(c.concurrency), _s(c.checks_on_tokens_per_s),
                          _s(c.checks_off_tokens_per_s), f"{c.cost_percent:+.2f}%",
                          f"+/-{c.noise_band_percent:.2f}%", c.verdict] for c in result.checks])


def _cold_starts(result: BenchResult) -> list[str]:
    out = ["## 5. Cold start and memory", "",
           "Process start to first token (a 1-token completion sent when /health first answers); peak RSS summed "
           "over all the server's processes over its whole life (shared pages counted once per process).", ""]
    return out + _table(["server", "draft", "to /health s", "to first token s", "peak RSS GiB (all processes)",
                         "largest processes, peak RSS GiB", "other servers up"],
                        [[c.config, "yes" if c.draft else "no", f"{c.seconds_to_healthy:.1f}",
                          f"{c.seconds_to_first_token:.1f}",
                          f"{c.peak_rss_bytes / 2**30:.2f}" if c.peak_rss_bytes else "n/a",
                          _largest(c.peak_rss_bytes_by_process), str(c.other_servers_running)]
                         for c in result.cold_starts])


def _harness(result: BenchResult) -> list[str]:
    out = ["## 6. Harness overhead (Locust at the highest concurrency)", ""]
    h = result.harness
    if h is None:
        return out
    lost = f"{h.tokens_per_s_lost_percent:+.1f}%" if h.tokens_per_s_lost_percent is not None else "n/a"
    out += _table(["client", "conc.", "tok/s", "client CPU s / 1k tokens", "client CPU % of one core"],
                  [["own (threads, non-streamed)", str(h.concurrency), _s(h.own_client_tokens_per_s),
                    f"{h.own_client_cpu_s_per_1k_tokens:.3f}", f"{h.own_client_cpu_percent:.1f}"],
                   ["Locust (kimi-eagle loadtest runner, non-streamed)", str(h.concurrency),
                    f"{h.locust_tokens_per_s:.1f}" if h.locust_tokens_per_s else "n/a",
                    f"{h.locust_cpu_s_per_1k_tokens:.3f}" if h.locust_cpu_s_per_1k_tokens else "n/a",
                    f"{h.locust_cpu_percent:.1f}"]])
    return [*out, f"Against {h.server}, one Locust run of {h.locust_wall_s:.0f}s (its CPU includes its own "
                  f"start-up). Locust's tokens/s vs the own client's median: {lost} lost; highest CPU of a Locust "
                  f"process seen by the load test itself: {h.locust_harness_cpu_percent_max}%; "
                  f"{h.locust_requests_ok} requests OK (results in `{h.locust_results}`).", ""]


def _recommendation(result: BenchResult) -> list[str]:
    out = ["## 7. Recommended num_speculative_tokens", "", "```", profile_setting(result.recommendations), "```", ""]
    return out + (["## Notes", "", *(f"- {n}" for n in result.notes), ""] if result.notes else [])


def plots(result: BenchResult, folder: Path) -> list[Plot]:
    """The speed-up over the target alone by concurrency, each k on the held-out prompts beside the same k on the
    ceiling prompts (an always-right draft); the acceptance by draft position at the largest k."""
    return [_speedup_plot(result, folder / "speedup-by-concurrency.png"),
            _acceptance_plot(result, folder / "speedup-acceptance-by-position.png")]


def _speedup_plot(result: BenchResult, path: Path) -> Plot:
    ks = sorted({p.num_speculative_tokens for p in result.throughput})
    workloads = {"held-out": "held-out prompts", "ceiling": "ceiling: prompts the draft predicts (always right)"}

    def paint(figure: Figure) -> None:
        axes = figure.subplots(1, 2, sharey=True)
        for ax, (workload, title) in zip(axes, workloads.items()):
            for k in ks:
                points = sorted((p for p in result.throughput
                                 if p.workload == workload and p.num_speculative_tokens == k),
                                key=lambda p: p.concurrency)
                if points:
                    spread_line(ax, [p.concurrency for p in points], [p.paired_speedup for p in points], f"k={k}",
                                color=_k_colour(k, ks))
            reference(ax, 1.0, TARGET_ALONE)
            log2_axis(ax, result.plan.concurrency, "requests in flight")
            ax.set_title(title, fontsize="small")
            ax.grid(axis="y", alpha=0.3)
        axes[0].set_ylabel("speed-up over the target alone (x)")
        axes[1].legend(fontsize="small")

    return draw(path, f"Speed-up by concurrency, held-out prompts beside the ceiling ({result.started_utc[:10]}, "
                      f"median and range of {result.plan.repeats} rounds)", paint, size=(9.0, 4.0))


def _acceptance_plot(result: BenchResult, path: Path) -> Plot:
    k = max(p.num_speculative_tokens for p in result.throughput)
    points = sorted((p for p in result.throughput if p.num_speculative_tokens == k and p.acceptance is not None),
                    key=lambda p: (p.workload != "held-out", p.concurrency))

    def paint(figure: Figure) -> None:
        ax = figure.subplots()
        for p in points:
            positions = range(1, len(p.acceptance.per_position) + 1)
            ax.plot(positions, p.acceptance.per_position, marker="o",
                    linestyle="-" if p.workload == "held-out" else "--",
                    label=f"{p.workload}, {p.concurrency} in flight")
        ax.set_xticks(range(1, k + 1))
        ax.set_xlabel("draft position")
        ax.set_ylabel("accepted (share of verify steps)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")

    return draw(path, f"Acceptance by draft position, k={k} ({result.started_utc[:10]})", paint)


def _k_colour(k: int, ks: list[int]) -> tuple[float, float, float, float]:
    """k from light to dark: the larger the k, the darker its line."""
    return colormaps["viridis"](0.85 - 0.75 * ks.index(k) / max(1, len(ks) - 1))
