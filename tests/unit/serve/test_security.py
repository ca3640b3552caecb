"""Exposure of the served stack, checked on commands and files: loopback by default, an API key for anything else,
no remote code for the tiny pair, safetensors only, and secrets never printed."""


from __future__ import annotations

import ast
import itertools
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR
from kimi_eagle.serve.command import API_KEY_ENV, CommandError, build_command
from kimi_eagle.serve.integrity import check_weight_folder
from kimi_eagle.serve.profile import available_profiles, load_profile
from kimi_eagle.serve.redact import REDACTED, redact_argv, redact_env, redact_text, secrets_in
from tests.helpers.cli import CLI, REPO, exit_message, run_cli_here

# Code that runs while serving or measuring: it must never unpickle anything.
SERVING_PACKAGES = ("adapter", "serve", "loadtest", "doctor", "bench", "kimi_eagle")


@pytest.fixture(autouse=True)
def _no_key_in_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)


def tiny(**overrides) -> list[str]:
    return build_command(load_profile("tiny-cpu"), **overrides).argv


def flag_value(argv: list[str], flag: str) -> str | None:
    for word, nxt in itertools.pairwise(argv):
        if word == flag:
            return nxt
    return next((w.partition("=")[2] for w in argv if w.startswith(flag + "=")), None)


# --- binding and keys --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", available_profiles())
def test_every_profile_binds_loopback_by_default(profile: str) -> None:
    assert flag_value(build_command(load_profile(profile)).argv, "--host") == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "server.example.com"])
def test_binding_beyond_loopback_without_a_key_is_refused_and_says_how(host: str) -> None:
    with pytest.raises(CommandError) as refused:
        build_command(load_profile("tiny-cpu"), host=host)
    message = str(refused.value)
    assert host in message and "--api-key" in message and API_KEY_ENV in message


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_loopback_needs_no_key(host: str) -> None:
    assert flag_value(tiny(host=host), "--host") == host


def test_a_key_allows_any_address_and_travels_by_environment_only() -> None:
    key = secrets.token_urlsafe(24)
    command = build_command(load_profile("tiny-cpu"), host="0.0.0.0", api_key=key)
    assert command.env[API_KEY_ENV] == key
    assert key not in " ".join(command.argv)  # `ps` shows argv to every user of the machine
    assert key not in command.printable()


def test_key_from_the_environment_is_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    key = secrets.token_urlsafe(24)
    monkeypatch.setenv(API_KEY_ENV, key)
    command = build_command(load_profile("tiny-cpu"), host="0.0.0.0")
    assert command.api_key == key and key not in command.printable()


@pytest.mark.parametrize("form", ["two words", "equals"])
def test_a_key_passed_through_to_vllm_is_moved_out_of_argv(form: str) -> None:
    """`kimi-eagle serve -- --api-key KEY`: vLLM would accept it, but in argv every local user can read it."""
    key = secrets.token_urlsafe(24)
    extra = ["--api-key", key] if form == "two words" else [f"--api-key={key}"]
    command = build_command(load_profile("tiny-cpu"), host="0.0.0.0", extra_args=extra)
    assert key not in " ".join(command.argv)
    assert key not in command.printable()
    assert command.env.get(API_KEY_ENV) == key


def middleware(argv: list[str]) -> list[str]:
    return [nxt for w, nxt in itertools.pairwise(argv) if w == "--middleware"]


def test_the_key_guard_covers_every_route_when_a_key_is_set() -> None:
    assert "kimi_eagle.serve.api_guard.RequireApiKey" in middleware(tiny(api_key="k"))
    assert "kimi_eagle.serve.api_guard.RequireApiKey" not in middleware(tiny())


def test_unknown_request_fields_are_refused_with_or_without_a_key() -> None:
    assert middleware(tiny()) == ["kimi_eagle.serve.api_guard.RejectBadFields"]
    # Starlette runs the middleware added last first: the key is checked before anything is said about the body.
    assert middleware(tiny(api_key="k")) == ["kimi_eagle.serve.api_guard.RejectBadFields",
                                             "kimi_eagle.serve.api_guard.RequireApiKey"]


def test_a_failed_start_shows_its_log_without_the_key(tmp_path: Path) -> None:
    """vLLM's log ends up in the ServerStartError message (terminals, CI logs): the key must not."""
    from kimi_eagle.serve.command import ServeCommand
    from kimi_eagle.serve.launch import ServerStartError, start, wait_healthy

    key = secrets.token_urlsafe(24)
    script = f"import os; print('engine args: api_key=' + os.environ['{API_KEY_ENV}']); raise SystemExit(3)"
    command = ServeCommand(argv=[sys.executable, "-c", script], env={API_KEY_ENV: key}, url="http://127.0.0.1:9",
                           served_model_name="m", target="t", draft=None, api_key=key)
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError) as failed:
        wait_healthy(start(command, log), command.url, 30, log, api_key=key)
    assert key in log.read_text()  # the child really printed it
    assert "exited with code 3" in str(failed.value) and f"api_key={REDACTED}" in str(failed.value)
    assert key not in str(failed.value)


def test_cli_refuses_a_public_bind_without_a_key() -> None:
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    done = subprocess.run([*CLI, "serve", "--host", "0.0.0.0", "--dry-run"], capture_output=True, text=True,
                          env=env, timeout=300, cwd=REPO)
    assert done.returncode == 2
    assert "--api-key" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("leading", ["", "-"], ids=["plain-key", "key-starting-with-dash"])
