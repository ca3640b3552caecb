"""A vLLM server under measurement: its cold start (process start to first token) and the peak memory of every
process it runs (API server, engine core, worker), sampled for its whole life."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import requests
from pydantic import BaseModel, Field

from kimi_eagle import envs
from kimi_eagle.serve.command import ServeCommand
from kimi_eagle.serve.launch import ServerStartError, started, wait_healthy


class ColdStart(BaseModel):
    """One server start, measured from just before the process was created."""

    config: str = Field(description="Which served configuration (plain, spec-k3, ...).")
    draft: bool
    num_speculative_tokens: int | None
    seconds_to_healthy: float = Field(description="Process start to the first 200 from /health.")
    seconds_to_first_token: float = Field(description="Process start to the end of a 1-token completion sent as "
                                                      "soon as /health answered.")
    peak_rss_bytes: int | None = Field(None, description="Highest sum of RSS over all the server's processes, over "
                                                         "its whole life (shared pages count once per process).")
    peak_rss_bytes_by_process: dict[str, int] = Field(
        default_factory=dict, description="Highest RSS of each process still running at the last sample, as "
                                          "`name (pid)`: start-up helpers (compilers) that ended are left out.")
    other_servers_running: int = Field(0, description="Servers of this benchmark already up (idle) during the start.")


def tree_cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process and of its descendants still running."""
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


class RssSampler:
    """Samples the RSS of a process tree in a background thread; 4 Hz while starting, 1 Hz after."""

    def __init__(self, pid: int) -> None:
        self.root = psutil.Process(pid)
        self.peak_total = 0
        self._peaks: dict[int, int] = {}
        self._names: dict[int, str] = {}  # vLLM renames its processes (VLLM::Worker) after they start
        self._last_seen: set[int] = set()
        self.interval_s = 0.25
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop sampling (before the server stops, so that its last sample shows every process running)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def sample(self) -> None:
        try:
            processes = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        total, seen = 0, set()
        for p in processes:
            try:
                rss, name = p.memory_info().rss, p.name()
            except psutil.NoSuchProcess:  # a child that ended between the listing and the read
                continue
            total += rss
            seen.add(p.pid)
            self._names[p.pid] = name
            self._peaks[p.pid] = max(rss, self._peaks.get(p.pid, 0))
        self.peak_total = max(self.peak_total, total)
        self._last_seen = seen

    @property
    def peak_by_process(self) -> dict[str, int]:
        return {f"{self._names[pid]} ({pid})": self._peaks[pid] for pid in sorted(self._last_seen)}

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()


@dataclass
class LiveServer:
    url: str
    model: str
    process: subprocess.Popen
    sampler: RssSampler
    cold_start: ColdStart
    log: Path

    def cpu_seconds(self) -> float:
        """User and system CPU seconds of every process of the server (API server, engine core, worker) so far."""
        return tree_cpu_seconds(self.process.pid)

    def finish(self) -> ColdStart:
        """The cold start with the peak memory of the server's whole life (call after it stopped)."""
        self.cold_start.peak_rss_bytes = self.sampler.peak_total
        self.cold_start.peak_rss_bytes_by_process = dict(self.sampler.peak_by_process)
        return self.cold_start


def _first_token(url: str, model: str) -> None:
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    try:
        response = requests.post(f"{url}/v1/completions", json=body, timeout=300)
    except requests.RequestException as exc:
        raise ServerStartError(f"{url} was healthy but its first completion failed: {exc}") from None
    if response.status_code != 200:
        raise ServerStartError(f"{url} was healthy but its first completion answered HTTP {response.status_code}: "
                               f"{response.text[:300]}")


@contextmanager
def measured_server(command: ServeCommand, *, config: str, num_speculative_tokens: int | None, log: Path,
                    others_running: int = 0, timeout_s: float = 600) -> Iterator[LiveServer]:
    """Start the server, time its cold start, sample its memory until it stops; always stops it. A benchmark
    measures the k it names: the engine's measured k stays off unless the caller turns it on."""
    command.env.setdefault(envs.MEASURED_K.name, "0")
    t0 = time.perf_counter()
    with started(command, log) as process, RssSampler(process.pid) as sampler:
        wait_healthy(process, command.url, timeout_s, log, command.api_key)
        healthy = time.perf_counter() - t0
        _first_token(command.url, command.served_model_name)
        first = time.perf_counter() - t0
        sampler.interval_s = 1.0
        cold = ColdStart(config=config, draft=command.draft is not None,
                         num_speculative_tokens=num_speculative_tokens if command.draft else None,
                         seconds_to_healthy=healthy, seconds_to_first_token=first,
                         other_servers_running=others_running)
        server = LiveServer(url=command.url, model=command.served_model_name, process=process, sampler=sampler,
                            cold_start=cold, log=log)
        yield server
