"""`kimi-eagle serve` and `kimi-eagle fixtures` as a user runs them, up to the point where vLLM would start."""


from __future__ import annotations

import json
import shlex

import pytest

from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.profile import load_profile
from tests.helpers.cli import run_cli, run_cli_here


def test_fixtures_where_prints_the_pair() -> None:
    result = run_cli("fixtures", "--where")
    assert result.returncode == 0
    assert result.stdout.splitlines() == [f"target={TARGET_DIR}", f"draft={DRAFT_DIR}"]


def test_dry_run_prints_the_vllm_command_with_overrides_applied(capfd: pytest.CaptureFixture[str]) -> None:
    result = run_cli_here(capfd, "serve", "--dry-run", "--port", "8123", "-k", "5", "--", "--max-num-seqs", "4")
    assert result.returncode == 0, result.stderr
    words = shlex.split(result.stdout.strip().splitlines()[-1])
    assert words[words.index("--port") + 1] == "8123"
    assert words[words.index("--host") + 1] == "127.0.0.1"
    assert words.count("--max-num-seqs") == 1 and words[words.index("--max-num-seqs") + 1] == "4"
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec == {"model": str(DRAFT_DIR), "method": "eagle3", "num_speculative_tokens": 5}


def test_port_and_host_after_the_separator_are_the_ones_waited_on() -> None:
    """`-- --port N` once reached vLLM as a second --port: the server listened on N while we waited on 8000."""
    command = build_command(load_profile("tiny-cpu"), extra_args=["--port", "8124", "--host=localhost"])
    assert command.url == "http://localhost:8124"
    assert command.argv.count("--port") == 1 and command.argv[command.argv.index("--port") + 1] == "8124"
    assert command.argv.count("--host") == 1 and command.argv[command.argv.index("--host") + 1] == "localhost"


def test_no_draft_serves_the_target_alone(capfd: pytest.CaptureFixture[str]) -> None:
    result = run_cli_here(capfd, "serve", "--dry-run", "--no-draft")
    assert result.returncode == 0, result.stderr
    assert "--speculative-config" not in result.stdout
    assert "--per-request-spec-decode-metrics" not in result.stdout  # vLLM refuses it without speculation


def test_the_profile_asks_for_per_request_acceptance_with_the_draft() -> None:
    words = build_command(load_profile("tiny-cpu")).argv
    assert words[words.index("--per-request-spec-decode-metrics") + 1] == "summary"


def test_unknown_vllm_flag_is_refused_before_anything_starts(capfd: pytest.CaptureFixture[str]) -> None:
    result = run_cli_here(capfd, "serve", "--dry-run", "--", "--no-such-flag")
    assert result.returncode == 2
    assert "--no-such-flag" in result.stderr


def test_unknown_profile_lists_the_known_ones() -> None:
    result = run_cli("serve", "no-such-profile", "--dry-run")
    assert result.returncode == 2
    assert "known profiles are" in result.stderr and "tiny-cpu" in result.stderr


def test_binding_beyond_loopback_requires_an_api_key(capfd: pytest.CaptureFixture[str]) -> None:
    refused = run_cli_here(capfd, "serve", "--dry-run", "--host", "0.0.0.0", env={"VLLM_API_KEY": ""})
    assert refused.returncode == 2
    assert "API key" in refused.stderr
    allowed = run_cli_here(capfd, "serve", "--dry-run", "--host", "0.0.0.0", "--api-key", "s3cret-key")
    assert allowed.returncode == 0, allowed.stderr
    assert "s3cret-key" not in allowed.stdout + allowed.stderr


def test_help_recommends_the_key_in_the_environment() -> None:
    """A key on the command line shows in `ps` to every user of the machine."""
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    assert "VLLM_API_KEY" in result.stdout and "ps" in result.stdout


def test_a_flag_vllm_refuses_stops_the_server_started_beside_the_check_before_it_prints() -> None:
    """`serve` starts vLLM while vLLM's own parser and config classes check the command (both import vLLM first):
    the refusal is the one line the user reads, not vLLM's usage or traceback."""
    result = run_cli("serve", "--port", str(free_port()), "--", "--no-such-flag", timeout=120)
    assert result.returncode == 2
    assert "kimi-eagle serve: vLLM rejects the flags of this profile: unrecognized arguments: --no-such-flag" \
        in result.stderr
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr and "(APIServer" not in result.stderr


def test_a_port_another_server_listens_on_is_refused_before_vllm_starts(capfd: pytest.CaptureFixture[str]) -> None:
    """Before, the other server answered /health while ours imported: `serve` printed Ready for it, then ours died
    binding the port ("Address already in use")."""
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        done = run_cli_here(capfd, "serve", "--port", str(port))
    assert done.returncode == 2, done.stderr
    assert f"pre-flight: 127.0.0.1:{port} is already in use" in done.stderr
    assert "Starting vLLM" not in done.stderr and "Ready in" not in done.stdout
