"""`doctor --probe` through vLLM itself: the offline acceptance on the session's speculative server (--probe-url)
and on a server doctor starts and stops."""


from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

import tests.helpers.broken_drafts as bd
from kimi_eagle.cli import main
from kimi_eagle.doctor.calibration import CALIBRATION_PROMPTS
from kimi_eagle.doctor.engine_probe import MAX_TOKENS
from kimi_eagle.serve.command import VLLM_SERVER
from tests.helpers.server import Server
from tests.helpers.terminal import ctrl_c_as_in_a_terminal


# --- through vLLM (real servers) -----------------------------------------------------------------------------------
def _report(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["doctor", str(bd.SOURCE_DRAFT), "--target", str(bd.SOURCE_TARGET), *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def _check_acceptance(engine: dict) -> None:
    acceptance = engine["acceptance"]
    per_position = acceptance["per_position_acceptance_rate"]
    assert acceptance["num_speculative_tokens"] == 3 and len(per_position) == 3
    assert acceptance["mean_acceptance_length"] >= 2.5
    assert per_position[0] > per_position[1] > per_position[2] > 0
    # one definition: 1 + accepted / drafts is 1 + the sum of the per-position rates
    assert acceptance["mean_acceptance_length"] == pytest.approx(1 + sum(per_position))
    assert engine["prompts"] == len(CALIBRATION_PROMPTS) and engine["max_tokens"] == MAX_TOKENS
    assert engine["completion_tokens"] > 0


@pytest.mark.e2e
def test_acceptance_through_the_running_vllm_server(spec_server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _report(capsys, "--probe-url", spec_server.url)
    engine = report["engine_probe"]
    print(f"doctor --probe-url: mean acceptance length {engine['acceptance']['mean_acceptance_length']:.2f}, "
          f"per position {engine['acceptance']['per_position_acceptance_rate']}")
    assert code == 0 and engine["skipped"] is None
    assert engine["server"] == "given (--probe-url)" and engine["url"] == spec_server.url
    assert engine["model"] == spec_server.model
    _check_acceptance(engine)
    assert report["probe"]["verdict"] == "configured ids fit best"  # both halves of --probe ran


@pytest.mark.e2e
def test_a_server_without_speculation_is_named(plain_server: Server, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\n")
    assert main(["doctor", str(bd.SOURCE_DRAFT), "--target", str(bd.SOURCE_TARGET), "--probe-url",
                 plain_server.url, "--prompts", str(prompts)]) == 2
    assert "runs without speculative decoding" in capsys.readouterr().err


@pytest.mark.e2e
def test_probe_starts_vllm_for_the_pair_and_stops_it(capsys: pytest.CaptureFixture[str]) -> None:
    already = {p.pid for p in _vllm_servers(psutil.Process())}  # the session's shared servers, if up
    servers: set[int] = set()
    done = threading.Event()

    def watch() -> None:  # the server doctor starts is our child while it runs
        while not done.wait(0.5):
            servers.update(p.pid for p in _vllm_servers(psutil.Process()) if p.pid not in already)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code, report = _report(capsys, "--probe")
    finally:
        done.set()
        watcher.join()
    engine = report["engine_probe"]
    print(f"doctor --probe (started vLLM, ready in {engine['seconds_to_ready']:.0f}s): mean acceptance length "
          f"{engine['acceptance']['mean_acceptance_length']:.2f}, per position "
          f"{engine['acceptance']['per_position_acceptance_rate']}")
    assert code == 0 and engine["server"] == "started by doctor: vLLM, profile tiny-cpu-exact"
    assert engine["url"].startswith("http://127.0.0.1:") and engine["seconds_to_ready"] > 0
    _check_acceptance(engine)
    assert len(servers) == 1, f"expected one vLLM server while doctor ran, saw {len(servers)}"
    assert not _outlived(servers.pop()), "processes of the vLLM server outlived doctor"
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{engine['url']}/health", timeout=5)


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_probe_stops_the_server_it_started(sig: signal.Signals, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def main():\n")
    doctor = subprocess.Popen([sys.executable, "-m", "kimi_eagle.cli", "doctor", str(bd.SOURCE_DRAFT), "--target",
                               str(bd.SOURCE_TARGET), "--probe", "--prompts", str(prompts)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              preexec_fn=ctrl_c_as_in_a_terminal)
    server = None
    try:
        server = _wait_for_vllm_child(doctor, timeout_s=300)
        deadline = time.monotonic() + 180
        while len(_session(server.pid)) < 2:  # interrupt while loading, once the engine core process exists
            assert time.monotonic() < deadline, "vLLM started no engine process"
            time.sleep(0.5)
        doctor.send_signal(sig)
        assert doctor.wait(timeout=60) == 130
        assert "interrupted" in doctor.stderr.read()
        assert not _outlived(server.pid), "processes of the vLLM server outlived doctor"
    finally:  # a failed test must not leave an engine behind either
        if doctor.poll() is None:
            doctor.kill()
        for p in _session(server.pid) if server else []:
            p.kill()


def _outlived(sid: int, grace_s: float = 30) -> list[psutil.Process]:
    """The processes of the server's session still alive after a grace period. The server runs in a session of its
    own (serve.launch.start); its engine core got the same signal and may take a moment longer than the API server."""
    deadline = time.monotonic() + grace_s
    while (alive := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return alive


def _session(sid: int) -> list[psutil.Process]:
    alive = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return alive


def _wait_for_vllm_child(doctor: subprocess.Popen, timeout_s: float) -> psutil.Process:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert doctor.poll() is None, f"doctor exited with {doctor.returncode}: {doctor.stderr.read()}"
        if servers := _vllm_servers(psutil.Process(doctor.pid)):
            return servers[0]
        time.sleep(0.5)
    raise AssertionError(f"doctor started no vLLM server within {timeout_s}s")


def _vllm_servers(parent: psutil.Process) -> list[psutil.Process]:
    out = []
    for child in parent.children():
        try:
            if VLLM_SERVER in child.cmdline():
                out.append(child)
        except psutil.Error:
            continue
    return out



@pytest.mark.e2e
def test_a_probe_whose_server_cannot_start_names_the_root_cause_and_keeps_the_log(tmp_path: Path) -> None:
    """A real vLLM start that cannot hold its KV cache. The server fixtures, doctor's probe and bench start vLLM
    without the pre-flight: the error `running_server` raises (and the probe passes on whole) names the worker's
    error, not 'Engine core initialization failed. See root cause above.' (One start for both: it was two tests.)"""
    import yaml

    from kimi_eagle.doctor.engine_probe import measure_with_started_server
    from kimi_eagle.doctor.probe import ProbeError
    from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR
    from kimi_eagle.serve.profile import PROFILES_DIR

    profile = yaml.safe_load((PROFILES_DIR / "tiny-cpu-exact.yaml").read_text())
    profile["vllm_args"]["kv-cache-memory-bytes"] = "64T"  # more than any machine here: vLLM refuses after loading
    path = tmp_path / "no-room.yaml"
    path.write_text(yaml.safe_dump(profile))
    with pytest.raises(ProbeError) as failed:
        measure_with_started_server(DRAFT_DIR, TARGET_DIR, ["x = 1"], str(path))
    message = str(failed.value)
    assert (f"vLLM did not start for the pair (profile {path}): vLLM exited with code 1 before it was ready; "
            "root cause: ValueError: Available memory on node") in message, message
    # The profile runs the worker inside the engine core (uni): the process that raised is named, not the API server.
    assert "(65536.0 GiB)" in message and "in vLLM's EngineCore process" in message, message
    log = Path(message.split("the whole log: ")[1].split()[0])
    assert log.is_file() and "Available memory on node" in log.read_text()
