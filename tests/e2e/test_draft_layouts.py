"""Published draft layouts served as they are on disk: the same weights give the same acceptance and output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_eagle.adapter.checks.layout import draft_spec
from kimi_eagle.bench.client import BenchClient
from kimi_eagle.fixtures.build_draft import HELDOUT_PROMPTS_FILE
from kimi_eagle.fixtures.pair_spec import TARGET_DIR
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import running_server
from kimi_eagle.serve.profile import load_profile
from kimi_eagle.serve.sglang import sglang_draft_config
from tests.helpers import broken_drafts as bd
from tests.helpers.server import EXACT_PROFILE, Server

pytestmark = pytest.mark.e2e
MAX_TOKENS = 48


def specforge_copy(out: Path) -> Path:
    """The shipped draft as SpecForge publishes drafts (AQ-MedAI/Kimi-K25-eagle3, lightseekorg/kimi-k2.5-eagle3):
    a flat Llama config, the aux ids only under `eagle_config`, the layer's weights under `midlayer.*`."""
    config, tensors = bd.read_draft()
    target_text = json.loads((TARGET_DIR / "config.json").read_text())["text_config"]
    flat, _ = sglang_draft_config(config, target_text)
    for key in [k for k in tensors if k.startswith("layers.0.")]:
        tensors["midlayer." + key.removeprefix("layers.0.")] = tensors.pop(key)
    return bd.write_draft(out, flat, tensors)


def test_a_specforge_layout_copy_of_the_draft_serves_at_the_same_acceptance(spec_server: Server,
                                                                            tmp_path: Path) -> None:
    draft = specforge_copy(tmp_path / "specforge")
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
    print(f"\nspeculators layout: mean acceptance length {reference.acceptance.mean_acceptance_length:.3f}; "
          f"SpecForge layout: {served.acceptance.mean_acceptance_length:.3f}")
    assert served.token_ids == reference.token_ids  # float32, greedy: the target's own output either way
    assert served.acceptance.mean_acceptance_length == pytest.approx(reference.acceptance.mean_acceptance_length,
                                                                     abs=1e-9)
    assert served.acceptance.mean_acceptance_length > 2.0
