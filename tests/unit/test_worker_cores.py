"""The suite's core split (tests/helpers/worker_cores.py) under a real pytest-xdist run in which a worker crashes:
the crash costs that one test, and the worker xdist starts in its place gets cores, the ones the dead worker left."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.cli import REPO
from tests.helpers.worker_cores import share

WORKERS = 2
TESTS = 16

CONFTEST = """
from tests.helpers.worker_cores import give_this_worker_cores_of_its_own, remove_slots

def pytest_configure(config):
    give_this_worker_cores_of_its_own()

def pytest_unconfigure(config):
    remove_slots()
"""

TESTS_FILE = """
import json, os, signal, time
from pathlib import Path

import pytest

RECORDS = Path(os.environ["CORES_RECORDS"])


def record():
    line = {"worker": os.environ["PYTEST_XDIST_WORKER"], "cpus": sorted(os.sched_getaffinity(0))}
    with open(RECORDS / f"{os.getpid()}.jsonl", "a") as f:
        f.write(json.dumps(line) + "\\n")
    crashed = RECORDS / "crashed"
    # The first test on gw1, not gw0, ends its worker: the replacement then needs a share that is not the first.
    if line["worker"] == "gw1" and not crashed.exists():
        crashed.touch()
        os.kill(os.getpid(), signal.SIGKILL)  # as an illegal instruction ends a worker: no Python on the way out


@pytest.mark.parametrize("n", range({tests}))
def test_record_my_cores(n):
    record()
    time.sleep(0.3)
"""


def _all_cpus() -> set[int]:
    """The CPUs `make test` starts with: this worker's parent's, the xdist controller, which binds nothing (this
    worker is bound to its own share of them)."""
    try:
        return os.sched_getaffinity(os.getppid())
    except OSError:
        return os.sched_getaffinity(0)


def test_shares_cover_the_cpus_once() -> None:
    cpus = [0, 1, 2, 3, 4]
    shares = [share(cpus, slot, 2) for slot in range(2)]
    assert shares == [[0, 1], [2, 3, 4]]


def test_a_worker_that_replaces_a_crashed_one_gets_the_cores_it_left(tmp_path: Path) -> None:
    cpus = _all_cpus()
    if len(cpus) < WORKERS:
        pytest.skip(f"the split needs {WORKERS} CPUs, this machine lets a process use {len(cpus)}")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_crash.py").write_text(textwrap.dedent(TESTS_FILE.replace("{tests}", str(TESTS))))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder is the inner run's root, not the checkout
    records = tmp_path / "records"
    records.mkdir()
    env = {**os.environ, "CORES_RECORDS": str(records), "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_ADDOPTS"):
        env.pop(name, None)  # this test's own worker's, which the inner controller must not take for its own
    # The inner run on every CPU, as `make test` starts (this worker is bound to a share of them), for seconds.
    done = subprocess.run([sys.executable, "-m", "pytest", "-n", str(WORKERS), "--dist", "loadgroup",
                           "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    output = done.stdout + done.stderr
    assert "INTERNALERROR" not in output, output[-3000:]
    assert re.search(r"replacing crashed worker gw1", output), output[-3000:]
    # xdist reports the test its worker died in as failed, and runs the rest (that one again, on the replacement)
    summary = re.search(r"(\d+) failed, (\d+) passed in", output.strip().splitlines()[-1])
    assert summary and int(summary[1]) == 1 and int(summary[2]) >= TESTS - 1, output[-3000:]
    seen: dict[str, set[tuple[int, ...]]] = {}
    for path in records.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            seen.setdefault(entry["worker"], set()).add(tuple(entry["cpus"]))
    assert {"gw0", "gw1", "gw2"} <= set(seen), seen
    assert all(len(affinities) == 1 for affinities in seen.values()), seen  # one share a worker, kept
    (gw0,), (gw1,), (gw2,) = seen["gw0"], seen["gw1"], seen["gw2"]
    assert gw2 and not set(gw2) & set(gw0), f"the replacement must have cores of its own: {seen}"
    assert gw2 == gw1, f"the replacement takes the share the crashed worker left: {seen}"
    assert set(gw0) | set(gw2) == cpus
