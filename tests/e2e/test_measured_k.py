"""The measured k in a real engine: the default profile on a machine where drafting costs (the `slow-draft` fault adds
15 ms per draft token to each draft pass, a stand-in for a slow CPU or a draft too large for its target), served with
k = 4 at every batch size (a k the profile's schedule would not pick there). The engine must measure that a smaller k
(the target alone, k = 0, by far) is faster, switch to it and say so in its log, and keep serving the target alone's
greedy answers. Probes take up to 30% of the steps here, to switch within a test's time (5% by default). The
controller's choices on a simulated engine (probe share, noise and drift, ranges with too few probes):
tests/unit/adapter/test_measured_k.py.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kimi_eagle import envs
from kimi_eagle.loadtest.engines import VllmReader, measured_k
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.server import DEFAULT_PROFILE, Server, greedy_ids

pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("default")]

SWITCH_TIMEOUT_S = 240
SWITCH = re.compile(r"measured k: (?P<range>[\d-]+) in flight: k 4 -> (?P<k>\d+) \((?P<why>[^)]*)\)")


@pytest.fixture(scope="module")
def slow_draft_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    profile = load_profile(DEFAULT_PROFILE)
    profile = profile.model_copy(update={"speculative": profile.speculative.model_copy(
        update={"num_speculative_tokens_per_batch_size": [(1, 16, 4)]})})
    command = build_command(profile, port=free_port())
    command.env |= {envs.FAULT.name: "slow-draft", envs.MEASURED_K.name: "1", envs.MEASURED_K_PROBE_SHARE.name: "0.3"}
    log = tmp_path_factory.mktemp("measured-k") / "slow-draft.log"
    with running_server(command, log_path=log, timeout_s=600) as ready_s:
        yield Server(url=command.url, model=command.served_model_name, log=log, ready_s=ready_s)


def _generate(server: Server, i: int) -> None:
    r = requests.post(f"{server.url}/v1/completions", json={
        "model": server.model, "prompt": f"The history of the river number {i}", "max_tokens": 48,
        "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text[:300]


def test_the_engine_stops_drafting_where_drafting_costs(slow_draft_server: Server,
                                                        default_plain_server: Server) -> None:
    log = slow_draft_server.log
    assert "measured k on: per range of batch sizes (1, 2, 3-4, 5-8, 9-16)" in log.read_text()
    started, switch, i = time.monotonic(), None, 0
    with ThreadPoolExecutor(max_workers=2) as pool:  # two streams: batch size 2 most of the time
        while switch is None and time.monotonic() - started < SWITCH_TIMEOUT_S:
            list(pool.map(lambda n: _generate(slow_draft_server, n), range(i, i + 2)))
            i += 2
            switch = SWITCH.search(log.read_text())
    assert switch, f"no switch in {SWITCH_TIMEOUT_S} s of 2 streams ({i} requests): {log.read_text()[-3000:]}"
    assert switch["k"] in {"0", "1", "2"} and "paired probes" in switch["why"], switch.group(0)
    assert greedy_ids(slow_draft_server.url, slow_draft_server.model) == greedy_ids(default_plain_server.url,
                                                                                    default_plain_server.model)
    # /metrics (the API server's process) shows what the engine core chose, and the measurement behind it, as
    # `kimi-eagle loadtest` reads it.
    ranges = {r.batch_sizes: r for r in measured_k(VllmReader(slow_draft_server.url).snapshot()) or []}
    assert set(ranges) == {"1", "2", "3-4", "5-8", "9-16"}, ranges
    chosen = ranges[switch["range"]]
    assert chosen.k == int(switch["k"]) and chosen.configured == 4 and chosen.steps and chosen.steps > 0, chosen
    assert 4 in chosen.speed_ratio or not chosen.speed_ratio, chosen  # measured against the new k, or not yet
    # Never that many in flight, so never measured: it takes no more k than the measured range below it.
    assert ranges["9-16"].k < 4 and not ranges["9-16"].steps, ranges["9-16"]
    assert re.search(r"measured k: 9-16 in flight: k 4 -> \d \(too few probes of its own yet; [\d-]+ in flight "
                     r"measured k=\d, and k does not grow with the batch size\)", log.read_text())
