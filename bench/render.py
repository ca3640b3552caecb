"""`kimi-eagle bench render`: each mode's latest run, its tables and plots, written into the Markdown files showing it.

A file shows a mode's latest run between two markers, `<!-- render:MODE -->` and `<!-- /render:MODE -->` (MODE: a
measuring subcommand of `kimi-eagle bench`). Render rewrites what lies between them from the newest results file of
that mode (`<prefix>-<YYYYmmdd-HHMMSS>.json` in the results folder; a quick run is never one): the run's report,
its headings two levels down, the file it came from, and its plots, drawn into the plots folder. The same results
give the same text and the same PNG bytes, so a rendered file changes only when a run does, and `--check` tells
where a file no longer shows what the results render (a test keeps BENCHMARKS.md current so).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from kimi_eagle.bench.plots import Plot
from kimi_eagle.bench.result import ModeResults, fault_named
from kimi_eagle.bench.subcommand import RESULTS_DIR, BenchError
from kimi_eagle.loadtest.files import write_atomic

DEFAULT_FILE = Path("BENCHMARKS.md")
PLOTS_DIR = RESULTS_DIR / "plots"
# `render:MODE`, or `render:MODE:FAULT` for the latest run made with KIMI_EAGLE_FAULT=FAULT (`<prefix>-FAULT-<time>`)
SHOWN = r"[\w-]+(?::[\w-]+)?"
OPENING = re.compile(rf"<!-- render:(?P<mode>{SHOWN}) -->")
SECTION = re.compile(rf"(?P<open><!-- render:(?P<mode>{SHOWN}) -->\n).*?(?P<close><!-- /render:(?P=mode) -->)", re.S)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXIT_DRIFT = 1  # as `ruff format --check`: the files are not what the results render


def register(modes: argparse._SubParsersAction, results: Sequence[ModeResults]) -> None:
    names = ", ".join(r.mode for r in results)
    p = modes.add_parser("render", help="each mode's latest run, tables and plots, into BENCHMARKS.md (or the "
                                        "files given) between its markers",
                         description=f"Rewrites, in each file, what lies between `<!-- render:MODE -->` and "
                                     f"`<!-- /render:MODE -->` (MODE: {names}) with the latest run of that mode: "
                                     f"its report and its plots (PNG, drawn into the plots folder). Starts no "
                                     f"server.")
    p.add_argument("files", nargs="*", type=Path, default=[DEFAULT_FILE], metavar="MARKDOWN",
                   help=f"the files to rewrite (default {DEFAULT_FILE})")
    p.add_argument("--results", type=Path, default=RESULTS_DIR, help=f"results folder (default {RESULTS_DIR})")
    p.add_argument("--plots", type=Path, default=PLOTS_DIR, help=f"where the plots go (default {PLOTS_DIR})")
    p.add_argument("--check", action="store_true",
                   help=f"write nothing; exit {EXIT_DRIFT} naming each section that is not what the results render "
                        "and each plot it shows that is missing")
    p.set_defaults(run=partial(run, results=tuple(results)))


@dataclass(frozen=True)
class Rendered:
    """A mode's latest run as a file shows it."""

    mode: str
    source: Path
    report: str  # the mode's Markdown report of the run
    plots: list[Plot]


def latest(results: ModeResults, results_dir: Path, plots_dir: Path, fault: str = "") -> Rendered:
    """The newest run of a mode (made with KIMI_EAGLE_FAULT=`fault`, if given), its plots drawn into `plots_dir`."""
    runs = results.runs(results_dir, fault)
    if not runs:
        made = f"KIMI_EAGLE_FAULT={fault} " if fault else ""
        raise BenchError(f"no results of `{made}kimi-eagle bench {results.mode}` in {results_dir} "
                         f"({fault_named(results.prefix, fault)}-<time>.json): run it, or give --results DIR")
    try:
        result = results.load(runs[-1])
    except (OSError, ValueError) as exc:  # pydantic's errors are ValueErrors
        raise BenchError(f"{runs[-1]} is not a results file of `kimi-eagle bench {results.mode}`: {exc}") from None
    return Rendered(mode=results.mode, source=runs[-1], report=results.markdown(result),
                    plots=results.plots(result, plots_dir))


