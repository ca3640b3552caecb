"""`bench guidellm`: how GuideLLM is found, called and read (its real output), and how the tools are compared."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_eagle.bench import guidellm
from kimi_eagle.bench.guidellm import Figures, Row
from kimi_eagle.bench.result import Machine
from kimi_eagle.loadtest.prompts import load_prompts
from tests.helpers.cli import DATA

RECORDED = DATA / "guidellm-0.8.1" / "concurrent-1-synthetic.json"


def test_reads_what_guidellm_printed_for_a_real_run() -> None:
    figures = guidellm.read_guidellm(RECORDED)
    assert round(figures.output_tokens_per_s, 1) == 167.0, f"{figures}: its console printed 167.0 output tok/s"
    assert round(figures.itl_ms, 1) == 5.8 and figures.requests == 39, f"{figures}: it printed ITL 5.8 ms, 39 requests"


def test_a_missing_guidellm_names_the_command_that_installs_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(guidellm.GUIDELLM_ENV, str(tmp_path / "nowhere" / "guidellm"))
    with pytest.raises(guidellm.GuideLLMMissingError, match="make guidellm"):
        guidellm.find_guidellm()


def test_the_command_sets_the_temperature_in_the_request_body(tmp_path: Path) -> None:
    argv = guidellm.guidellm_command(Path("guidellm"), url="http://127.0.0.1:9", model="m", tokenizer=tmp_path,
                                     data="kind=synthetic_text,prompt_tokens=64,output_tokens=128", streams=4,
                                     seconds=20, temperature=0.0, out=tmp_path / "o.json")
    backend = argv[argv.index("--backend") + 1]
    # GuideLLM sends no temperature unless told: vLLM would sample at 1.0 for a T=0 row
    assert "extras.body.temperature=0" in backend.split(","), backend
    assert argv[argv.index("--profile") + 1] == "kind=concurrent,streams=[4]"
    assert argv[argv.index("--constraint") + 1] == "kind=max_duration,seconds=20"


def test_heldout_prompts_are_read_by_the_load_test_and_carry_guidellms_output_count(tmp_path: Path) -> None:
    plain = guidellm.heldout_jsonl(["def f(x):", "import os"], tmp_path / "a.jsonl")
    for_guidellm = guidellm.heldout_jsonl(["def f(x):"], tmp_path / "b.jsonl", output_tokens=128)
    read = sorted(p.prompt for p in load_prompts(str(plain), "completions", 0))
    assert read == ["def f(x):", "import os"], f"the load test read {read}"
    assert for_guidellm.read_text() == '{"prompt": "def f(x):", "output_tokens_count": 128}\n'


def _row(config: str, data: str, tool_figures: float, loadtest: float | None) -> Row:
    return Row(config=config, temperature=1.0, streams=1, data=data,
               guidellm=Figures(output_tokens_per_s=tool_figures, itl_ms=5.0, requests=10),
               loadtest=None if loadtest is None else Figures(output_tokens_per_s=loadtest, itl_ms=5.0, requests=10))


def test_verdict_gives_the_ratio_to_no_draft_and_calls_out_tools_that_disagree() -> None:
    rows = [_row("profile", "held-out", 200.0, 198.0), _row("--no-draft", "held-out", 160.0, 100.0)]
    text = guidellm.verdict(rows)
    assert "1.25x --no-draft" in text, text
    assert "differ by more than 15% on 1 held-out row" in text, text
    table = guidellm.markdown(guidellm.GuideLLMResult.model_construct(
        command="c", started_utc="t", duration_s=60, machine=Machine(
            cpu_model="cpu", cpus=2, memory_gib=24, load_average_before=[0, 0, 0], load_average_after=[0, 0, 0],
            vllm_version="0.32.0", torch_version=None, isa="AVX2", vllm_kernels="_C_AVX2"),
        profile="tiny-cpu", guidellm_version="0.8.1", plan=guidellm.QUICK, rows=rows, verdict=text))
    assert "cpu, 2 CPUs, AVX2 (vLLM kernels _C_AVX2), vLLM 0.32.0" in table, table  # where its figures were made
    assert "| profile | 1 | 1 | held-out | 200 (5.00 ms) | 1.25 | 198 (5.00 ms) | 1.98 | 0.99 |" in table, table
