"""The runtime guards inside vLLM: each silent failure of vLLM 0.32 becomes a refusal or an alarm."""


from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import ServerStartError, running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers import broken_drafts as bd
from tests.helpers.server import Server, metric_value

pytestmark = pytest.mark.e2e


def start_expecting_refusal(tmp_path: Path, draft: Path, env: dict[str, str]) -> str:
    command = build_command(load_profile("tiny-cpu"), draft=str(draft), port=free_port())
    command.env.update(env)
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError), running_server(command, log_path=log, timeout_s=600):
        pass
    return log.read_text()


def test_unfilled_draft_parameters_are_refused_at_load(tmp_path: Path) -> None:
    """vLLM 0.32 runs such a draft silently; with the static checks off, the load-time sentinel still refuses, and
    names every parameter left unfilled: the fusion layer's and one inside the decoder layer (one start for both)."""
    missing = ["fc.weight", "layers.0.mlp.down_proj.weight"]
    draft = bd.draft_without(tmp_path / "draft", *missing)
    log = start_expecting_refusal(tmp_path, draft, {"KIMI_EAGLE_STATIC_CHECKS": "0"})
    refusal = next((line for line in log.splitlines() if "DraftRefusedError" in line and "unfilled" in line), "")
    assert "leaves 2 parameter(s) unfilled" in refusal, log[-3000:]
    for name in missing:
        assert name.removesuffix(".weight") in refusal, f"{name} is not named in the refusal: {refusal}"


def test_target_without_aux_capture_is_named_at_the_first_step(tmp_path: Path) -> None:
    """With the aux-layer capture crippled (one layer instead of three), the first draft step says so. Eager: the
    check runs where the draft combines the target's hidden states, outside the compiled graphs, and the crippled
    capture is a graph of its own, which would be compiled for this one start (20 s on one core)."""
    command = build_command(load_profile("tiny-cpu"), port=free_port(), extra_args=["--enforce-eager"])
    command.env["KIMI_EAGLE_FAULT"] = "aux-single-layer"
    log = tmp_path / "server.log"
    with running_server(command, log_path=log, timeout_s=600):
        client = OpenAI(base_url=f"{command.url}/v1", api_key="unused", timeout=120, max_retries=0)
        with pytest.raises(Exception):  # noqa: B017 - the engine dies; the client sees a 5xx or a dropped connection
            client.completions.create(model=command.served_model_name, prompt="The", max_tokens=8, temperature=0)
    text = log.read_text()
    assert "the draft's fc expects 768 = 3 aux layers [2, 4, 6] x hidden 256, but the target sent 256" in text


def test_trained_draft_raises_no_alarm(spec_server: Server) -> None:
    client = OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", timeout=300)
    client.completions.create(model=spec_server.model, prompt=["The file", "A value"] * 4, max_tokens=64,
                              temperature=0, extra_body={"ignore_eos": True})
    assert metric_value(spec_server.url, "kimi_eagle:spec_decode_acceptance_collapsed") == 0.0
    assert metric_value(spec_server.url, "kimi_eagle:draft_bypassed") == 0.0
    assert "ACCEPTANCE COLLAPSE" not in spec_server.log.read_text()
    assert "DRAFT BYPASSED" not in spec_server.log.read_text()
    assert "first draft step checked: fc received 768 = 3 x 256" in spec_server.log.read_text()

