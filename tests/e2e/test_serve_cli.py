"""`kimi-eagle serve` as a user runs it, through to a running server and its stop."""


from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil
import pytest
import requests

from kimi_eagle.processes import free_port
from tests.helpers.cli import CLI
from tests.helpers.terminal import ctrl_c_as_in_a_terminal


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


@pytest.mark.e2e
def test_serve_prints_url_when_ready_and_ctrl_c_stops_every_process(tmp_path) -> None:
    port = free_port()
    # vLLM's own log shares the CLI's stdout; stderr goes to a file so that no pipe fills up and blocks anyone.
    stderr = tmp_path / "stderr.log"
    t0 = time.monotonic()
    with stderr.open("w") as err:
        process = subprocess.Popen([*CLI, "serve", "--port", str(port)], stdout=subprocess.PIPE, stderr=err, text=True,
                                   preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        ready_line = next((line for line in process.stdout if line.startswith("Ready in")), "")
        waited = time.monotonic() - t0
        assert f"http://127.0.0.1:{port}/v1" in ready_line and "tiny-kimi-k25" in ready_line, stderr.read_text()[-3000:]
        # What the user waited, the pre-flight checks included (less the interpreter's start), not vLLM's part only.
        printed = float(ready_line.split()[2].rstrip("s:"))
        assert waited - 6 <= printed <= waited + 1, f"'{ready_line.strip()}' printed {waited:.0f} s after the command"
        children = psutil.Process(process.pid).children(recursive=True)
        assert children, "the vLLM server should be running under the CLI"
        assert_worker_inside_an_unbound_engine_core(children)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        deadline = time.monotonic() + 30
        while any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children):
            assert time.monotonic() < deadline, "vLLM processes left running after Ctrl-C"
            time.sleep(0.5)
    finally:
        if process.poll() is None:
            process.kill()



@pytest.mark.e2e
def test_an_engine_fault_while_serving_is_reported_by_its_root_cause(tmp_path) -> None:
    """vLLM's upstream CPU top-k crash, let through by the fault knob: the API server answers 500 "EngineCore
    encountered an issue" and exits; `kimi-eagle serve` says what the engine's log says went wrong, and fails."""
    port = free_port()
    stderr = tmp_path / "stderr.log"
    with stderr.open("w") as err:
        process = subprocess.Popen([*CLI, "serve", "--port", str(port)], stdout=subprocess.PIPE, stderr=err, text=True,
                                   env={**os.environ, "KIMI_EAGLE_FAULT": "upstream-top-k"})
    try:
        ready_line = next((line for line in process.stdout if line.startswith("Ready in")), "")
        assert ready_line, stderr.read_text()[-3000:]
        answer = requests.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json={
            "model": "tiny-kimi-k25", "prompt": "The history of the river", "max_tokens": 32, "temperature": 0.8,
            "top_k": 50})
        assert answer.status_code == 500, f"the fault knob should crash the engine; got {answer.status_code}"
        assert process.wait(timeout=120) != 0, "an engine that died while serving should fail `kimi-eagle serve`"
        report = next((line for line in stderr.read_text().splitlines()
                       if line.startswith("vLLM exited with code")), "")
        assert "while serving; root cause: RuntimeError: max(): Expected reduction dim" in report, report
        assert "(in vLLM's EngineCore process)" in report, report
    finally:
        if process.poll() is None:
            process.kill()
