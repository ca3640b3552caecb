"""`kimi-eagle`: one console script; each subcommand lives with the part of the project that owns it."""

from __future__ import annotations

import argparse
import sys

SUBCOMMAND_MODULES = ("serve.cli", "doctor.cli", "loadtest.cli", "serve.sglang_cli", "bench.cli")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kimi-eagle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    import importlib

    # Each part of the project registers its own subcommands; the order is the order of `--help`.
    for module in SUBCOMMAND_MODULES:
        importlib.import_module(module).register(sub)
    argv = sys.argv[1:] if argv is None else argv
    # Everything after the first `--` belongs to vLLM, untouched by our parser.
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    args.passthrough = passthrough
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
