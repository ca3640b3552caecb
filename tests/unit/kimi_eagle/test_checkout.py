"""The checkout carries every file it reads: a clone has no folder beside it, and no machine has our paths."""


from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.cli import REPO

# A folder beside the checkout (where the shared notes live), an absolute path of the machine the project was written
# on, or a climb out of the checkout by counting folders up from a file.
OUTSIDE = re.compile(r"\.\./shared|/work/|/root/|parents\[[2-9]\]")


def tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [REPO / n for n in names.decode().split("\0") if n and (REPO / n).exists()]  # not deleted since


def test_no_tracked_text_names_a_path_outside_the_checkout() -> None:
    found = []
    for path in tracked_files():
        if path.suffix in {".safetensors", ".png"} or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group()}"
                  for m in OUTSIDE.finditer(text) if path.name != "test_checkout.py"]
    assert not found, "paths outside the checkout:\n" + "\n".join(found)


def test_the_sglang_recordings_the_tests_read_are_in_the_checkout() -> None:
    from tests.conftest import RECORDINGS_DIR

    assert RECORDINGS_DIR.is_relative_to(REPO)
    index = RECORDINGS_DIR / "index.json"
    assert index in tracked_files(), "the recordings must be committed, not only present here"


def test_every_data_file_the_tests_read_is_committed() -> None:
    """A file a .gitignore pattern catches (`*.log`) is there in the checkout it was written in, and nowhere else."""
    data = REPO / "tests" / "data"
    tracked = set(tracked_files())
    untracked = [str(p.relative_to(REPO)) for p in data.rglob("*") if p.is_file() and p not in tracked]
    assert not untracked, f"not committed (ignored?): {untracked}"


def test_everything_is_imported_under_the_one_installed_package() -> None:
    """`pip install -e .` installs `kimi_eagle` alone (adapter/, serve/, ... are its subpackages): a bare `import serve`
    works only from the checkout's root, where the tests run, and nowhere vLLM's processes do."""
    import ast

    parts = {"adapter", "serve", "loadtest", "doctor", "bench", "fixtures"}
    bare = []
    for path in tracked_files():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            bare += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in parts]
    assert not bare, "import these as kimi_eagle.<part>:\n" + "\n".join(bare)


def test_the_installed_distribution_has_one_top_level_package_and_the_plugin_under_it() -> None:
    from importlib.metadata import distribution

    dist = distribution("kimi-eagle")
    plugins = [e for e in dist.entry_points if e.group == "vllm.general_plugins"]
    assert [e.value for e in plugins] == ["kimi_eagle.adapter.plugin:register"]
    assert (dist.read_text("top_level.txt") or "").split() == ["kimi_eagle"]

