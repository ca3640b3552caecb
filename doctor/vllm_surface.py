"""`kimi-eagle vllm-surface VERSION`: what of kimi-eagle's list of vLLM attributes (`adapter/surface.py`) a vLLM
release still has, read from its source distribution without installing it: the measured part of a port plan.

Each entry is found in the release's source by its module and dotted attribute (a class body, a function, an
assignment or a re-export), and its parameters are compared with those the wrapper expects. An entry whose module
is gone is looked for elsewhere in the release, by the name it defines.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from kimi_eagle.adapter.surface import FEATURES, READ_AGAINST, TOUCHES, Touch
from kimi_eagle.vllm_sources import SourceTree, SourceUnavailableError

STATUSES = ("ok", "changed", "moved", "missing", "outside vLLM")


@dataclass
class EntryReport:
    key: str
    features: list[str]
    kind: str
    status: str
    detail: str


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    a = node.args
    names = [x.arg for x in (*a.posonlyargs, *a.args)]
    names += [a.vararg.arg] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [a.kwarg.arg] if a.kwarg else []
    if any(isinstance(d, ast.Name) and d.id == "classmethod" for d in node.decorator_list):
        names = names[1:]  # as `inspect.signature` gives a classmethod: bound, without `cls`
    return tuple(names)


def _statements(body: list[ast.stmt]):
    """A scope's statements, with those under `if`/`try` (version and import guards) included."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If | ast.Try):
            for block in (stmt.body, getattr(stmt, "orelse", []), *(h.body for h in getattr(stmt, "handlers", []))):
                yield from _statements(block)


def _defines(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return any((alias.asname or alias.name.split(".")[0]) == name for alias in stmt.names)
    return False


def find(tree: ast.Module, attribute: str) -> ast.stmt | None:
    """The statement that defines `attribute` ("Class.method" or "name") in a module."""
    scope, found = tree.body, None
    for depth, part in enumerate(attribute.split(".")):
        found = next((stmt for stmt in _statements(scope) if _defines(stmt, part)), None)
        if found is None:
            return None
        if depth < attribute.count("."):
            if not isinstance(found, ast.ClassDef):
                return None
            scope = found.body
    return found


def _moved_to(tree: SourceTree, attribute: str, modules: list[str]) -> list[str]:
    first = attribute.split(".")[0]
    found = []
    for module in modules:
        source = tree.module_source(module)
        if source and find(ast.parse(source[1]), attribute) is not None and not isinstance(
                find(ast.parse(source[1]), first), ast.Import | ast.ImportFrom):
            found.append(module)
    return found


def _all_modules(tree: SourceTree) -> list[str]:
    paths = tree._members if tree._package_dir is None else {
        str(p.relative_to(tree._package_dir)): None for p in tree._package_dir.rglob("*.py")}
    return ["vllm." + p.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for p in paths
            if p.endswith(".py")]


def check(entry: Touch, tree: SourceTree, modules: list[str] | None = None) -> EntryReport:
    report = EntryReport(entry.key, list(entry.features), entry.kind, "ok", "")
    if not entry.module.startswith("vllm"):
        report.status, report.detail = "outside vLLM", f"{entry.module} (checked against the installed package)"
        return report
    source = tree.module_source(entry.module)
    if source is None:
        moved = _moved_to(tree, entry.attribute, modules if modules is not None else _all_modules(tree))
        report.status = "moved" if moved else "missing"
        report.detail = (f"module {entry.module} is gone; {', '.join(moved)} defines {entry.attribute} (check that "
                         "it is the same code before using it there)" if moved
                         else f"module {entry.module} is gone, and no module defines {entry.attribute}")
        return report
    node = find(ast.parse(source[1]), entry.attribute)
    if node is None:
        report.status, report.detail = "missing", f"{source[0]} has no {entry.attribute}"
    elif isinstance(node, ast.Import | ast.ImportFrom):
        report.detail = "re-exported by the module"
    elif entry.params is not None and isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        params = _params(node)
        if params != entry.params:
            report.status = "changed"
            report.detail = f"parameters ({', '.join(entry.params)}) -> ({', '.join(params)})"
    return report


def surface_report(tree: SourceTree) -> list[EntryReport]:
    modules = _all_modules(tree)
    return [check(entry, tree, modules) for entry in TOUCHES]


def render(version: str, reports: list[EntryReport]) -> str:
    counts = {status: sum(r.status == status for r in reports) for status in STATUSES}
    lines = [f"# vLLM {version} against what kimi-eagle touches",
             "",
             f"Made by `kimi-eagle vllm-surface {version}` from vLLM {version}'s source distribution (not installed), "
             f"against the list in `adapter/surface.py`, read in vLLM {', '.join(READ_AGAINST)}.",
             "",
             f"**{len(reports)} entries: " + ", ".join(f"{n} {s}" for s, n in counts.items()) + ".**",
             "",
             "| attribute | kind | features | status | detail |", "|---|---|---|---|---|"]
    lines += [f"| `{r.key}` | {r.kind} | {', '.join(r.features)} | {r.status} | {r.detail} |" for r in reports]
    lines += ["", "## Features with an entry that is not ok", ""]
    broken = {key for r in reports if r.status not in ("ok", "outside vLLM") for key in r.features}
    for feature in FEATURES:
        if feature.key in broken:
            entries = [f"`{r.key}` ({r.status})" for r in reports
                       if feature.key in r.features and r.status not in ("ok", "outside vLLM")]
            lines.append(f"- **{feature.key}** ({feature.name}): {', '.join(entries)}")
    if not broken:
        lines.append("- none")
    return "\n".join(lines) + "\n"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vllm-surface", help="what of the vLLM attributes kimi-eagle touches a vLLM release has",
                       description="Fetch a vLLM release's source distribution from the package index (cached, not "
                                   "installed) and report every attribute of kimi-eagle's list that is missing, "
                                   "moved or changed there.")
    p.add_argument("version", nargs="?", help="the vLLM release, e.g. 0.34.0 (default: the installed vLLM's files)")
    p.add_argument("--out", type=Path, help="write the Markdown report here")
    p.add_argument("--json", action="store_true", help="print the entries as JSON")
    p.set_defaults(handler=run_surface)


def run_surface(args: argparse.Namespace) -> int:
    from kimi_eagle.exit_status import fail

    try:
        tree = SourceTree.release(args.version) if args.version else SourceTree.installed()
    except SourceUnavailableError as exc:
        return fail("vllm-surface", str(exc))
    reports = surface_report(tree)
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=1))
    text = render(tree.version, reports)
    if args.out:
        args.out.write_text(text)
        print(f"kimi-eagle vllm-surface: {args.out}", file=sys.stderr)
    elif not args.json:
        print(text)
    return 0
