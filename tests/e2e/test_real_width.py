"""The pair at Kimi-K2.5's real widths (`real-width-cpu`: hidden 7168, 64 MLA heads of 128 + 64, vocabulary 163840,
draft fc 21504 -> 7168), served by vLLM: the first-step check sees 21504 = 3 x 7168, speculation leaves the greedy
answer the target's own, the lifted pair answers and accepts as the tiny pair does, and the seed's failure at these
widths (the target capturing one 7168-wide layer where the draft's fc takes three) is refused by name.

`make test-real-width` (not `make test`: each server holds about 15 GiB, one at a time, and starts in minutes). The
pair is built on first use (`kimi-eagle fixtures --real-width`, about 13 GB under ~/.cache/kimi-eagle)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from kimi_eagle.fixtures.pair_spec import HELDOUT_PROMPTS_FILE
from kimi_eagle.fixtures.real_width import RealWidthPair, ensure_built
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import ServerStartError, running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.server import engine_gauges, server_rss_bytes

pytestmark = pytest.mark.real_width

PROFILE = "real-width-cpu"
TINY_PROFILE = "tiny-cpu"  # the same pair at its own widths, bfloat16, k = 4 as real-width-cpu
PROMPTS = json.loads(HELDOUT_PROMPTS_FILE.read_text())[:4]  # documents the draft never saw
MAX_TOKENS = 32
START_TIMEOUT_S = 1200
GIB = 1 << 30


@dataclass(frozen=True)
class Run:
    """One server's greedy answers to PROMPTS and what it showed doing so."""

    answers: list[list[int]]
    acceptance_length: float | None  # 1 + accepted / drafts, vLLM's counters; None without a draft
    ready_s: float
    rss_gib: float
    log: str


def _greedy(url: str, model: str) -> list[list[int]]:
    r = requests.post(f"{url}/v1/completions", timeout=1800, json={
        "model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text[:500]
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _serve_and_ask(tmp_path: Path, name: str, profile: str = PROFILE, **overrides) -> Run:
    command = build_command(load_profile(profile), port=free_port(), **overrides)
    command.env["KIMI_EAGLE_MEASURED_K"] = "0"  # k = 4 on both pairs, whatever their steps cost here
    log = tmp_path / f"{name}.log"
    with running_server(command, log_path=log, timeout_s=START_TIMEOUT_S) as ready_s:
        answers = _greedy(command.url, command.served_model_name)
        gauges = engine_gauges(command.url)
        rss = server_rss_bytes(command.url) / GIB
    drafts = gauges["vllm:spec_decode_num_drafts_total"]
    acceptance = 1 + gauges["vllm:spec_decode_num_accepted_tokens_total"] / drafts if drafts else None
    return Run(answers, acceptance, ready_s, rss, log.read_text(errors="replace"))


@pytest.fixture(scope="module")
def pair() -> RealWidthPair:
    return ensure_built()


@pytest.fixture(scope="module")
def runs(pair: RealWidthPair, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The real-width pair with its draft and without, then the tiny pair: one server at a time."""
    tmp = tmp_path_factory.mktemp("real-width")
    return {"draft": _serve_and_ask(tmp, "draft"), "plain": _serve_and_ask(tmp, "plain", no_draft=True),
            "tiny": _serve_and_ask(tmp, "tiny", profile=TINY_PROFILE)}


def test_the_first_step_check_sees_three_real_width_layers(runs: dict[str, Run], record_property) -> None:
    log = runs["draft"].log
    assert "first draft step checked: fc received 21504 = 3 x 7168 (aux layers [2, 4, 6])" in log
    assert "draft guards active: aux layers [2, 4, 6], fc 21504 -> 7168" in log
    record_property("report", "\n".join(
        f"{name}: ready in {run.ready_s:.0f} s, RSS {run.rss_gib:.1f} GiB, acceptance length "
        f"{run.acceptance_length if run.acceptance_length is None else round(run.acceptance_length, 2)}"
        for name, run in runs.items()))


def test_speculation_leaves_the_greedy_answer_the_targets_own(runs: dict[str, Run]) -> None:
    """T = 0 with the draft (its verification on the MLA decode kernel with 64 heads of 128 + 64) == --no-draft."""
    assert runs["draft"].answers == runs["plain"].answers


def test_the_lifted_pair_answers_and_accepts_as_the_tiny_pair(runs: dict[str, Run]) -> None:
    """Lifted from the tiny pair by zero padding: the same tokens (none of the 159,744 padded ones), and about the
    tiny pair's acceptance: the draft reads the three layers it was trained on, at their real width."""
    draft, tiny = runs["draft"], runs["tiny"]
    assert draft.answers == tiny.answers
    assert all(token < 4096 for answer in draft.answers for token in answer)
    assert draft.acceptance_length is not None and tiny.acceptance_length is not None
    assert draft.acceptance_length >= 2.0, f"acceptance length {draft.acceptance_length:.2f}: the draft is not helping"
    assert abs(draft.acceptance_length - tiny.acceptance_length) <= 0.15 * tiny.acceptance_length, (
        f"acceptance length {draft.acceptance_length:.2f} at real width against {tiny.acceptance_length:.2f} tiny")


def test_the_seeds_failure_at_real_width_is_refused_by_name(pair: RealWidthPair, tmp_path: Path) -> None:
    """The target capturing only the last of the three aux layers (the SGLang Kimi-K2.5 failure): one 7168-wide layer
    reaches an fc sized for 21504, a shape check comparing 7168 with the draft's hidden 7168 would pass it; the
    first draft step refuses it. Eager: the crippled capture would be compiled for this one start."""
    command = build_command(load_profile(PROFILE), port=free_port(), extra_args=["--enforce-eager"])
    command.env["KIMI_EAGLE_FAULT"] = "aux-single-layer"
    log = tmp_path / "fault.log"
    with running_server(command, log_path=log, timeout_s=START_TIMEOUT_S):
        started = time.monotonic()
        with pytest.raises((requests.RequestException, AssertionError, ServerStartError)):
            r = requests.post(f"{command.url}/v1/completions", timeout=600, json={
                "model": command.served_model_name, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text[:300]  # the engine dies: a 5xx or a dropped connection
        assert time.monotonic() - started < 600
    text = log.read_text(errors="replace")
    assert ("the draft's fc expects 21504 = 3 aux layers [2, 4, 6] x hidden 7168, but the target sent 7168 "
            "(1 layer(s))") in text, text[-3000:]
    assert "first draft step checked" not in text
