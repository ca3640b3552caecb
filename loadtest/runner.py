"""Run Locust on our locustfile as child processes (one local process, or a master and N workers) and read the
results folder it leaves. Locust runs in its own processes: gevent's monkey-patching stays out of ours.

Ctrl-C or SIGTERM (see `sigterm_as_keyboard_interrupt`) stops Locust the way Locust itself expects, with SIGTERM:
the master first, which writes the results gathered so far (marked interrupted), then the workers.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kimi_eagle.loadtest.results import load_summary
from kimi_eagle.loadtest.summary import RunSummary
from kimi_eagle.loadtest.workload import Workload, workload_argv
from kimi_eagle.processes import free_port, interrupts_deferred

LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


# After SIGTERM Locust writes the results at once, then lets requests in flight finish (up to --stop-timeout): do
# not wait that long for a run the user wants stopped.
STOP_GRACE_S = 20.0


class LoadTestError(RuntimeError):
    """Locust did not produce a results folder; the message says why."""


class LoadTestInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a run: Locust was stopped; `summary` holds what it had gathered (None if nothing
    was written)."""

    def __init__(self, out_dir: Path, summary: RunSummary | None) -> None:
        super().__init__(f"interrupted: {out_dir}")
        self.out_dir = out_dir
        self.summary = summary


@dataclass
class LocustRun:
    workload: Workload
    out_dir: Path
    users: int = 1
    spawn_rate: float = 10.0
    run_time: str = "30s"
    workers: int = 0
    max_requests: int | None = None
    stop_timeout_s: float = 120.0
    label: str | None = None
    extra_args: list[str] = field(default_factory=list)

    @property
    def csv_dir(self) -> Path:
        """Locust rewrites its CSVs in place while it runs: they go here and are renamed into out_dir at the end."""
        return self.out_dir / ".locust-csv"

    def workload_args(self) -> list[str]:
        w = self.workload
        args = ["-f", str(LOCUSTFILE), "--host", w.url, "--engine", w.engine, *workload_argv(w)]
        if w.request_rate_per_s:
            args += ["--request-rate", str(w.request_rate_per_s), "--open-loop-users", str(self.users)]
        if self.max_requests:
            args += ["--max-requests", str(math.ceil(self.max_requests / max(1, self.workers)))]
        return args

    def main_argv(self, master_port: int | None) -> list[str]:
        argv = [sys.executable, "-m", "locust", *self.workload_args(), "--headless", "--users", str(self.users),
                "--spawn-rate", str(self.spawn_rate), "--run-time", self.run_time, "--only-summary",
                "--stop-timeout", f"{self.stop_timeout_s:.0f}s", "--csv", str(self.csv_dir / "locust"),
                "--results-dir", str(self.out_dir)]
        argv += ["--label", self.label] if self.label else []
        if master_port is not None:
            argv += ["--master", "--expect-workers", str(self.workers), "--master-bind-host", "127.0.0.1",
                     "--master-bind-port", str(master_port)]
        return argv + self.extra_args

    def worker_argv(self, master_port: int) -> list[str]:
        return [sys.executable, "-m", "locust", *self.workload_args(), "--worker", "--master-host", "127.0.0.1",
                "--master-port", str(master_port)]


def _stop(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM (Locust's own clean shutdown), then SIGKILL after `grace_s`."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _collect_csvs(run: LocustRun) -> None:
    for csv in sorted(run.csv_dir.glob("*.csv")):
        os.replace(csv, run.out_dir / csv.name)
    if run.csv_dir.is_dir():
        run.csv_dir.rmdir()


def run_locust(run: LocustRun, timeout_s: float | None = None) -> tuple[int, RunSummary]:
    """Run Locust to the end; returns its exit code and the summary it wrote. Raises LoadTestInterrupted on
    Ctrl-C (and on SIGTERM inside `sigterm_as_keyboard_interrupt`), after Locust has written what it had."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    summary_path = run.out_dir / "summary.json"
    summary_path.unlink(missing_ok=True)  # a summary left by an earlier run in this folder must not pass for ours
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    port = free_port() if run.workers else None
    processes: list[subprocess.Popen] = []
    try:
        with interrupts_deferred():  # every process started is in `processes` before an interrupt can stop them
            processes.append(subprocess.Popen(run.main_argv(port), env=env, start_new_session=True))
            for _ in range(run.workers):
                processes.append(subprocess.Popen(run.worker_argv(port), env=env, stdout=subprocess.DEVNULL,
                                                  start_new_session=True))
        code = processes[0].wait(timeout=timeout_s)
        for worker in processes[1:]:
            worker.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise LoadTestError(f"Locust did not finish within {timeout_s:.0f}s") from None
    except KeyboardInterrupt:
        for process in processes:  # the master first: it writes the results, then tells the workers to quit
            _stop(process, STOP_GRACE_S)
        _collect_csvs(run)
        raise LoadTestInterrupted(run.out_dir, load_summary(summary_path) if summary_path.is_file() else None) \
            from None
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    _collect_csvs(run)
    if not summary_path.is_file():
        raise LoadTestError(f"Locust exited with code {code} and wrote no {summary_path} (see its output above)")
    return code, load_summary(summary_path)
