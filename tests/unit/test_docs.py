"""Every command the docs show is one the project has: each `kimi-eagle ...` against the real parser (its
subcommand, its mode, every flag it names), each `make TARGET` against the Makefile, each test file or module path
against the checkout. A renamed flag or a removed target fails here, not in a newcomer's terminal."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from kimi_eagle.bench.cli import bench_parser
from kimi_eagle.cli import build_parser
from tests.helpers.cli import REPO

ROOT = REPO
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "loadtest" / "README.md",
               *(ROOT / "docs").glob("*.md")])
# Generated reports of other vLLM releases quote vLLM's names, not commands of ours.
GENERATED = re.compile(r"vllm-surface-[\d.]+\.md$")
CODE = re.compile(r"```(?:bash|sh|console)?\n(.*?)```|`([^`\n]+)`", re.S)
COMMAND_START = re.compile(r"(?:^|\s)((?:\.venv/bin/)?kimi-eagle\s.*|make\s+[a-z][\w-]*.*)$")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|[\[\]|<>]|\.\.\.")
# What `kimi-eagle bench render` writes from a result: the command a run was made with, as it was then spelled.
RENDERED = re.compile(r"<!-- render:(?P<mode>[\w:-]+) -->.*?<!-- /render:(?P=mode) -->", re.S)


def doc_commands() -> list[tuple[str, str]]:
    """(doc, command) for every command line in a code span or block of the docs."""
    found = []
    for doc in DOCS:
        if GENERATED.search(doc.name):
            continue
        for block, span in CODE.findall(RENDERED.sub("", doc.read_text())):
            for line in (block or span).splitlines():
                line = line.split(" #", 1)[0].strip().removeprefix("$ ")
                for part in re.split(r"\s*(?:&&|;|\|\|)\s*", line):
                    part = re.sub(r"^(?:[A-Z_]+=\S+\s+)+", "", part.strip())  # VAR=value before the command
                    if match := COMMAND_START.match(part):
                        found.append((doc.relative_to(ROOT).as_posix(), match.group(1).strip()))
    return found


COMMANDS = doc_commands()


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {t for line in re.findall(r"^([\w .-]+):(?!=)", text, re.M) for t in line.split()}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def check_kimi_eagle(words: list[str]) -> str | None:
    """What is wrong with `kimi-eagle WORDS` as a doc shows it, or None."""
    _, sub = build_parser()
    if not words or words[0] not in sub.choices:
        return f"no subcommand {words[:1]} (have {sorted(sub.choices)})"
    parser, rest = sub.choices[words[0]], words[1:]
    if words[0] == "bench":
        parser = bench_parser()
    while (choices := _subparsers(parser)) and rest and not rest[0].startswith("-"):
        if PLACEHOLDER.search(rest[0]):
            break  # `kimi-eagle bench MODE`: any mode
        if rest[0] not in choices:
            return f"no mode {rest[0]!r} (have {sorted(choices)})"
        parser, rest = choices[rest[0]], rest[1:]
    if "--" in rest:
        rest = rest[:rest.index("--")]  # vLLM's flags
    known = _options(parser)
    unknown = [w.split("=", 1)[0] for w in rest if w.startswith("--") and w.split("=", 1)[0] not in known]
    return f"unknown flags {unknown} (have {sorted(known)})" if unknown else None


def test_the_docs_show_commands() -> None:
    docs = {doc for doc, _ in COMMANDS}
    assert "README.md" in docs and "BENCHMARKS.md" in docs, docs
    assert len(COMMANDS) > 20, COMMANDS


@pytest.mark.parametrize(("doc", "command"), COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in COMMANDS])
def test_every_command_a_doc_shows_exists(doc: str, command: str) -> None:
    try:
        words = shlex.split(command)
    except ValueError:
        words = command.split()
    if words[0].endswith("kimi-eagle"):
        problem = check_kimi_eagle(words[1:])
    else:  # make TARGET [VAR=value ...]
        targets = make_targets()
        missing = [w for w in words[1:] if "=" not in w and not w.startswith("-") and not PLACEHOLDER.search(w)
                   and w not in targets]
        problem = f"no make target {missing}" if missing else None
    assert problem is None, f"{doc}: `{command}`: {problem}"


def test_paths_the_docs_name_exist() -> None:
    """Test files and modules a doc tells one to run."""
    missing = []
    for doc in DOCS:
        for path in re.findall(r"(?:pytest|python -m pytest)\s+((?:tests|bench|adapter)/[\w/.]+\.py)", doc.read_text()):
            if not (ROOT / path).exists():
                missing.append((doc.name, path))
        for module in re.findall(r"python -m (kimi_eagle(?:\.\w+)+)", doc.read_text()):
            parts = module.split(".")[1:]
            top = {"bench": "bench", "serve": "serve", "loadtest": "loadtest", "doctor": "doctor",
                   "adapter": "adapter", "fixtures": "fixtures"}.get(parts[0])
            base = ROOT / top / Path(*parts[1:]) if top else ROOT / "kimi_eagle" / Path(*parts)
            if not (base.with_suffix(".py").exists() or (base / "__init__.py").exists()):
                missing.append((doc.name, module))
    assert not missing, missing
