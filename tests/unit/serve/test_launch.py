"""Starting a server in the foreground: its output reaches the terminal as it comes, and a failed start is named by
the root cause in that output."""

from __future__ import annotations

import sys

import pytest

from kimi_eagle.serve.command import ServeCommand
from kimi_eagle.serve.launch import ServerStartError, serve_in_foreground

# The shape of vLLM 0.32's output when a worker fails (tests/data/vllm-0.32-cpu-start-failure.txt has a real one).
FAILING_SERVER = (
    "import sys\n"
    "print('(APIServer pid=1) INFO 12-01 01:06:17 [api_utils.py:286] non-default args: {}')\n"
    "print('(Worker pid=2) ERROR 12-01 01:07:01 [multiproc_executor.py:1063] ValueError: no room for the KV cache')\n"
    "for i in range(2000):\n"
    "    print(f'  File \"frame{i}.py\", line {i}, in f')\n"
    "print('RuntimeError: Engine core initialization failed. See root cause above.')\n"
    "sys.exit(1)\n"
)


def test_a_foreground_start_echoes_its_output_and_names_the_root_cause(capsys: pytest.CaptureFixture[str]) -> None:
    command = ServeCommand(argv=[sys.executable, "-c", FAILING_SERVER], env={}, url="http://127.0.0.1:9",
                           served_model_name="m", target="t", draft=None)
    with pytest.raises(ServerStartError) as failed:
        serve_in_foreground(command, "vLLM", ready_timeout_s=60)
    message = str(failed.value)
    assert message.startswith("vLLM exited with code 1 before it was ready; root cause: ValueError: no room for the "
                              "KV cache (in vLLM's Worker process)"), message
    err = capsys.readouterr().err
    assert "non-default args" in err and err.rstrip().endswith("See root cause above.")  # all of it, as it came
