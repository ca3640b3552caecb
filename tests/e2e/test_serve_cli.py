"""`kimi-eagle serve` as a user runs it, through to a running server and its stop, and the API key enforced on
every route that does work, checked on that server."""


from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests

from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import API_KEY_ENV
from tests.helpers.cli import CLI
from tests.helpers.terminal import ctrl_c_as_in_a_terminal

# The module's tests share one `kimi-eagle serve` (the fixture `served`): one worker, in the file's order.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("serve-cli")]
MODEL = "tiny-kimi-k25"


def assert_worker_inside_an_unbound_engine_core(processes: list[psutil.Process]) -> None:
    """The default profile runs vLLM's uniprocess executor: no worker process, and the engine core, which runs the
    model itself, is not pinned by the plugin (`adapter/cpu_layout.py` pins only an engine core that waits on
    worker processes; pinned here, the engine served 2 tokens/s)."""
    names = [p.name() for p in processes]
    assert "VLLM::Worker" not in names, names
    core = next(p for p in processes if p.name() == "VLLM::EngineCore")
    allowed = set(os.sched_getaffinity(0))
    for thread in core.threads():
        assert set(psutil.Process(thread.id).cpu_affinity()) == allowed


@dataclass
class Started:
    process: subprocess.Popen
    url: str
    ready_line: str
    waited_s: float  # from the command to its "Ready in" line, as the user waited
    output: Path  # what the user's terminal shows: the CLI's and vLLM's stdout and stderr

    def stop(self) -> None:
        """Kill what is left of it (a failed test must not leave an engine behind)."""
        if self.process.poll() is None:
            for child in psutil.Process(self.process.pid).children(recursive=True):
                child.kill()
            self.process.kill()


