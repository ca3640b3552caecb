"""The acceptance alarm and the draft fail-safe on a real engine serving a draft that matches nothing: a random
draft of the right shape. The alarm goes off in the API server; the engine stops drafting, answers as the target
alone, says so on /metrics, and tries the draft again later (`adapter/draft_bypass.py`)."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
from openai import OpenAI

from kimi_eagle import envs
from kimi_eagle.bench.bypass import random_draft
from kimi_eagle.fixtures.pair_spec import DRAFT_DIR
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.request_options import OPTIONS, Answer, Option, check_option_kept
from tests.helpers.server import EXACT_PROFILE, Server, greedy_ids, metric_value

# The tests use the module's random-draft server and the shared plain server: one worker for all of them.
pytestmark = [pytest.mark.e2e, pytest.mark.xdist_group("exact")]

RETRY_S = 30  # long enough for every request option to reach the bypassed engine before the first retry (about
# 10 s in all in CI, on one core); the retry test waits out the rest
BYPASSED = "kimi_eagle:draft_bypassed"
DRAFTS = "vllm:spec_decode_num_drafts_total"


@pytest.fixture(scope="module")
def random_draft_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("random-draft")
    draft = random_draft(DRAFT_DIR, tmp / "draft")  # the one `bench bypass` serves
    command = build_command(load_profile(EXACT_PROFILE), draft=str(draft), port=free_port())
    command.env[envs.BYPASS_RETRY_S.name] = str(RETRY_S)
    log = tmp / "server.log"
    with running_server(command, log_path=log, timeout_s=600) as ready_s:
        yield Server(url=command.url, model=command.served_model_name, log=log, ready_s=ready_s)


def load(server: Server, prompts: int = 8, max_tokens: int = 64) -> None:
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)
    client.completions.create(model=server.model, prompt=["The file", "A value"] * (prompts // 2),
                              max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})


def test_a_random_draft_raises_the_alarm_and_the_engine_stops_drafting(random_draft_server: Server,
                                                                      plain_server: Server) -> None:
    target_alone = greedy_ids(plain_server.url, plain_server.model, max_tokens=48)
    assert metric_value(random_draft_server.url, BYPASSED) == 0.0
    load(random_draft_server)
    assert metric_value(random_draft_server.url, "kimi_eagle:spec_decode_acceptance_collapsed") == 1.0
    assert metric_value(random_draft_server.url, BYPASSED) == 1.0
    log = random_draft_server.log.read_text()
    assert "ACCEPTANCE COLLAPSE" in log
    bypass_lines = [line for line in log.splitlines() if "DRAFT BYPASSED" in line]
    assert len(bypass_lines) == 1 and "EngineCore" in bypass_lines[0]  # decided where the scheduler runs
    assert re.search(r"0 of \d+ drafted tokens accepted .* over the last 2\d\d drafts", bypass_lines[0])
    assert "kimi-eagle doctor" in bypass_lines[0]
    assert "steps that schedule no draft tokens now run as the target alone's" in log

    # Bypassed: no draft runs, and the output is the target's own (float32: token for token).
    drafts = metric_value(random_draft_server.url, DRAFTS)
    assert greedy_ids(random_draft_server.url, random_draft_server.model, max_tokens=48) == target_alone
    load(random_draft_server, prompts=4, max_tokens=32)
    assert metric_value(random_draft_server.url, DRAFTS) == drafts


@pytest.fixture(scope="module")
def greedy_answers() -> dict[tuple[str, str], Answer]:
    return {}


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_every_request_option_is_kept_while_bypassed(random_draft_server: Server, plain_server: Server,
                                                      option: Option, greedy_answers: dict) -> None:
    """A bypassed step runs as the target alone's (no spec-decode metadata, the plain sampler): every option a client
    sends gets the target alone's answer (float32: token for token where sampling does not decide)."""
    while metric_value(random_draft_server.url, BYPASSED) != 1.0:  # run alone: trip the fail-safe first
        load(random_draft_server)
    check_option_kept(option, random_draft_server.url, plain_server.url, plain_server.model, greedy_answers)
    assert "retrying the draft" not in random_draft_server.log.read_text(), \
        f"the draft was retried within {RETRY_S} s of the bypass: this test no longer sees a bypassed engine"


def test_the_bypassed_draft_is_retried_on_new_requests_and_stays_bypassed(random_draft_server: Server) -> None:
    load(random_draft_server)
    drafts = metric_value(random_draft_server.url, DRAFTS)
    # New requests until the retry (RETRY_S after the bypass) has judged a window of their drafts.
    deadline = time.monotonic() + RETRY_S + 90
    while "still bypassed" not in random_draft_server.log.read_text() and time.monotonic() < deadline:
        load(random_draft_server)
    log = random_draft_server.log.read_text()
    assert "retrying the draft on the next 200 drafts of new requests" in log
    assert re.search(r"the retry accepted 0\.0% of drafted tokens over 2\d\d drafts: still bypassed", log)
    assert log.count("DRAFT BYPASSED") == 1  # the failed retry is not a second alarm
    assert metric_value(random_draft_server.url, DRAFTS) >= drafts + 200
    load(random_draft_server, prompts=2, max_tokens=8)
    assert metric_value(random_draft_server.url, BYPASSED) == 1.0
