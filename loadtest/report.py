"""Markdown reports and PNG plots of a run or a sweep (matplotlib, no display needed)."""

from __future__ import annotations

import io
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from kimi_eagle.loadtest.files import write_atomic
from kimi_eagle.loadtest.records import RequestRecord
from kimi_eagle.loadtest.summary import Distribution, RunSummary


def save_figure(fig: plt.Figure, path: Path) -> Path:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return write_atomic(path, buffer.getvalue())


def _cdf(ax: plt.Axes, values: list[float], label: str) -> None:
    if not values:
        return
    xs = np.sort(np.asarray(values))
    ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=label)


def plot_latency_cdfs(series: dict[str, list[RequestRecord]], path: Path) -> Path:
    """One panel per latency (TTFT, E2E, TPOT, per-token ITL); one line per series (run or server)."""
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("TTFT (ms)", lambda r: [r.ttft_ms] if r.ttft_ms is not None else []),
              ("end-to-end latency (ms)", lambda r: [r.latency_ms] if r.latency_ms is not None else []),
              ("TPOT (ms/token)", lambda r: [r.tpot_ms] if r.tpot_ms is not None else []),
              ("ITL per token (ms)", lambda r: r.per_token_itl_ms())]
    for ax, (title, pick) in zip(axes.flat, panels, strict=True):
        for label, records in series.items():
            _cdf(ax, [v for r in records if r.ok for v in pick(r)], label)
        ax.set_title(title)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if not ax.lines:  # e.g. ITL per token from a server that sends no per-chunk token counts
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        elif len(series) > 1:
            ax.legend(fontsize=8)
    fig.suptitle("Latency CDFs")
    return save_figure(fig, path)


def plot_acceptance(per_position: dict[str, list[float] | None], path: Path) -> Path:
    """Acceptance rate per draft position, one bar group per series."""
    fig, ax = plt.subplots(figsize=(6, 4))
    shown = {k: v for k, v in per_position.items() if v}
    width = 0.8 / max(1, len(shown))
    for i, (label, rates) in enumerate(shown.items()):
        xs = np.arange(len(rates)) + i * width
        ax.bar(xs, rates, width=width, label=label)
    if not shown:
        ax.text(0.5, 0.5, "no per-position acceptance\n(no speculation, or not exposed)", ha="center",
                va="center", transform=ax.transAxes)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3, axis="y")
    if len(shown) > 1:
        ax.legend(fontsize=8)
    ax.set_title("Acceptance per draft position (run delta)")
    return save_figure(fig, path)


def plot_sweep(points: list[RunSummary], path: Path) -> Path:
    """Output throughput and TTFT p50 against concurrency (or request rate)."""
    open_loop = points[0].workload.request_rate_per_s is not None
    xs = [p.workload.request_rate_per_s if open_loop else p.locust.users for p in points]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [p.throughput.output_tokens_per_s or np.nan for p in points], "o-", label="output tokens/s")
    ax.set_xlabel("request rate (req/s)" if open_loop else "concurrent users")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [p.ttft_ms.p50 if p.ttft_ms else np.nan for p in points], "s--", color="tab:red",
             label="TTFT p50 (ms)")
    ax2.set_ylabel("TTFT p50 (ms)")
    ax.grid(alpha=0.3)
    fig.legend(loc="upper left", fontsize=8)
    ax.set_title("Throughput vs " + ("request rate" if open_loop else "concurrency"))
    return save_figure(fig, path)


