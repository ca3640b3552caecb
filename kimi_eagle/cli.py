"""`kimi-eagle`: one console script; each subcommand lives with the part of the project that owns it."""

from __future__ import annotations

import argparse
import sys

from kimi_eagle.processes import collect_garbage_less_often

SUBCOMMAND_MODULES = ("kimi_eagle.serve.cli", "kimi_eagle.doctor.cli", "kimi_eagle.loadtest.cli",
                      "kimi_eagle.serve.sglang_cli", "kimi_eagle.serve.sizing_cli", "kimi_eagle.bench.cli",
                      "kimi_eagle.doctor.vllm_surface")
# Options whose value is an opaque secret: a generated key starts with '-' one time in 32 (token_urlsafe), and
# argparse would take `--api-key -x...` for a missing value followed by an unknown flag.
SECRET_VALUE_OPTIONS = ("--api-key",)


def build_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """`kimi-eagle`'s parser and its subcommands (the docs' check reads every command they show against it)."""
    import importlib

    parser = argparse.ArgumentParser(prog="kimi-eagle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # Each part of the project registers its own subcommands; the order is the order of `--help`.
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser, sub


def main(argv: list[str] | None = None) -> int:
    parser, sub = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    # Everything after the first `--` belongs to vLLM, untouched by our parser.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(_join_secret_values(argv, _option_strings(sub)))
    args.passthrough = passthrough
    return int(args.handler(args) or 0)


def run() -> int:
    """The `kimi-eagle` program (its console script, and `python -m kimi_eagle.cli`): `main` in a process of its own,
    which most commands fill with torch and vLLM, or with Locust."""
    collect_garbage_less_often()
    return main()


def _option_strings(sub: argparse._SubParsersAction) -> set[str]:
    return {flag for command in sub.choices.values() for action in command._actions for flag in action.option_strings}


def _join_secret_values(argv: list[str], known_flags: set[str]) -> list[str]:
    """`--api-key -abc` becomes `--api-key=-abc`, unless `-abc` is one of our own flags (a forgotten value)."""
    joined: list[str] = []
    rest = iter(argv)
    for token in rest:
        following = next(rest, None) if token in SECRET_VALUE_OPTIONS else None
        if following is None:
            joined.append(token)
        elif following.startswith("-") and following.split("=", 1)[0] not in known_flags:
            joined.append(f"{token}={following}")
        else:
            joined.extend((token, following))
    return joined


if __name__ == "__main__":
    sys.exit(run())
