"""Starting a server in the foreground: its output reaches the terminal as it comes, and a failed start is named by
the root cause in that output."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import ServeCommand
from kimi_eagle.serve.launch import ServerStartError, serve_in_foreground
from tests.helpers.cli import DATA

RECORDED_FAULT = DATA / "vllm-0.32-cpu-engine-fault.txt"

# The shape of vLLM 0.32's output when a worker fails (tests/data/vllm-0.32-cpu-start-failure.txt has a real one).
FAILING_SERVER = (
    "import sys\n"
    "print('(APIServer pid=1) INFO 12-01 01:06:17 [api_utils.py:286] non-default args: {}')\n"
    "print('(Worker pid=2) ERROR 12-01 01:07:01 [multiproc_executor.py:1063] ValueError: no room for the KV cache')\n"
    "for i in range(2000):\n"
    "    print(f'  File \"frame{i}.py\", line {i}, in f')\n"
    "print('RuntimeError: Engine core initialization failed. See root cause above.')\n"
    "sys.exit(1)\n"
)


def test_a_foreground_start_echoes_its_output_and_names_the_root_cause(capsys: pytest.CaptureFixture[str]) -> None:
    command = ServeCommand(argv=[sys.executable, "-c", FAILING_SERVER], env={}, url="http://127.0.0.1:9",
                           served_model_name="m", target="t", draft=None)
    with pytest.raises(ServerStartError) as failed:
        serve_in_foreground(command, "vLLM", ready_timeout_s=60)
    message = str(failed.value)
    assert message.startswith("vLLM exited with code 1 before it was ready; root cause: ValueError: no room for the "
                              "KV cache (in vLLM's Worker process)"), message
    err = capsys.readouterr().err
    assert "non-default args" in err and err.rstrip().endswith("See root cause above.")  # all of it, as it came


def _server_log_holds(log_dir: Path, text: str, timeout_s: float = 30) -> bool:
    """Whether the server's output, as the tee wrote it to its log (after holding it), reached `text`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(text in log.read_text() for log in log_dir.glob("kimi-eagle-serve-*.log")):
            return True
        time.sleep(0.05)
    return False


def test_a_refusal_of_the_checks_that_run_while_the_server_starts_stops_it_unseen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the server's log, where the check can watch it
    pid_file = tmp_path / "server.pid"
    server = (f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
              "print('(APIServer pid=1) INFO a line the user should ' + 'not read', flush=True)\ntime.sleep(120)\n")
    command = ServeCommand(argv=[sys.executable, "-c", server], env={}, url="http://127.0.0.1:9",
                           served_model_name="m", target="t", draft=None)

    def refuse_once_the_server_has_printed() -> str:
        assert _server_log_holds(tmp_path, "the user should not read")
        return "vLLM rejects the flags of this profile: unrecognized arguments: --no-such-flag"

    with pytest.raises(ServerStartError, match="unrecognized arguments: --no-such-flag"):
        serve_in_foreground(command, "vLLM", ready_timeout_s=60,
                            check_while_starting=refuse_once_the_server_has_printed)
    assert "the user should not read" not in capsys.readouterr().err  # the command line holds it in two parts
    assert not psutil.pid_exists(int(pid_file.read_text()))


def test_what_the_server_printed_while_the_checks_ran_is_shown_once_they_pass(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    command = ServeCommand(argv=[sys.executable, "-c", FAILING_SERVER], env={}, url="http://127.0.0.1:9",
                           served_model_name="m", target="t", draft=None)

    def pass_once_the_server_has_printed_everything() -> None:
        assert _server_log_holds(tmp_path, "See root cause above.")
        shown = capsys.readouterr().err.splitlines()  # the command line, which holds the script's text, and no more
        assert not any(line.startswith("(APIServer pid=1)") for line in shown)

    with pytest.raises(ServerStartError, match="no room for the KV cache"):
        serve_in_foreground(command, "vLLM", ready_timeout_s=60,
                            check_while_starting=pass_once_the_server_has_printed_everything)
    err = capsys.readouterr().err
    assert "non-default args" in err and err.rstrip().endswith("See root cause above.")


def test_a_server_that_dies_while_serving_is_reported_by_its_engines_root_cause(
        capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM 0.32's API server exits once its engine died, and its last words are "EngineCore encountered an issue";
    the recorded log of a real engine fault (tests/data/vllm-0.32-cpu-engine-fault.txt) is what this server prints
    after its first health check."""
    port = free_port()
    server = (
        "import http.server, sys\n"
        f"recorded = open({str(RECORDED_FAULT)!r}).read()\n"
        "class Health(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200); self.end_headers()\n"
        "        print(recorded, flush=True); self.server.dead = True\n"
        "    def log_message(self, *args): pass\n"
        f"httpd = http.server.HTTPServer(('127.0.0.1', {port}), Health); httpd.dead = False\n"
        "while not httpd.dead:\n"
        "    httpd.handle_request()\n"
    )
    command = ServeCommand(argv=[sys.executable, "-c", server], env={}, url=f"http://127.0.0.1:{port}",
                           served_model_name="m", target="t", draft=None)
    assert serve_in_foreground(command, "vLLM", ready_timeout_s=60) == 1  # it exited with 0, as vLLM's does
    report = capsys.readouterr().err.strip().splitlines()
    report = [line for line in report if line.startswith("vLLM exited")]
    assert report and report[0].startswith(
        "vLLM exited with code 0 while serving; root cause: RuntimeError: max(): Expected reduction dim to be "
        "specified for input.numel() == 0."), report
    assert report[0].endswith("(in vLLM's EngineCore process)"), report