def _fmt(value: float | int | None, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _dist_row(name: str, d: Distribution | None, digits: int = 1) -> str:
    if d is None:
        return f"| {name} | n/a | n/a | n/a | n/a | 0 |"
    return f"| {name} | {_fmt(d.mean, digits)} | {_fmt(d.p50, digits)} | {_fmt(d.p90, digits)} | " \
           f"{_fmt(d.p99, digits)} | {d.count} |"


def run_markdown(s: RunSummary) -> str:
    w = s.workload
    loop = (f"open loop, {w.request_rate_per_s} req/s" if w.request_rate_per_s
            else f"closed loop, {s.locust.users} users")
    lines = [f"# Load test: {s.label or w.url}", "",
             *(["**Interrupted** (Ctrl-C or SIGTERM): these figures cover only the requests answered until then.",
                ""] if s.interrupted else []),
             f"- server: `{w.url}` ({w.engine}), model `{s.model}`",
             f"- workload: `{w.api}` API, {'streaming' if w.stream else 'not streaming'}, prompts `{w.prompts}` "
             f"(seed {w.seed}), max_tokens {w.max_tokens}, ignore_eos {w.ignore_eos}, temperature {w.temperature}",
             f"- Locust: {loop}, {s.locust.mode}"
             + (f" with {s.locust.workers} workers" if s.locust.workers else "")
             + f", run time {_fmt(s.locust.run_time_s, 0)} s",
             f"- requests: {s.requests.ok} ok, {s.requests.failed} failed"
             + ("".join(f"\n  - {n} x {msg}" for msg, n in s.requests.errors.items())), "",
             "## Latency (harness samples, not Locust's rounded histogram)", "",
             "| metric | mean | p50 | p90 | p99 | samples |", "| --- | --- | --- | --- | --- | --- |",
             _dist_row("TTFT (ms)", s.ttft_ms), _dist_row("end-to-end latency (ms)", s.e2e_latency_ms),
             _dist_row("TPOT (ms/token, server token count)", s.tpot_ms, 2),
             _dist_row("inter-chunk latency (ms)", s.inter_chunk_latency_ms, 2),
             _dist_row("ITL per token (ms)", s.itl_per_token_ms, 2),
             _dist_row("tokens per chunk", s.tokens_per_chunk, 2),
             _dist_row("output tokens/s per request", s.output_tokens_per_s_per_request), "",
             "Under speculative decoding one chunk carries several tokens: inter-chunk latency is the gap between "
             "chunks, ITL per token divides each gap by the tokens of its chunk (counted from the server's "
             "cumulative usage on every chunk), TPOT is (latency - TTFT) / (tokens - 1).", "",
             "## Throughput and goodput", "",
             f"- duration {_fmt(s.throughput.duration_s, 2)} s: {_fmt(s.throughput.requests_per_s, 2)} req/s, "
             f"{_fmt(s.throughput.output_tokens_per_s)} output tokens/s, {_fmt(s.throughput.input_tokens_per_s)} "
             "input tokens/s"]
    g = s.goodput
    if g.good_requests is None:
        lines.append("- goodput: no limit set (--ttft-limit-ms / --tpot-limit-ms)")
    else:
        lines.append(f"- goodput (TTFT <= {_fmt(g.ttft_limit_ms)} ms, TPOT <= {_fmt(g.tpot_limit_ms)} ms): "
                     f"{g.good_requests} requests, {_fmt(g.goodput_requests_per_s, 2)} req/s "
                     f"({_fmt(None if g.good_fraction is None else g.good_fraction * 100)}%)")
    t = s.tokens
    lines += ["", "## Token accounting", "",
              f"- {_fmt(t.completion_tokens_total)} output and {_fmt(t.prompt_tokens_total)} prompt tokens "
              "(server usage)",
              f"- per-chunk token counts known for {t.requests_with_per_chunk_counts} requests; "
              f"{t.per_chunk_count_mismatches} of them do not add up to the server's usage",
              f"- {t.requests_short_of_max_tokens} requests got fewer than max_tokens tokens"]
    lines += ["", "## Acceptance (engine counters, this run's delta)", ""]
    lines += acceptance_lines(s)
    o = s.client_overhead
    lines += ["", "## Harness overhead", "",
              f"- mean TTFT seen by the client {_fmt(o.client_mean_ttft_ms, 2)} ms, recorded by the engine "
              f"{_fmt(o.server_mean_ttft_ms, 2)} ms ({o.client_requests} client / {_fmt(o.server_requests)} server "
              "requests): the harness and "
              f"HTTP add {_fmt(o.overhead_ms, 2)} ms "
              f"({_fmt(None if o.overhead_fraction is None else o.overhead_fraction * 100)}% of TTFT)",
              f"- highest CPU use of a Locust process: {_fmt(o.harness_cpu_percent_max)}%"
              + (" (above 90%: the harness may be the bottleneck; add workers)"
                 if (o.harness_cpu_percent_max or 0) > 90 else "")]
    if s.files:
        lines += ["", "## Files", ""] + [f"- `{name}`: {what}" for name, what in s.files.items()]
    return "\n".join(lines) + "\n"


def acceptance_lines(s: RunSummary) -> list[str]:
    a = s.acceptance
    if a is None:
        return ["- not measured"]
    if a.speculation == "off":
        return [f"- no speculation: {a.source}"]
    lines = [f"- mean acceptance length {_fmt(a.mean_acceptance_length, 3)} (1 + accepted / verify steps), "
             f"acceptance rate {_fmt(a.acceptance_rate, 3)} (accepted / proposed draft tokens), k = "
             f"{_fmt(a.num_speculative_tokens)}",
             f"- {_fmt(a.num_verify_steps)} verify steps, {_fmt(a.num_draft_tokens)} draft tokens proposed, "
             f"{_fmt(a.num_accepted_tokens)} accepted",
             f"- k in force over the run: {_k_in_force(a)} draft tokens per verify step on average",
             "- the engine's measured k at the end (per batch-size range: k in force, the profile's, and the other "
             "ks' tokens/s over it as measured): " + _measured_k(a),
             "- per position: " + (", ".join(f"{i}: {r:.3f}" for i, r in enumerate(a.per_position_acceptance_rate))
                                   if a.per_position_acceptance_rate else "not exposed"),
             f"- derived from: {a.source}"]
    lines += [f"- engine's own figure, other definition: {k} = {_fmt(v, 3)}" for k, v in a.engine_reported.items()]
    p = s.per_request_acceptance
    if p is not None:
        lines.append(f"- per request ({p.source}, {p.requests} requests): mean acceptance length p50 "
                     f"{_fmt(p.mean_acceptance_length.p50 if p.mean_acceptance_length else None, 3)}, p10-p90 "
                     "see summary.json")
    return lines


def sweep_markdown(points: list[RunSummary], folders: list[str]) -> str:
    lines = ["# Load-test sweep", "", "| point | req/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | "
             "TPOT p50 (ms) | acceptance length | folder |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p, folder in zip(points, folders, strict=True):
        point = (f"{p.workload.request_rate_per_s} req/s" if p.workload.request_rate_per_s
                 else f"{p.locust.users} users")
        acc = p.acceptance.mean_acceptance_length if p.acceptance else None
        lines.append(f"| {point} | {_fmt(p.throughput.requests_per_s, 2)} | {_fmt(p.throughput.output_tokens_per_s)}"
                     f" | {_fmt(p.ttft_ms.p50 if p.ttft_ms else None)} | {_fmt(p.ttft_ms.p99 if p.ttft_ms else None)}"
                     f" | {_fmt(p.tpot_ms.p50 if p.tpot_ms else None, 2)} | {_fmt(acc, 3)} | `{folder}` |")
    lines += ["", "![throughput vs concurrency](throughput.png)"]
    return "\n".join(lines) + "\n"


def _measured_k(a) -> str:
    if not a.measured_k:
        return "not exposed (an engine without kimi-eagle's measured k, or KIMI_EAGLE_MEASURED_K=0)"
    return "; ".join(
        f"{r.batch_sizes}: k={r.k} (profile {_fmt(r.configured)}, {_fmt(r.steps)} steps timed"
        + "".join(f", k={k} {v:.2f}x" for k, v in r.speed_ratio.items()) + ")" for r in a.measured_k)


def _k_in_force(a) -> str:
    if not a.num_verify_steps or a.num_draft_tokens is None:
        return "n/a"
    return f"{a.num_draft_tokens / a.num_verify_steps:.2f}"
