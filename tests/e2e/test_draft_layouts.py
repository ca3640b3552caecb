"""Published draft layouts served as they are on disk: the same weights give the same acceptance and output, and the
MLA and EAGLE-3.1 drafts serve at their own acceptance with the target's output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_eagle.bench.client import BenchClient
from kimi_eagle.bench.startup import LOADED_MARK
from kimi_eagle.checks.layout import draft_spec
from kimi_eagle.fixtures.pair_spec import EAGLE31_DRAFT_DIR, HELDOUT_PROMPTS_FILE, MLA_DRAFT_DIR
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import ServerStartError, running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers import broken_drafts as bd
from tests.helpers.server import EXACT_PROFILE, Server

pytestmark = pytest.mark.e2e
MAX_TOKENS = 48
LAYOUT_TOKENS = 128  # as the shipped draft's acceptance is measured (README)


def test_a_specforge_layout_copy_of_the_draft_serves_at_the_same_acceptance(spec_server: Server,
                                                                            tmp_path: Path) -> None:
    draft = bd.specforge_copy(tmp_path / "specforge")
    spec = draft_spec(json.loads((draft / "config.json").read_text()))
    assert spec.format != "speculators" and spec.top_level_ids is None and spec.eagle_config_ids == [2, 4, 6]
    prompts = json.loads(HELDOUT_PROMPTS_FILE.read_text())[:4]
    reference = BenchClient(spec_server.url, spec_server.model, MAX_TOKENS).measure(
        prompts, 1, len(prompts), with_acceptance=True)
    command = build_command(load_profile(EXACT_PROFILE), draft=str(draft), port=free_port())
    with running_server(command, log_path=tmp_path / "specforge.log", timeout_s=600):
        served = BenchClient(command.url, command.served_model_name, MAX_TOKENS).measure(
            prompts, 1, len(prompts), with_acceptance=True)
    log = (tmp_path / "specforge.log").read_text()
    assert "Using auxiliary layers from speculative config: (2, 4, 6)" in log or "aux layers [2, 4, 6]" in log
    # The target's graph is the one traced beside the shipped draft (the session's server): a new draft folder with
    # the same capture does not trace the target again (`adapter/compile_cache.py`).
    assert LOADED_MARK in log, "the target's graph was traced again for a draft that captures the same layers"
    print(f"\nspeculators layout: mean acceptance length {reference.acceptance.mean_acceptance_length:.3f}; "
          f"SpecForge layout: {served.acceptance.mean_acceptance_length:.3f}")
    assert served.token_ids == reference.token_ids  # float32, greedy: the target's own output either way
    assert served.acceptance.mean_acceptance_length == pytest.approx(reference.acceptance.mean_acceptance_length,
                                                                     abs=1e-9)
    assert served.acceptance.mean_acceptance_length > 2.0


def _serve_and_measure(draft: Path, tmp_path: Path, prompts: list[str]) -> tuple[object, str, float]:
    command = build_command(load_profile(EXACT_PROFILE), draft=str(draft), port=free_port())
    log = tmp_path / f"{draft.name}.log"
    with running_server(command, log_path=log, timeout_s=600) as ready_s:
        served = BenchClient(command.url, command.served_model_name, LAYOUT_TOKENS).measure(
            prompts, 1, len(prompts), with_acceptance=True)
    return served, log.read_text(), ready_s


@pytest.fixture(scope="module")
def target_alone_token_ids(plain_server: Server) -> list[list[int]]:
    """The target alone's greedy output on the held-out prompts: what every layout's output is held to."""
    prompts = json.loads(HELDOUT_PROMPTS_FILE.read_text())
    return BenchClient(plain_server.url, plain_server.model, LAYOUT_TOKENS).measure(prompts, 1, len(prompts)).token_ids


@pytest.mark.parametrize("draft", [MLA_DRAFT_DIR, EAGLE31_DRAFT_DIR], ids=["mla", "eagle3.1"])
def test_each_published_layout_serves_as_it_is_on_disk(draft: Path, target_alone_token_ids: list[list[int]],
                                                       tmp_path: Path) -> None:
    """The MLA draft through vLLM's `Eagle3DeepseekV2ForCausalLM`, the EAGLE-3.1 draft with its flags honoured
    (vLLM would stop at load on `fc_norm.*` were the flag ignored): the target's own greedy output, and the
    acceptance the issue asks for, on held-out prompts."""
    prompts = json.loads(HELDOUT_PROMPTS_FILE.read_text())
    served, log, ready_s = _serve_and_measure(draft, tmp_path, prompts)
    acceptance = served.acceptance
    print(f"\n{draft.name}: ready in {ready_s:.0f} s; mean acceptance length {acceptance.mean_acceptance_length:.3f} "
          f"(per position {', '.join(f'{p:.3f}' for p in acceptance.per_position_acceptance_rate)}) over "
          f"{len(prompts)} held-out prompts x {LAYOUT_TOKENS} tokens, k=3, T=0")
    assert "draft guards active: aux layers [2, 4, 6]" in log and "first draft step checked" in log
    assert served.token_ids == target_alone_token_ids  # float32, greedy
    assert acceptance.mean_acceptance_length >= 2.5
    if draft == MLA_DRAFT_DIR:
        assert "the MLA draft uses the target's attention backend CPU_MLA" in log


@pytest.mark.parametrize(("fault", "env", "expected"), [
    ("mla_norm_before_fc", {}, "[option-ignored]"),  # vLLM's MLA class would skip the norm without a word
    ("mla_no_kv_b", {"KIMI_EAGLE_STATIC_CHECKS": "0"}, "unfilled"),  # the load-time sentinel covers the MLA class
])
def test_mla_faults_are_refused_inside_vllm(fault: str, env: dict[str, str], expected: str, tmp_path: Path) -> None:
    command = build_command(load_profile(EXACT_PROFILE), draft=str(bd.build(fault, tmp_path)), port=free_port())
    command.env.update(env)
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError), running_server(command, log_path=log, timeout_s=600):
        pass
    text = log.read_text()
    assert "DraftRefusedError" in text and expected in text
