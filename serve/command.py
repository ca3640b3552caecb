"""Turn a profile (plus command-line overrides) into the exact vLLM server command (`validate.py` checks it with
vLLM's own code)."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from dataclasses import dataclass, field

from kimi_eagle.serve.profile import Profile, resolve_model_path
from kimi_eagle.serve.redact import redact_argv, redact_env, redact_text

API_KEY_ENV = "VLLM_API_KEY"
VLLM_SERVER = "kimi_eagle.serve.vllm_server"  # vLLM's own server `main`, without a second import in the engine core
LOAD_FORMAT = "safetensors"  # never a pickle format: unpickling runs code from the file
API_GUARD = "kimi_eagle.serve.api_guard.RequireApiKey"
FIELD_GUARD = "kimi_eagle.serve.api_guard.RejectBadFields"


class CommandError(ValueError):
    """An unusable combination of profile and overrides; the message says how to fix it."""


@dataclass
class ServeCommand:
    argv: list[str]
    env: dict[str, str]
    url: str
    served_model_name: str
    target: str
    draft: str | None
    api_key: str | None = field(default=None, repr=False)

    def printable(self) -> str:
        """The command as a shell line, every secret redacted (in either flag form, and in the environment)."""
        import shlex

        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(redact_env(self.env).items()) if k != API_KEY_ENV)
        line = (env + " " if env else "") + shlex.join(redact_argv(self.argv))
        return redact_text(line, [self.api_key or ""])


def _flag_words(name: str, value: object) -> list[str]:
    flag = f"--{name}"
    if value is True:
        return [flag]
    if value is False or value is None:
        return []
    if isinstance(value, dict | list):
        return [flag, json.dumps(value)]
    return [flag, str(value)]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _take_flag(extra_args: list[str], flag: str) -> tuple[list[str], str | None]:
    """`flag VALUE` (or `flag=VALUE`) out of the words passed through to vLLM, and its last value."""
    kept: list[str] = []
    value = None
    words = iter(extra_args)
    for word in words:
        if word == flag:
            value = next(words, None)
        elif word.startswith(f"{flag}="):
            value = word.partition("=")[2]
        else:
            kept.append(word)
    return kept, value


def _refuse_unsafe_passthrough(extra_args: list[str], profile: Profile) -> None:
    names = {w.removeprefix("--").partition("=")[0].replace("_", "-"): i for i, w in enumerate(extra_args)
             if w.startswith("--")}
    if "trust-remote-code" in names and not profile.trust_remote_code:
        raise CommandError("--trust-remote-code runs Python code shipped with the checkpoint: only a profile that "
                           "sets `trust_remote_code: true` for a target that needs it (the real Kimi-K2.5) may")
    if "load-format" in names:
        word = extra_args[names["load-format"]]
        value = word.partition("=")[2] if "=" in word else next(iter(extra_args[names["load-format"] + 1:]), "")
        if value != LOAD_FORMAT:
            raise CommandError(f"--load-format {value or '(none)'}: weights load from {LOAD_FORMAT} only (other "
                               "formats unpickle, which runs code from the file)")


def build_command(profile: Profile, *, target: str | None = None, draft: str | None = None,
                  no_draft: bool = False, num_speculative_tokens: int | None = None, host: str | None = None,
                  port: int | None = None, api_key: str | None = None,
                  extra_args: list[str] | None = None) -> ServeCommand:
    target_path = resolve_model_path(target or profile.target)
    draft_ref = None if no_draft else (draft or profile.draft)
    draft_path = resolve_model_path(draft_ref) if draft_ref else None
    # The key leaves argv, where every local user could read it in `ps`; host and port are ours to pass, so that the
    # URL we wait on and print is the one the server listens on.
    extra, passed_key = _take_flag(list(extra_args or []), "--api-key")
    extra, passed_host = _take_flag(extra, "--host")
    extra, passed_port = _take_flag(extra, "--port")
    host = host or passed_host or profile.host
    try:
        port = port or int(passed_port or profile.port)
    except ValueError:
        raise CommandError(f"--port {passed_port}: not a port number") from None
    _refuse_unsafe_passthrough(extra, profile)
    api_key = api_key or passed_key or os.environ.get(API_KEY_ENV)
    if not is_loopback(host) and not api_key:
        raise CommandError(f"binding {host} exposes the server beyond this machine: give an API key "
                           f"(--api-key KEY or {API_KEY_ENV}=KEY), or bind 127.0.0.1")
    argv = [sys.executable, "-m", VLLM_SERVER,
            "--model", target_path, "--served-model-name", profile.served_model_name,
            "--host", host, "--port", str(port), "--load-format", LOAD_FORMAT]
    if profile.trust_remote_code:
        argv.append("--trust-remote-code")
    overridden = {w.removeprefix("--").split("=")[0].replace("_", "-") for w in extra if w.startswith("--")}
    for name, value in profile.vllm_args.items():
        if name.replace("_", "-") not in overridden:
            argv += _flag_words(name, value)
    if draft_path:
        spec = {"model": draft_path, "method": profile.speculative.method,
                "num_speculative_tokens": num_speculative_tokens or profile.speculative.num_speculative_tokens}
        # A fixed k asked for on the command line (bench, -k) replaces the profile's schedule.
        if profile.speculative.num_speculative_tokens_per_batch_size and num_speculative_tokens is None:
            spec["num_speculative_tokens_per_batch_size"] = profile.speculative.num_speculative_tokens_per_batch_size
        argv += ["--speculative-config", json.dumps(spec)]
        if profile.speculative.per_request_metrics != "none":
            argv += ["--per-request-spec-decode-metrics", profile.speculative.per_request_metrics]
    env = dict(profile.env)
    # vLLM silently ignores request fields it does not know (a misspelt `max_token`): this answers 400 naming them.
    argv += ["--middleware", FIELD_GUARD]
    if api_key:
        env[API_KEY_ENV] = api_key  # passed by environment, so it never shows in `ps` or in our logs
        # vLLM checks the key only under /v1 and a few other prefixes: this guard covers every route that does work.
        # Added last, so that it runs first (Starlette wraps the last middleware added outermost): a client without
        # the key learns nothing about the request's fields.
        argv += ["--middleware", API_GUARD]
    argv += extra
    return ServeCommand(argv=argv, env=env, url=f"http://{host}:{port}", served_model_name=profile.served_model_name,
                        target=target_path, draft=draft_path, api_key=api_key)
