"""Issue 34 inside real vLLM: a draft whose fc.weight is stored, with other values, in both of its shards is refused
by the plugin's static checks when vLLM loads it (the path of every start that skips `kimi-eagle serve`'s
pre-flight: the server fixtures, doctor's probe, bench), instead of serving whichever copy was read last."""


from __future__ import annotations

from pathlib import Path

import pytest

from kimi_eagle.fixtures.pair_spec import DRAFT_DIR
from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import ServerStartError, running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.sharded import SHARDS, shard_with_copy

pytestmark = pytest.mark.e2e


def test_vllm_refuses_a_draft_with_a_tensor_stored_twice(tmp_path: Path) -> None:
    draft = shard_with_copy(DRAFT_DIR, tmp_path / "draft", "fc.weight", differ=True)
    command = build_command(load_profile("tiny-cpu"), draft=str(draft), port=free_port())
    log = tmp_path / "server.log"
    with pytest.raises(ServerStartError), running_server(command, log_path=log, timeout_s=600):
        pass
    text = log.read_text()
    assert "DraftRefusedError" in text and "[conflicting-copies]" in text, text[-3000:]
    assert f"fc.weight in {SHARDS[0]} and {SHARDS[1]} (vLLM keeps the copy in {SHARDS[1]}" in text
