"""A/B: the same Locust workload against two servers in turn (A B A B ...), then one side-by-side report.

A verdict is given only where the difference between the sides exceeds the round-to-round spread of both, so
drift of the machine (or of one server) is not mistaken for a difference between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, Field

from kimi_eagle.acceptance import Acceptance
from kimi_eagle.loadtest.engines import ServerConfig
from kimi_eagle.loadtest.files import write_atomic, write_model
from kimi_eagle.loadtest.records import RequestRecord
from kimi_eagle.loadtest.report import plot_acceptance, plot_latency_cdfs, save_figure
from kimi_eagle.loadtest.results import load_records
from kimi_eagle.loadtest.summary import RunSummary

SIDES = ("A", "B")


class SideRounds(BaseModel):
    url: str
    engine: str
    rounds: list[RunSummary]
    folders: list[str]


class FairnessCheck(BaseModel):
    setting: str
    a: str | int | None
    b: str | int | None
    verdict: str = Field(description="same / differs / not exposed")


class AbSummary(BaseModel):
    schema_id: str = Field("kimi-eagle/ab-summary/1", alias="schema")
    a: SideRounds
    b: SideRounds
    fairness: list[FairnessCheck]
    model_config = {"populate_by_name": True}


@dataclass(frozen=True)
class Figure:
    name: str
    pick: Callable[[RunSummary], float | None]
    # None: the figure describes the traffic and is neither better nor worse (tokens per chunk is 1 without
    # speculation): the verdict then says only higher or lower.
    higher_is_better: bool | None
    digits: int = 1


def _d(attr: str, stat: str) -> Callable[[RunSummary], float | None]:
    def pick(s: RunSummary) -> float | None:
        d = getattr(s, attr)
        return None if d is None else getattr(d, stat)
    return pick


def _acc(attr: str) -> Callable[[RunSummary], float | None]:
    return lambda s: None if s.acceptance is None else getattr(s.acceptance, attr)


def _pos(i: int) -> Callable[[RunSummary], float | None]:
    def pick(s: RunSummary) -> float | None:
        rates = s.acceptance.per_position_acceptance_rate if s.acceptance else None
        return rates[i] if rates and i < len(rates) else None
    return pick


FIGURES = [
    Figure("output tokens/s", lambda s: s.throughput.output_tokens_per_s, True),
    Figure("requests/s", lambda s: s.throughput.requests_per_s, True, 3),
    Figure("goodput requests/s", lambda s: s.goodput.goodput_requests_per_s, True, 3),
    *[Figure(f"TTFT {p} (ms)", _d("ttft_ms", p), False) for p in ("p50", "p90", "p99")],
    *[Figure(f"TPOT {p} (ms)", _d("tpot_ms", p), False, 2) for p in ("p50", "p90", "p99")],
    *[Figure(f"ITL per token {p} (ms)", _d("itl_per_token_ms", p), False, 2) for p in ("p50", "p90", "p99")],
    *[Figure(f"inter-chunk latency {p} (ms)", _d("inter_chunk_latency_ms", p), False, 2) for p in ("p50", "p99")],
    *[Figure(f"end-to-end latency {p} (ms)", _d("e2e_latency_ms", p), False) for p in ("p50", "p99")],
    Figure("tokens per chunk (mean)", _d("tokens_per_chunk", "mean"), None, 2),
    Figure("acceptance rate", _acc("acceptance_rate"), True, 3),
    Figure("mean acceptance length", _acc("mean_acceptance_length"), True, 3),
]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _spread(values: list[float]) -> float | None:
    return max(values) - min(values) if len(values) >= 2 else None


def compare(figure: Figure, a: list[RunSummary], b: list[RunSummary]) -> dict[str, str]:
    va = [v for s in a if (v := figure.pick(s)) is not None]
    vb = [v for s in b if (v := figure.pick(s)) is not None]
    ma, mb = _mean(va), _mean(vb)
    sa, sb = _spread(va), _spread(vb)
    fmt = f"{{:.{figure.digits}f}}"

    def cell(m: float | None, sp: float | None) -> str:
        if m is None:
            return "n/a"
        return fmt.format(m) + (f" ± {fmt.format(sp / 2)}" if sp is not None else "")

    ratio = f"{mb / ma:.3f}" if ma and mb is not None else "n/a"
    if ma is None and mb is None:
        verdict = "not measured on either side"
    elif ma is None or mb is None:
        verdict = "not comparable (missing on one side)"
    elif sa is None or sb is None:
        verdict = "no verdict (needs 2+ rounds per side)"
    elif abs(mb - ma) <= max(sa, sb):
        verdict = "within round-to-round spread"
    elif figure.higher_is_better is None:
        verdict = f"B {'higher' if mb > ma else 'lower'}"
    else:
        better = (mb > ma) == figure.higher_is_better
        verdict = f"B {'better' if better else 'worse'}"
    return {"a": cell(ma, sa), "b": cell(mb, sb), "ratio": ratio, "verdict": verdict}


def _as_text(value: object) -> str | int | None:
    return value if value is None or isinstance(value, int | str) else str(value)


def fairness_checks(a: ServerConfig | None, b: ServerConfig | None, a_runs: list[RunSummary],
                    b_runs: list[RunSummary]) -> list[FairnessCheck]:
    checks: list[FairnessCheck] = []
    for setting in ("model", "num_speculative_tokens", "max_num_seqs", "dtype", "tensor_parallel_size",
                    "pipeline_parallel_size", "data_parallel_size", "max_model_len"):
        va = _as_text(getattr(a, setting)) if a else None
        vb = _as_text(getattr(b, setting)) if b else None
        if va is None or vb is None:
            side = " and ".join(x for x, v in (("A", va), ("B", vb)) if v is None)
            verdict = f"not exposed by {side}"
        else:
            verdict = "same" if va == vb else "DIFFERS"
        checks.append(FairnessCheck(setting=setting, a=va, b=vb, verdict=verdict))
    wa, wb = a_runs[0].workload, b_runs[0].workload
    if wa is None or wb is None:
        recorded = " and ".join(side for side, w in (("A", wa), ("B", wb)) if w is None)
        checks.append(FairnessCheck(setting="workload (prompts, seed, max_tokens, ...)",
                                    a="as run" if wa else "recorded", b="as run" if wb else "recorded",
                                    verdict=f"not known for {recorded} (recorded elsewhere): compare the output "
                                            "tokens per request and the concurrency"))
    else:
        same = {k: v for k, v in wa.model_dump().items() if k not in ("url", "engine", "model")} == \
               {k: v for k, v in wb.model_dump().items() if k not in ("url", "engine", "model")}
        checks.append(FairnessCheck(setting="workload (prompts, seed, max_tokens, ...)", a="as run", b="as run",
                                    verdict="same" if same else "DIFFERS"))
    ua, ub = _concurrency(a_runs[0]), _concurrency(b_runs[0])
    checks.append(FairnessCheck(setting="client concurrency (users; max_concurrency of a recorded run)", a=ua, b=ub,
                                verdict="same" if ua == ub else "DIFFERS" if None not in (ua, ub) else
                                "not known for " + " and ".join(s for s, v in (("A", ua), ("B", ub)) if v is None)))
    ta, tb = _output_tokens_per_request(a_runs), _output_tokens_per_request(b_runs)
    checks.append(FairnessCheck(setting="output tokens per request (mean)", a=ta, b=tb,
                                verdict="same" if ta == tb else "DIFFERS" if None not in (ta, tb) else "not known"))
    return checks


def _concurrency(run: RunSummary) -> int | None:
    if run.locust is not None:
        return run.locust.users
    return (run.recorded or {}).get("max_concurrency")


def _output_tokens_per_request(runs: list[RunSummary]) -> str | None:
    tokens = [r.tokens.completion_tokens_total for r in runs]
    ok = sum(r.requests.ok for r in runs)
    return None if None in tokens or not ok else f"{sum(tokens) / ok:.1f}"


def _acceptance_cell(acc: Acceptance | None) -> str:
    if acc is None:
        return "not measured"
    if acc.speculation == "off":
        return "no speculation"
    return acc.source


def _workload_line(a: list[RunSummary], b: list[RunSummary]) -> str:
    run = next((r for r in (a[0], b[0]) if r.workload is not None), None)
    recorded = [f"{side} was recorded elsewhere (`{runs[0].recorded_from}`, {len(runs)} run(s))"
                for side, runs in (("A", a), ("B", b)) if runs[0].workload is None]
    if run is None or run.workload is None or run.locust is None:
        return f"- both sides recorded elsewhere: {'; '.join(recorded)}"
    w = run.workload
    live = (f"{len(a) if a[0].workload else len(b)} rounds per live side, run in the order A B A B ...; the same "
            f"workload" if not recorded else "the live side's workload")
    return (f"- {live}: `{w.api}` API, prompts `{w.prompts}` (seed {w.seed}), max_tokens {w.max_tokens}, "
            f"ignore_eos {w.ignore_eos}, temperature {w.temperature}, {run.locust.users} users"
            + "".join(f"; {r}" for r in recorded))


def ab_markdown(summary: AbSummary) -> str:
    a, b = summary.a.rounds, summary.b.rounds
    lines = ["# A/B load test", "",
             f"- A: `{summary.a.url}` ({summary.a.engine}); B: `{summary.b.url}` ({summary.b.engine})",
             _workload_line(a, b),
             "- cells: mean over rounds ± half the round-to-round range; a verdict only where |B - A| exceeds the "
             "larger range of the two sides", "",
             "## Side by side", "", "| figure | A | B | B/A | verdict |", "| --- | --- | --- | --- | --- |"]
    for figure in FIGURES:
        c = compare(figure, a, b)
        lines.append(f"| {figure.name} | {c['a']} | {c['b']} | {c['ratio']} | {c['verdict']} |")
    positions = max((len(s.acceptance.per_position_acceptance_rate or []) for s in a + b if s.acceptance),
                    default=0)
    for i in range(positions):
        c = compare(Figure(f"acceptance at position {i}", _pos(i), True, 3), a, b)
        lines.append(f"| acceptance at draft position {i} | {c['a']} | {c['b']} | {c['ratio']} | {c['verdict']} |")
    lines += ["", "## Acceptance: how each figure was derived", "",
              "One definition for both sides: mean acceptance length = 1 + accepted draft tokens / verify steps "
              "(tokens per verify step of one request, bonus included); acceptance rate = accepted / proposed "
              "draft tokens; per-position rate = verify steps whose i-th draft token was accepted / verify steps. "
              "Figures an engine reports under another definition (SGLang's gauges cover only the last log "
              "window; its per-request spec_accept_length counts the prefill token) are listed apart and never "
              "put in the table.", "",
              f"- A: {_acceptance_cell(a[-1].acceptance)}", f"- B: {_acceptance_cell(b[-1].acceptance)}"]
    for side, runs in (("A", a), ("B", b)):
        acc = runs[-1].acceptance
        for k, v in (acc.engine_reported.items() if acc else []):
            lines.append(f"- {side}, engine's own figure (other definition, not compared): {k} = "
                         f"{'n/a' if v is None else f'{v:.3f}'}")
    lines += ["", "## Fairness checks", "", "| setting | A | B | check |", "| --- | --- | --- | --- |"]
    lines += [f"| {c.setting} | {c.a if c.a is not None else 'n/a'} | {c.b if c.b is not None else 'n/a'} | "
              f"{c.verdict} |" for c in summary.fairness]
    lines += ["", "## Rounds", "", "| round | side | output tok/s | TTFT p50 (ms) | acceptance length | folder |",
              "| --- | --- | --- | --- | --- | --- |"]
    for i in range(max(len(a), len(b))):
        for side, rounds in (("A", summary.a), ("B", summary.b)):
            if i >= len(rounds.rounds):
                continue
            s = rounds.rounds[i]
            acc = s.acceptance.mean_acceptance_length if s.acceptance else None
            lines.append(f"| {i + 1} | {side} | {_f(s.throughput.output_tokens_per_s)} | "
                         f"{_f(s.ttft_ms.p50 if s.ttft_ms else None)} | "
                         f"{'no speculation' if s.acceptance and s.acceptance.speculation == 'off' else _f(acc, 3)} | "
                         f"`{rounds.folders[i]}` |")
    lines += ["", "## Plots", "", "![latency CDFs](latency_cdf.png)", "", "![throughput per round](rounds.png)", "",
              "![acceptance per position](acceptance_per_position.png)", "",
              "Raw data: each round's folder holds requests.jsonl, Locust's CSVs, engine snapshots and its own "
              "summary.json; `ab_summary.json` holds all of them."]
    return "\n".join(lines) + "\n"


def _f(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def plot_rounds(summary: AbSummary, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for side in (summary.a, summary.b):
        label = "A" if side is summary.a else "B"
        ax.plot(range(1, len(side.rounds) + 1), [s.throughput.output_tokens_per_s or float("nan")
                                                 for s in side.rounds], "o-", label=f"{label} ({side.engine})")
    ax.set_xlabel("round")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput per round (drift shows here)")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def write_ab(out_dir: Path, summary: AbSummary) -> Path:
    write_model(out_dir / "ab_summary.json", summary)
    pooled: dict[str, list[RequestRecord]] = {}
    for side, label in ((summary.a, "A"), (summary.b, "B")):
        if side.rounds[0].recorded_from is None:  # a recorded side has no per-request records here
            pooled[f"{label} ({side.engine})"] = [r for folder in side.folders
                                                   for r in load_records(out_dir / folder / "requests.jsonl")]
    plot_latency_cdfs(pooled, out_dir / "latency_cdf.png")
    plot_rounds(summary, out_dir / "rounds.png")
    plot_acceptance({f"{k} ({side.engine})": (side.rounds[-1].acceptance.per_position_acceptance_rate
                                              if side.rounds[-1].acceptance else None)
                     for k, side in (("A", summary.a), ("B", summary.b))}, out_dir / "acceptance_per_position.png")
    return write_atomic(out_dir / "report.md", ab_markdown(summary))
