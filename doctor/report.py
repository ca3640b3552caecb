"""Render a diagnosis for people (rich tables) and for machines (JSON)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kimi_eagle.checks import Diagnosis, Finding, Severity
from kimi_eagle.checks.engines import ENGINE_LABELS
from kimi_eagle.cpu_kernels import KernelReport

SEVERITY_STYLE = {Severity.INFO: "cyan", Severity.WARNING: "yellow", Severity.REFUSAL: "bold red"}
STATUS_STYLE = {"loaded": "green", "consumed": "green", "ignored": "dim", "shared": "cyan",
                "dropped": "bold red", "load-error": "bold red", "missing": "bold red"}


def exit_code(findings: list[Finding], engine: str = "all") -> int:
    """0: all good; 1: warnings; 2: refusals (for the engines asked about)."""
    relevant = [f.severity for f in findings if f.applies_to(engine)]
    worst = max(relevant, default=Severity.INFO)
    return {Severity.INFO: 0, Severity.WARNING: 1, Severity.REFUSAL: 2}[worst]


def findings_table(findings: list[Finding], engine: str = "all", min_severity: Severity = Severity.INFO) -> Table:
    table = Table(title="Findings", show_lines=True, expand=True)
    table.add_column("severity", no_wrap=True)
    table.add_column("engine", no_wrap=True)
    table.add_column("code", no_wrap=True)
    for column, ratio in (("what", 3), ("found", 4), ("expected", 4), ("fix", 4)):
        table.add_column(column, ratio=ratio, overflow="fold")
    for f in findings:
        if f.applies_to(engine) and f.severity >= min_severity:
            style = SEVERITY_STYLE[f.severity]
            table.add_row(f"[{style}]{f.severity.name}[/]", f.engine, f.code,
                          *(escape(text) for text in (f.title, f.found, f.expected, f.fix)))
    return table


def coverage_table(diagnosis: Diagnosis, engine: str = "all") -> Table:
    engines = [e for e in ENGINE_LABELS if engine in ("all", e)]
    table = Table(title="Key coverage: checkpoint tensor -> engine parameter", expand=True)
    table.add_column("checkpoint key", overflow="fold")
    table.add_column("shape")
    for e in engines:
        table.add_column(ENGINE_LABELS[e], overflow="fold")
    for row in diagnosis.coverage:
        cells = []
        for e in engines:
            fate = row.engines.get(e)
            if fate is None:
                cells.append("")
                continue
            style = STATUS_STYLE.get(fate.status, "")
            target = f" -> {fate.param}" if fate.param else ""
            note = f" ({fate.note})" if fate.note and fate.status != "loaded" else ""
            cells.append(f"[{style}]{fate.status}[/]{escape(target + note)}")
        if row.key is None and not any(cells):
            continue
        key = escape(row.key) if row.key is not None else "[italic](absent)[/]"
        table.add_row(key, "x".join(map(str, row.shape)) if row.shape else "", *cells)
    return table


def health_table(diagnosis: Diagnosis) -> Table:
    table = Table(title="Weight health", expand=True)
    for column in ("tensor", "dtype", "shape", "status", "min", "max", "mean |x|"):
        table.add_column(column, overflow="fold")
    for row in diagnosis.health:
        style = "green" if row.status.startswith("ok") else "bold red" if "NaN" in row.status or "zero" in row.status \
            else "yellow"
        numbers = [f"{v:.4g}" if v is not None else "" for v in (row.min, row.max, row.mean_abs)]
        table.add_row(row.name, row.dtype, "x".join(map(str, row.shape)), f"[{style}]{row.status}[/]", *numbers)
    return table


def trained_table(diagnosis: Diagnosis) -> Table:
    verdict = diagnosis.trained
    style = {"trained": "green", "looks untrained": "bold red"}.get(verdict.verdict, "yellow")
    table = Table(title=f"Trained or not? [{style}]{verdict.verdict}[/]: {escape(verdict.reason)}", expand=True)
    for column in ("matrix", "shape", "std", "init std", "top singular", "bulk edge", "spike", "row spread", "looks"):
        table.add_column(column, overflow="fold")
    for e in verdict.matrices:
        table.add_row(e.name, f"{e.shape[0]}x{e.shape[1]}", f"{e.std:.4g}", f"{e.init_std:.4g}",
                      f"{e.top_singular:.4g}", f"{e.bulk_edge:.4g}", f"{e.spike_ratio:.2f}",
                      f"{e.row_spread_ratio:.2f}", e.looks)
    return table


def runner_table() -> Table:
    """Which of vLLM's model runners serves an EAGLE-3 draft here, and guard by guard what acts on each."""
    from kimi_eagle.adapter.runners import runner_here
    from kimi_eagle.adapter.surface import FEATURES

    runner, why = runner_here()
    table = Table(title=f"vLLM's Model Runner {runner} serves EAGLE-3 here ({why}): the guards on each runner",
                  title_justify="left")
    for column in ("guard or fix", "Model Runner V1", "Model Runner V2"):
        table.add_column(column)
    for feature in FEATURES:
        table.add_row(escape(feature.name), *(escape(feature.on(r)) for r in ("V1", "V2")))
    return table


def print_report(diagnosis: Diagnosis, console: Console, engine: str = "all", machine: KernelReport | None = None
                 ) -> None:
    console.print(f"[bold]kimi-eagle doctor[/]  draft: {diagnosis.draft}  target: {diagnosis.target or '(none)'}")
    if machine:
        console.print(escape(f"machine  {machine.line()}"))
    if diagnosis.layout:
        console.print(escape(f"layout  {diagnosis.layout}"))
    ids = diagnosis.aux_ids
    if ids:
        console.print(escape("aux layer ids  " + "  ".join(f"{k}: {v}" for k, v in ids.items())))
    for name, verdict in diagnosis.engines.items():
        if engine in ("all", name):
            style = "green" if verdict.verdict == "loads as is" else "bold red" if verdict.verdict.startswith(
                "refuses") else "yellow"
            console.print(f"{ENGINE_LABELS[name]}  [{style}]{escape(verdict.verdict)}[/]")
    console.print(findings_table(diagnosis.findings, engine))
    if engine in ("all", "vllm"):
        console.print(runner_table())
    if diagnosis.coverage:
        console.print(coverage_table(diagnosis, engine))
    if diagnosis.health:
        console.print(health_table(diagnosis))
        console.print(trained_table(diagnosis))
