"""`kimi-eagle`: one console script; each subcommand lives with the part of the project that owns it."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kimi-eagle", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from serve import cli as serve_cli

    serve_cli.add_serve_parser(sub)
    serve_cli.add_fixtures_parser(sub)
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
