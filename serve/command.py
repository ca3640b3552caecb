"""Turn a profile (plus command-line overrides) into the exact vLLM server command."""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from dataclasses import dataclass, field

from serve.profile import Profile, resolve_model_path

API_KEY_ENV = "VLLM_API_KEY"


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
        """The command as a shell line, with any API key redacted."""
        import shlex

        words = [("<redacted>" if prev == "--api-key" else w) for prev, w in zip(["", *self.argv], self.argv)]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()) if k != API_KEY_ENV)
        return (env + " " if env else "") + shlex.join(words)


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


def build_command(profile: Profile, *, target: str | None = None, draft: str | None = None,
                  no_draft: bool = False, num_speculative_tokens: int | None = None, host: str | None = None,
                  port: int | None = None, api_key: str | None = None,
                  extra_args: list[str] | None = None) -> ServeCommand:
    target_path = resolve_model_path(target or profile.target)
    draft_ref = None if no_draft else (draft or profile.draft)
    draft_path = resolve_model_path(draft_ref) if draft_ref else None
    host = host or profile.host
    port = port or profile.port
    api_key = api_key or os.environ.get(API_KEY_ENV)
    if not is_loopback(host) and not api_key:
        raise CommandError(f"binding {host} exposes the server beyond this machine: give an API key "
                           f"(--api-key KEY or {API_KEY_ENV}=KEY), or bind 127.0.0.1")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", target_path, "--served-model-name", profile.served_model_name,
            "--host", host, "--port", str(port)]
    if profile.trust_remote_code:
        argv.append("--trust-remote-code")
    overridden = {w.removeprefix("--").split("=")[0].replace("_", "-") for w in extra_args or [] if w.startswith("--")}
    for name, value in profile.vllm_args.items():
        if name.replace("_", "-") not in overridden:
            argv += _flag_words(name, value)
    if draft_path:
        spec = {"model": draft_path, "method": profile.speculative.method,
                "num_speculative_tokens": num_speculative_tokens or profile.speculative.num_speculative_tokens}
        argv += ["--speculative-config", json.dumps(spec)]
    env = dict(profile.env)
    if api_key:
        env[API_KEY_ENV] = api_key  # passed by environment, so it never shows in `ps` or in our logs
    argv += extra_args or []
    return ServeCommand(argv=argv, env=env, url=f"http://{host}:{port}", served_model_name=profile.served_model_name,
                        target=target_path, draft=draft_path, api_key=api_key)


def validate_with_vllm(command: ServeCommand) -> None:
    """Parse the flags with vLLM's own argument parser: an unknown flag or a bad value fails here, not
    after minutes of loading."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm"))
    args = command.argv[3:]  # drop `python -m module`
    try:
        parser.parse_args(args)
    except SystemExit as exc:
        raise CommandError(f"vLLM rejects the flags of this profile (see its message above): {exc}") from None