def test_cli_dry_run_never_prints_the_key(leading: str, capfd: pytest.CaptureFixture[str]) -> None:
    # A generated key (token_urlsafe) starts with '-' one time in 32: CI once failed on such a key.
    key, other = leading + secrets.token_urlsafe(24), leading + secrets.token_urlsafe(24)
    # In this process (what it writes to its stdout and stderr is captured as a terminal would show it): a child
    # would import vLLM again for the dry run's check, 9-10 s on one core.
    done = run_cli_here(capfd, "serve", "--host", "0.0.0.0", "--api-key", key, "--dry-run", "--",
                        f"--api-key={other}")
    assert done.returncode == 0, exit_message(done)
    assert key not in done.stdout + done.stderr
    assert other not in done.stdout + done.stderr


@pytest.mark.parametrize("form", ["equals", "separate"])
def test_sglang_command_never_prints_a_key_given_after_the_separator(form: str, tmp_path: Path) -> None:
    """`-- --api-key=KEY` went to SGLang's argv as it was, and the printed command showed it."""
    key = secrets.token_urlsafe(24)
    passed = [f"--api-key={key}"] if form == "equals" else ["--api-key", key]
    done = subprocess.run([*CLI, "sglang-command", "--out", str(tmp_path / "view"), "--", *passed],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, exit_message(done)
    assert "sglang.launch_server" in done.stdout and REDACTED in done.stdout
    assert key not in done.stdout + done.stderr


def test_cli_api_key_without_a_value_is_refused_not_taken_as_the_key() -> None:
    done = subprocess.run([*CLI, "serve", "--host", "0.0.0.0", "--api-key", "--dry-run"],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 2
    assert "--api-key: expected one argument" in done.stderr and "Traceback" not in done.stderr


# --- remote code and pickles ------------------------------------------------------------------------------------
def test_tiny_pair_needs_no_remote_code() -> None:
    assert load_profile("tiny-cpu").trust_remote_code is False
    assert "--trust-remote-code" not in tiny()
    assert "auto_map" not in json.loads((TARGET_DIR / "config.json").read_text())
    # The speculators format writes an `auto_map` into the draft's config by convention; vLLM reads the format
    # natively and, without --trust-remote-code, never follows it. No code ships that it could run anyway:
    for folder in (TARGET_DIR, DRAFT_DIR):
        assert not [p.name for p in folder.rglob("*.py")], f"{folder} ships Python files"


@pytest.mark.parametrize("profile", available_profiles())
def test_remote_code_only_where_the_profile_asks_and_the_target_is_the_real_kimi(profile: str) -> None:
    loaded = load_profile(profile)
    argv = build_command(loaded).argv
    assert ("--trust-remote-code" in argv) == loaded.trust_remote_code
    if loaded.trust_remote_code:
        assert loaded.target.startswith("moonshotai/"), f"{profile} trusts remote code of {loaded.target}"


def test_remote_code_cannot_be_slipped_in_through_the_passthrough() -> None:
    with pytest.raises(CommandError, match="trust_remote_code"):
        build_command(load_profile("tiny-cpu"), extra_args=["--trust-remote-code"])


def test_weights_load_from_safetensors_only() -> None:
    assert flag_value(tiny(), "--load-format") == "safetensors"
    with pytest.raises(CommandError, match="safetensors"):
        build_command(load_profile("tiny-cpu"), extra_args=["--load-format", "pt"])


def test_shipped_pair_is_safetensors_without_pickles() -> None:
    for folder in (TARGET_DIR, DRAFT_DIR):
        assert list(folder.glob("*.safetensors")), folder
        assert not [p for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")]
        assert check_weight_folder(folder) == []


def test_pickle_only_checkpoint_is_refused(tmp_path: Path) -> None:
    import torch

    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text("{}")
    [problem] = check_weight_folder(tmp_path)
    assert "pickle" in problem.problem and "pytorch_model.bin" in problem.problem and "safetensors" in problem.fix


def _unpickling_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
            if (owner, node.func.attr) in {("torch", "load"), ("pickle", "load"), ("pickle", "loads"),
                                           ("joblib", "load"), ("dill", "load")}:
                found.append(f"{path.relative_to(REPO)}:{node.lineno} {owner}.{node.func.attr}")
        if isinstance(node, ast.keyword) and node.arg == "weights_only" and \
                isinstance(node.value, ast.Constant) and node.value.value is False:
            found.append(f"{path.relative_to(REPO)}:{node.value.lineno} weights_only=False")
    return found


def test_serving_code_never_unpickles() -> None:
    calls = [c for package in SERVING_PACKAGES for p in sorted((REPO / package).rglob("*.py"))
             for c in _unpickling_calls(p)]
    assert calls == []


# --- redaction ----------------------------------------------------------------------------------------------------
def test_redact_argv_both_forms_and_other_secret_flags() -> None:
    argv = ["python", "--api-key", "K1", "--port", "8000", "--api-key=K2", "--hf-token", "T"]
    assert redact_argv(argv) == ["python", "--api-key", REDACTED, "--port", "8000", f"--api-key={REDACTED}",
                                 "--hf-token", REDACTED]
    assert redact_env({"VLLM_API_KEY": "K", "X": "1"}) == {"VLLM_API_KEY": REDACTED, "X": "1"}
    assert secrets_in(argv, {"VLLM_API_KEY": "K3"}) == ["K2", "K1", "T", "K3"]
    assert redact_text("key K1 and K2, K1K2", ["K1", "K1K2"]) == f"key {REDACTED} and K2, {REDACTED}"

