"""A server that fails to start is reported by its root cause: a real vLLM start that cannot hold its KV cache."""


from __future__ import annotations

from pathlib import Path

import pytest

from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import ServerStartError, running_server
from kimi_eagle.serve.preflight import KV_CACHE_BYTES_FLAG
from kimi_eagle.serve.profile import load_profile
from tests.helpers.server import EXACT_PROFILE


@pytest.mark.e2e
def test_a_real_failed_start_is_reported_by_its_root_cause(tmp_path: Path) -> None:
    """The server fixtures, doctor's probe and bench start vLLM without the pre-flight: the error they raise names
    the worker's error, not 'Engine core initialization failed. See root cause above.'"""
    command = build_command(load_profile(EXACT_PROFILE), port=free_port(), extra_args=[KV_CACHE_BYTES_FLAG, "64T"])
    with pytest.raises(ServerStartError) as failed, running_server(command, log_path=tmp_path / "log", timeout_s=600):
        pass
    message = str(failed.value)
    assert message.startswith("vLLM exited with code 1 before it was ready; root cause: ValueError: Available "
                              "memory on node"), message
    assert "(65536.0 GiB)" in message and "in vLLM's Worker process" in message