def start_serve(output: Path, env: dict[str, str]) -> Started:
    """`kimi-eagle serve` with `env` added, as a user starts it in a terminal, until it prints "Ready in"."""
    port = free_port()
    t0 = time.monotonic()
    with output.open("w") as out:  # a file, not a pipe: nothing reads the output while the tests send requests
        process = subprocess.Popen([*CLI, "serve", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                   text=True, env={**os.environ, **env}, preexec_fn=ctrl_c_as_in_a_terminal)
    ready_line = ""
    while not ready_line and process.poll() is None and time.monotonic() - t0 < 600:
        ready_line = next((line for line in output.read_text().splitlines() if line.startswith("Ready in")), "")
        time.sleep(0.2)
    started = Started(process, f"http://127.0.0.1:{port}", ready_line, time.monotonic() - t0, output)
    if not ready_line:
        started.stop()
        pytest.fail(f"`kimi-eagle serve` printed no Ready line: {output.read_text()[-3000:]}")
    return started


@dataclass
class Served:
    """The module's `kimi-eagle serve`, with `VLLM_API_KEY` exported: the default profile on loopback."""
    started: Started
    key: str

    def alive(self) -> Started:
        if self.started.process.poll() is not None:
            pytest.fail(f"`kimi-eagle serve` exited {self.started.process.returncode} before this test (the Ctrl-C "
                        f"test stops it and runs last): {self.started.output.read_text()[-2000:]}")
        return self.started


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for the module's tests: it also carries the API key, so that the key's checks need no server of
    their own; the Ctrl-C test, last, stops it."""
    key = secrets.token_urlsafe(32)
    started = start_serve(tmp_path_factory.mktemp("serve-cli") / "terminal.log", {API_KEY_ENV: key})
    try:
        yield Served(started, key)
    finally:
        started.stop()


def test_serve_prints_url_when_ready(served: Served) -> None:
    server = served.alive()
    assert f"{server.url}/v1" in server.ready_line and MODEL in server.ready_line, server.ready_line
    # What the user waited, the pre-flight checks included (less the interpreter's start), not vLLM's part only.
    printed = float(server.ready_line.split()[2].rstrip("s:"))
    assert server.waited_s - 6 <= printed <= server.waited_s + 1, \
        f"'{server.ready_line.strip()}' printed {server.waited_s:.0f} s after the command"
    assert_worker_inside_an_unbound_engine_core(psutil.Process(server.process.pid).children(recursive=True))


# --- the API key, on the running server -----------------------------------------------------------------------------
COMPLETION = {"prompt": "def main(", "max_tokens": 4, "temperature": 0}

# Routes vLLM 0.32 serves by default outside its guarded prefixes (/v1, /v2, /inference, /cohere) that do work: a
# completion through the SageMaker route, tokenizer calls, scoring, elastic scaling.
UNGUARDED_BY_VLLM = [("POST", "/invocations", COMPLETION), ("POST", "/tokenize", {"prompt": "def main("}),
                     ("POST", "/detokenize", {"tokens": [1, 2, 3]}), ("POST", "/generative_scoring", {}),
                     ("POST", "/scale_elastic_ep", {})]


def test_requests_without_the_key_get_401_and_with_it_succeed(served: Served) -> None:
    server = served.alive()
    body = {"model": MODEL, **COMPLETION}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": served.key}):
        models = requests.get(f"{server.url}/v1/models", headers=headers, timeout=30)
        assert models.status_code == 401, f"/v1/models with headers {list(headers)}: {models.status_code}, not 401"
        completion = requests.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert completion.status_code == 401, \
            f"/v1/completions with headers {list(headers)}: {completion.status_code}, not 401"
    ok = requests.post(f"{server.url}/v1/completions", json=body,
                       headers={"Authorization": f"Bearer {served.key}"}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4, ok.text[:300]


@pytest.mark.parametrize(("method", "path", "body"), UNGUARDED_BY_VLLM, ids=[p for _, p, _ in UNGUARDED_BY_VLLM])
def test_routes_outside_v1_need_the_key_too(served: Served, method: str, path: str, body: dict) -> None:
    server = served.alive()
    body = {"model": MODEL, **body} if "prompt" in body else body
    without = requests.request(method, f"{server.url}{path}", json=body, timeout=60)
    assert without.status_code == 401, f"{path} answered {without.status_code} without a key: {without.text[:200]}"
    with_key = requests.request(method, f"{server.url}{path}", json=body,
                                headers={"Authorization": f"Bearer {served.key}"}, timeout=120)
    assert with_key.status_code != 401, with_key.text[:300]  # reaches the route (which may refuse an empty body)
    if path == "/invocations":
        assert with_key.status_code == 200 and with_key.json()["usage"]["completion_tokens"] == 4


def test_probes_stay_open_and_the_output_never_holds_the_key(served: Served) -> None:
    server = served.alive()
    assert requests.get(f"{server.url}/health", timeout=10).status_code == 200
    assert "vllm:num_requests_running" in requests.get(f"{server.url}/metrics", timeout=10).text
    assert served.key not in server.output.read_text(), "the API key shows in what `kimi-eagle serve` printed"


def test_ctrl_c_stops_every_process(served: Served) -> None:
    """Last of the module's tests on the server: it stops it."""
    server = served.alive()
    children = psutil.Process(server.process.pid).children(recursive=True)
    assert children, "the vLLM server should be running under the CLI"
    server.process.send_signal(signal.SIGINT)
    assert server.process.wait(timeout=60) == 0, f"Ctrl-C: `kimi-eagle serve` exited {server.process.returncode}"
    deadline = time.monotonic() + 30
    while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
        assert time.monotonic() < deadline, "vLLM processes left running after Ctrl-C"
        time.sleep(0.5)
    assert served.key not in server.output.read_text(), "the API key shows in what `kimi-eagle serve` printed"


def test_an_engine_fault_while_serving_is_reported_by_its_root_cause(tmp_path) -> None:
    """vLLM's upstream CPU top-k crash, let through by the fault knob: the API server answers 500 "EngineCore
    encountered an issue" and exits; `kimi-eagle serve` says what the engine's log says went wrong, and fails."""
    server = start_serve(tmp_path / "terminal.log", {"KIMI_EAGLE_FAULT": "upstream-top-k"})
    try:
        answer = requests.post(f"{server.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": "The history of the river", "max_tokens": 32, "temperature": 0.8,
            "top_k": 50})
        assert answer.status_code == 500, f"the fault knob should crash the engine; got {answer.status_code}"
        assert server.process.wait(timeout=120) != 0, "an engine that died while serving should fail `kimi-eagle serve`"
        report = next((line for line in server.output.read_text().splitlines()
                       if line.startswith("vLLM exited with code")), "")
        assert "while serving; root cause: RuntimeError: max(): Expected reduction dim" in report, report
        assert "(in vLLM's EngineCore process)" in report, report
    finally:
        server.stop()
