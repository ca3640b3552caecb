"""Shared fixtures. Real vLLM servers are started once per session and shared by every test that needs one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kimi_eagle.processes import collect_garbage_less_often, free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.server import DEFAULT_PROFILE, EXACT_PROFILE, Server
from tests.helpers.worker_cores import give_this_worker_cores_of_its_own, remove_slots

# Real responses of a real SGLang 0.5.23 server (its README says how they were recorded), carried by the project.
RECORDINGS_DIR = Path(__file__).resolve().parent / "data" / "sglang-0.5.23-cpu"


# `make test` runs the suite on two pytest-xdist workers (`--dist loadgroup`). The tests of one set of shared servers
# go to one worker, so that each of those servers starts once in the session and memory holds one copy of each: a
# test's group is named by the shared servers it uses. A module whose tests share a server of its own names its group
# (`pytestmark`), and a test that picks its servers by parameter marks each parameter.
SERVER_GROUPS = {"spec_server": "exact", "plain_server": "exact",
                 "default_server": "default", "default_plain_server": "default"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns each test's group into its node id's suffix
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        groups = {SERVER_GROUPS[name] for name in getattr(item, "fixturenames", ()) if name in SERVER_GROUPS}
        marked = item.get_closest_marker("xdist_group")
        if len(groups) > 1 or (marked and groups and {marked.args[0]} != groups):
            named = [marked.args[0]] if marked else []
            raise pytest.UsageError(f"{item.nodeid} needs the shared servers of {sorted(groups)}, marked {named}: "
                                    "one worker must hold all the servers of a test")
        if groups and not marked:
            item.add_marker(pytest.mark.xdist_group(groups.pop()))
    items.sort(key=_longest_first)


def _longest_first(item: pytest.Item) -> int:
    """The order xdist hands the tests' scopes to the workers (`make test` passes --no-loadscope-reorder): by its
    default, most tests first, the suite's longest scopes came last (vLLM's own tests, 1 test and 150 s; the quick
    benchmarks, 5 tests and 320 s) and one worker ran them while the other sat idle. The shared servers' groups first,
    then the other folders that start servers or long runs, then the unit tests to fill in; collection order within."""
    marked = item.get_closest_marker("xdist_group")
    return scope_rank(marked.args[0] if marked else None, item.path.relative_to(item.config.rootpath))


def scope_rank(group: str | None, path: Path) -> int:
    if group in SERVER_GROUPS.values():
        return 0
    return 1 if {"e2e", "upstream"} & set(path.parts) else 2


def pytest_configure(config: pytest.Config) -> None:
    give_this_worker_cores_of_its_own()  # a worker that replaces a crashed one too
    collect_garbage_less_often()  # the tests import torch and vLLM too, as the processes they start do
    _refuse_loadgroup_under_pytest_9(config)


def pytest_report_header(config: pytest.Config) -> str | None:
    """The ISA and the kernel build the suite ran on: a figure or a CPU fix tested here may be that ISA's."""
    from kimi_eagle.cpu_kernels import kernel_report

    machine = kernel_report()
    return f"kimi-eagle: {machine.line()}" if machine else None


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """A test's `record_property("report", ...)`, in the summary: what it measured, also when it passed (xdist
    carries a report's properties from its worker)."""
    for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []):
        for name, value in getattr(report, "user_properties", ()):
            if name == "report" and report.when == "call":
                terminalreporter.write_sep("-", report.nodeid)
                terminalreporter.write_line(str(value))


def pytest_unconfigure(config: pytest.Config) -> None:
    remove_slots()


def _refuse_loadgroup_under_pytest_9(config: pytest.Config) -> None:
    """pytest-xdist 3.8 groups tests by renaming each test's `_nodeid`, which pytest 9 no longer reads (its node id is
    built from `Node._id`): there `--dist loadgroup` would spread the tests of one server over both workers, each
    starting its own copy, without a word. pyproject.toml pins pytest 8."""
    if config.getoption("dist", "no") == "loadgroup" and pytest.version_tuple >= (9,):
        raise pytest.UsageError(f"--dist loadgroup does not group tests under pytest {pytest.__version__} with "
                                "pytest-xdist 3.8 (pytest 9 ignores the node ids it writes): install pytest 8 "
                                "(`make setup` does) or run without -n")


def _serve(tmp_dir: Path, name: str, env: dict[str, str] | None = None, profile: str = EXACT_PROFILE,
           **overrides) -> Iterator[Server]:
    command = build_command(load_profile(profile), port=free_port(), **overrides)
    command.env.update(env or {})
    log = tmp_dir / f"{name}.log"
    with running_server(command, log_path=log, timeout_s=600) as ready_s:
        yield Server(url=command.url, model=command.served_model_name, log=log, ready_s=ready_s)


@pytest.fixture(scope="session")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The exactness profile: tiny Kimi-K2.5 target + trained EAGLE-3 draft, k=3, float32."""
    yield from _serve(tmp_path_factory.mktemp("spec"), "spec")


@pytest.fixture(scope="session")
def plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same target without speculation."""
    yield from _serve(tmp_path_factory.mktemp("plain"), "plain", no_draft=True)


@pytest.fixture(scope="session")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default profile as `make serve` starts it: bfloat16, k=4 with its schedule, the draft fail-safe on."""
    yield from _serve(tmp_path_factory.mktemp("default"), "default", profile=DEFAULT_PROFILE)


@pytest.fixture(scope="session")
def default_plain_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default profile's target alone (`kimi-eagle serve tiny-cpu --no-draft`)."""
    yield from _serve(tmp_path_factory.mktemp("default-plain"), "default-plain", profile=DEFAULT_PROFILE,
                      no_draft=True)


@pytest.fixture(scope="session")
def sglang_recordings() -> Path:
    if not RECORDINGS_DIR.is_dir():
        pytest.fail(f"the SGLang recordings are missing: expected {RECORDINGS_DIR} (part of the checkout)")
    return RECORDINGS_DIR
