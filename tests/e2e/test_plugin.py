"""The vLLM plugin inside a running engine."""


from __future__ import annotations

import pytest

from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import ServerStartError, running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.server import EXACT_PROFILE


@pytest.mark.e2e
def test_engine_refuses_the_pair_without_the_plugin(tmp_path) -> None:
    """With no plugin loaded (VLLM_PLUGINS="" allows none), vLLM 0.32 cannot start target + draft on CPU. Eager: the
    refusal comes when the KV cache is grouped, after the model is built and warmed up; compiling it first (which
    this CPU build, without the plugin, can never load from its cache) only added 45 s before the same refusal."""
    command = build_command(load_profile(EXACT_PROFILE), port=free_port(), extra_args=["--enforce-eager"])
    command.env["VLLM_PLUGINS"] = ""
    log = tmp_path / "no-plugin.log"
    with pytest.raises(ServerStartError), running_server(command, log_path=log, timeout_s=600):
        pass
    text = log.read_text()
    assert "No common block size for" in text and "CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)]" in text

