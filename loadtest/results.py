"""One run's results folder: raw records, engine snapshots, summary.json, report.md and plots."""

from __future__ import annotations

from pathlib import Path

from kimi_eagle.loadtest import serve_bench
from kimi_eagle.loadtest.engines import EngineReader, EngineSnapshot
from kimi_eagle.loadtest.files import write_atomic, write_jsonl, write_model
from kimi_eagle.loadtest.metrics import summarise
from kimi_eagle.loadtest.records import RequestRecord
from kimi_eagle.loadtest.report import plot_acceptance, plot_latency_cdfs, run_markdown
from kimi_eagle.loadtest.summary import LocustSettings, RunSummary
from kimi_eagle.loadtest.workload import Workload

FILES = {
    "summary.json": "the figures of this run (loadtest.summary.RunSummary)",
    "report.md": "this report",
    serve_bench.FILE_NAME: "the same run in the form `vllm bench serve --save-result` writes (loadtest/serve_bench.py)",
    "requests.jsonl": "one raw record per request (timestamps, chunk token counts, server usage)",
    "engine_before.json": "the engine's counters and settings before the run",
    "engine_after.json": "the same after the run",
    "latency_cdf.png": "CDFs of TTFT, latency, TPOT and per-token ITL",
    "acceptance_per_position.png": "acceptance rate per draft position",
    "locust_*.csv": "Locust's own statistics (its histogram rounds to about two significant digits)",
}


def write_run(out_dir: Path, *, records: list[RequestRecord], workload: Workload, locust: LocustSettings,
              model: str, engine: EngineReader, before: EngineSnapshot | None, after: EngineSnapshot | None,
              cpu_max: float | None, label: str | None, interrupted: bool = False) -> RunSummary:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "requests.jsonl", records)
    acceptance = timing = config = None
    if before is not None and after is not None:
        write_model(out_dir / "engine_before.json", before)
        write_model(out_dir / "engine_after.json", after)
        acceptance = engine.acceptance(before, after, records)
        timing = engine.server_timing(before, after)
        config = engine.server_config(after)
    summary = summarise(records, workload=workload, locust=locust, model=model, acceptance=acceptance,
                        timing=timing, server_config=config, cpu_max=cpu_max, label=label,
                        interrupted=interrupted)
    plot_latency_cdfs({label or "run": records}, out_dir / "latency_cdf.png")
    plot_acceptance({label or "run": acceptance.per_position_acceptance_rate if acceptance else None},
                    out_dir / "acceptance_per_position.png")
    written_after = ("summary.json", "report.md", serve_bench.FILE_NAME)
    summary.files = {name: what for name, what in FILES.items()
                     if "*" in name or (out_dir / name).exists() or name in written_after}
    write_model(out_dir / "summary.json", summary)
    serve_bench.write(out_dir / serve_bench.FILE_NAME, [serve_bench.from_run(summary, records)])
    write_atomic(out_dir / "report.md", run_markdown(summary))
    return summary


def load_records(path: Path) -> list[RequestRecord]:
    return [RequestRecord.model_validate_json(line) for line in path.read_text().splitlines() if line.strip()]


def load_summary(path: Path) -> RunSummary:
    return RunSummary.model_validate_json(path.read_text())
