"""The parts of the project import each other one way only, read from the source with `ast` (every import, those inside
functions and those `kimi-eagle` makes by name included): no part imports another that imports it back; `loadtest`
talks HTTP and never imports vLLM; the static checks (`kimi_eagle/checks`) need neither vLLM nor the plugin."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

from kimi_eagle.cli import SUBCOMMAND_MODULES
from tests.helpers.cli import REPO

PARTS = ("adapter", "serve", "doctor", "fixtures", "bench", "loadtest")  # installed as kimi_eagle.<part>
ENTRY_POINT = "kimi_eagle.cli"  # the `kimi-eagle` program: above every part, imported by none


def part_of_module(module: str) -> str | None:
    """The part a module belongs to: a folder of PARTS, `checks`, `cli` (the program), `core` (kimi_eagle's own
    modules), or None outside the project."""
    names = module.split(".")
    if names[0] != "kimi_eagle":
        return None
    if module == ENTRY_POINT:
        return "cli"
    if len(names) > 1 and (names[1] in PARTS or names[1] == "checks"):
        return names[1]
    return "core"


def module_of_file(path: Path) -> str:
    relative = path.relative_to(REPO).with_suffix("")
    names = list(relative.parts)
    if names[-1] == "__init__":
        names.pop()
    return ".".join(names if names[0] == "kimi_eagle" else ["kimi_eagle", *names])


def source_files() -> Iterator[Path]:
    for folder in (*PARTS, "kimi_eagle"):
        yield from sorted((REPO / folder).rglob("*.py"))


def imported_modules(path: Path) -> Iterator[tuple[str, int]]:
    """(module, line) for every import of a file, wherever it is in the file, relative ones resolved; and the
    subcommand modules `kimi-eagle` imports by name."""
    package = module_of_file(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_of_file(path)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            yield base, node.lineno
            for alias in node.names:  # `from kimi_eagle import envs` imports the module kimi_eagle.envs
                yield f"{base}.{alias.name}", node.lineno
    if module_of_file(path) == ENTRY_POINT:
        for module in SUBCOMMAND_MODULES:
            yield module, 0


def part_graph() -> dict[str, dict[str, list[str]]]:
    """part -> part it imports -> where ("file:line module")."""
    graph: dict[str, dict[str, list[str]]] = {}
    for path in source_files():
        source = part_of_module(module_of_file(path))
        for module, line in imported_modules(path):
            target = part_of_module(module)
            if target and target != source:
                graph.setdefault(source, {}).setdefault(target, []).append(
                    f"{path.relative_to(REPO)}:{line} imports {module}")
    return graph


def find_cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """A path of parts that comes back to its start, or None."""
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in graph.get(node, {}):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt] if nxt in path else [*path, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_part_imports_a_part_that_imports_it_back() -> None:
    graph = part_graph()
    cycle = find_cycle(graph)
    where = [f"{a} -> {b}: {graph[a][b][0]}" for a, b in pairwise(cycle)] if cycle else []
    assert cycle is None, "import cycle between parts:\n" + "\n".join(where)


def test_the_graph_sees_the_imports_the_program_makes_by_name() -> None:
    """The check above would pass on a graph that missed edges: it holds the ones known to be there."""
    graph = part_graph()
    assert {"serve", "doctor", "loadtest", "bench"} <= set(graph["cli"])
    assert "checks" in graph["adapter"] and "checks" in graph["doctor"] and "core" in graph["serve"]
    assert not any("cli" in targets for targets in graph.values()), "a part imports the kimi-eagle program itself"


def _module_level_imports(path: Path) -> Iterator[str]:
    """The imports a module runs when it is imported (not those inside functions)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        blocks = [node] if not isinstance(node, ast.If | ast.Try) else [*node.body, *getattr(node, "orelse", [])]
        for statement in blocks:
            if isinstance(statement, ast.Import):
                yield from (alias.name for alias in statement.names)
            elif isinstance(statement, ast.ImportFrom) and statement.module and not statement.level:
                yield statement.module
                yield from (f"{statement.module}.{alias.name}" for alias in statement.names)


def _imports_vllm(paths: list[Path], *, transitively: bool) -> list[str]:
    """Where these files import vLLM: anywhere in them, and (`transitively`) through the project modules they
    import when imported."""
    files = {module_of_file(p): p for p in source_files()}
    found, seen, todo = [], set(), list(paths)
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        direct = imported_modules(path) if path in paths else ((m, 0) for m in _module_level_imports(path))
        for module, line in direct:
            if module == "vllm" or module.startswith("vllm."):
                found.append(f"{path.relative_to(REPO)}:{line} imports {module}")
            elif transitively and module in files:
                todo.append(files[module])
    return found


def test_loadtest_never_imports_vllm() -> None:
    loadtest = sorted((REPO / "loadtest").rglob("*.py"))
    assert loadtest
    assert _imports_vllm(loadtest, transitively=True) == []


def test_the_checks_import_neither_vllm_nor_the_plugin() -> None:
    checks = sorted((REPO / "kimi_eagle" / "checks").rglob("*.py"))
    assert _imports_vllm(checks, transitively=True) == []
    graph = part_graph()
    assert "adapter" not in graph.get("checks", {}), graph["checks"]["adapter"]
    assert set(graph.get("checks", {})) <= {"core"}


def test_a_vllm_import_is_seen() -> None:
    """The two checks above would pass on a reader that saw nothing: the plugin, which runs inside vLLM, imports it."""
    assert _imports_vllm(sorted((REPO / "adapter").rglob("*.py")), transitively=False)