def section(rendered: Rendered, markdown_file: Path, plots_dir: Path) -> str:
    """What a file shows between a mode's markers (without them): links relative to the file."""
    def link(path: Path) -> str:
        return Path(os.path.relpath(path.resolve(), markdown_file.resolve().parent)).as_posix()

    title, _, body = rendered.report.partition("\n")
    source = link(rendered.source)
    lines = [f"<!-- written by `kimi-eagle bench render` from {source}: change the results, not this -->", "",
             f"##{title}" if title.startswith("#") else title, "",
             f"Latest run: [`{source}`]({source}) (the report beside it: `{Path(source).with_suffix('.md')}`).", ""]
    for plot in rendered.plots:
        lines += [f"![{plot.title}]({link(plots_dir / plot.path.name)})", ""]
    return "\n".join([*lines, _demoted(body).strip("\n"), ""])


def _demoted(markdown: str) -> str:
    """Headings two levels down (the file's own section holds them), code blocks left as they are."""
    out, fenced = [], False
    for line in markdown.split("\n"):
        if line.startswith("```"):
            fenced = not fenced
        out.append(f"##{line}" if not fenced and re.match(r"#+ ", line) else line)
    return "\n".join(out)


def modes_shown(text: str, path: Path, known: Sequence[str]) -> list[str]:
    """The modes `text` (the file at `path`) has a section for, in order; refuses unknown or unclosed markers."""
    opened = [m["mode"] for m in OPENING.finditer(text)]
    closed = [m["mode"] for m in SECTION.finditer(text)]
    if not opened:
        raise BenchError(f"{path} has no section to render: put `<!-- render:MODE -->` and `<!-- /render:MODE -->` "
                         f"on lines of their own where a mode's latest run should show (MODE: {', '.join(known)})")
    if unknown := [m for m in opened if m.partition(":")[0] not in known]:
        raise BenchError(f"{path}: no mode named {', '.join(unknown)} (`<!-- render:MODE -->`, MODE: "
                         f"{', '.join(known)})")
    if opened != closed:
        unclosed = [m for m in opened if m not in closed]
        raise BenchError(f"{path}: `<!-- render:{unclosed[0] if unclosed else opened[0]} -->` needs its "
                         "`<!-- /render:MODE -->` on a line of its own after it (each mode once)")
    return closed


def rewritten(text: str, sections: dict[str, str]) -> str:
    return SECTION.sub(lambda m: m["open"] + sections[m["mode"]] + m["close"], text)


def run(args: argparse.Namespace, results: Sequence[ModeResults]) -> int:
    by_mode = {r.mode: r for r in results}
    texts = {path: _read(path) for path in args.files}
    wanted = {path: modes_shown(text, path, list(by_mode)) for path, text in texts.items()}
    modes = list(dict.fromkeys(m for shown in wanted.values() for m in shown))

    def render(shown: str, plots_dir: Path) -> Rendered:
        mode, _, fault = shown.partition(":")
        return latest(by_mode[mode], args.results, plots_dir, fault)

    if args.check:
        with tempfile.TemporaryDirectory() as scratch:
            rendered = {m: render(m, Path(scratch)) for m in modes}
        return _check(texts, wanted, rendered, args.plots)
    rendered = {m: render(m, args.plots) for m in modes}
    for path, text in texts.items():
        new = rewritten(text, {m: section(rendered[m], path, args.plots) for m in wanted[path]})
        if new != text:
            write_atomic(path, new)
        print(f"{path}: {', '.join(f'{m} ({rendered[m].source.name})' for m in wanted[path])}"
              + ("" if new != text else ", unchanged"))
    for r in rendered.values():
        print(f"plots of {r.mode}: {', '.join(str(args.plots / p.path.name) for p in r.plots)}", file=sys.stderr)
    return 0


def _check(texts: dict[Path, str], wanted: dict[Path, list[str]], rendered: dict[str, Rendered],
           plots_dir: Path) -> int:
    stale = []
    for path, text in texts.items():
        shown = {m["mode"]: m.group(0) for m in SECTION.finditer(text)}
        for mode in wanted[path]:
            expected = rewritten(shown[mode], {mode: section(rendered[mode], path, plots_dir)})
            if shown[mode] != expected:
                stale.append(f"{path}: the {mode} section is not what {rendered[mode].source} renders")
    for r in rendered.values():
        for plot in r.plots:
            png = plots_dir / plot.path.name
            if not png.is_file() or not png.read_bytes().startswith(PNG_SIGNATURE):
                stale.append(f"{png} is missing (a plot of {r.mode})")
    if not stale:
        print(f"up to date: {', '.join(map(str, texts))}")
        return 0
    files = " ".join(map(str, texts))
    print("\n".join(stale) + f"\nrun `kimi-eagle bench render {files}`", file=sys.stderr)
    return EXIT_DRIFT


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as exc:
        raise BenchError(f"cannot read {path}: {exc.strerror}: give the Markdown file to render into") from None
