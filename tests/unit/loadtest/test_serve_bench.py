"""Results in `vllm bench serve` form: the reader's errors, and `make loadtest`'s default address."""


from __future__ import annotations

import json
from pathlib import Path

import pytest

from kimi_eagle.loadtest import serve_bench
from kimi_eagle.loadtest.serve_bench import ServeBenchError
from tests.helpers.cli import run_cli


def test_read_takes_one_result_or_one_per_line_and_names_what_is_wrong(tmp_path: Path) -> None:
    one = {"duration": 10.0, "completed": 8, "total_input_tokens": 80, "total_output_tokens": 128,
           "request_throughput": 0.8, "output_throughput": 12.8, "total_token_throughput": 20.8, "custom": "kept"}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(one))
    [result] = serve_bench.read(path)
    assert result.completed == 8 and result.model_extra == {"custom": "kept"} and result.mean_ttft_ms is None
    path.write_text(json.dumps(one) + "\n" + json.dumps({**one, "completed": 9}) + "\n")  # --append-result
    assert [r.completed for r in serve_bench.read(path)] == [8, 9]
    path.write_text("{not json")
    with pytest.raises(ServeBenchError, match=r"r\.json is not JSON"):
        serve_bench.read(path)
    path.write_text(json.dumps({"duration": 1.0}))
    with pytest.raises(ServeBenchError, match=r"not a `vllm bench serve` result: completed, output_throughput"):
        serve_bench.read(path)


def test_loadtest_without_url_uses_the_address_make_serve_binds(tmp_path: Path) -> None:
    result = run_cli("loadtest", "--run-time", "1s", "--out", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "no --url: using http://127.0.0.1:8000, where `make serve` listens" in result.stderr
    assert "cannot reach http://127.0.0.1:8000/v1/models" in result.stderr and "Traceback" not in result.stderr

