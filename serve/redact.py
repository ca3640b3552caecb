"""Secrets out of everything we print or write: command lines, environments, log tails, reports."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping

REDACTED = "<redacted>"
SECRET_FLAGS = ("--api-key", "--hf-token")
SECRET_ENV = ("VLLM_API_KEY", "OPENAI_API_KEY", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def redact_argv(argv: Iterable[str]) -> list[str]:
    """`--api-key KEY` and `--api-key=KEY` (and the other secret flags) with the value replaced."""
    out: list[str] = []
    hide_next = False
    for word in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        flag, eq, _ = word.partition("=")
        if flag in SECRET_FLAGS:
            out.append(f"{flag}={REDACTED}" if eq else word)
            hide_next = not eq
        else:
            out.append(word)
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (REDACTED if k in SECRET_ENV else v) for k, v in env.items()}


def secrets_in(argv: Iterable[str] = (), env: Mapping[str, str] | None = None) -> list[str]:
    """The secret values present in a command line and an environment (default: ours)."""
    words = list(argv)
    found = [w.partition("=")[2] for w in words if w.partition("=")[0] in SECRET_FLAGS and "=" in w]
    found += [nxt for w, nxt in itertools.pairwise(words) if w in SECRET_FLAGS]
    env = os.environ if env is None else env
    found += [env[k] for k in SECRET_ENV if env.get(k)]
    return [s for s in dict.fromkeys(found) if s]


def redact_text(text: str, secrets: Iterable[str]) -> str:
    """Every occurrence of each secret replaced (longest first, so a key that contains another goes whole)."""
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, REDACTED)
    return text
