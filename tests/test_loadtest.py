"""`kimi-eagle loadtest`: prompt sets, request bodies, per-request figures, and real Locust runs against the
tiny served model (local and distributed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.files import write_atomic
from loadtest.metrics import summarise
from loadtest.prompts import PromptError, load_prompts, shipped_sets
from loadtest.records import RequestRecord, StreamAccumulator
from loadtest.results import load_records, load_summary
from loadtest.summary import LocustSettings, RunSummary
from loadtest.workload import Workload

REPO = Path(__file__).resolve().parents[1]


def test_shipped_prompt_sets_load_in_a_seeded_order() -> None:
    assert shipped_sets() == ["chat-long", "chat-short", "completion-long", "completion-short"]
    for name in shipped_sets():
        api = "chat" if name.startswith("chat") else "completions"
        assert len(load_prompts(name, api, seed=0)) >= 16
    first = [p.prompt for p in load_prompts("completion-short", "completions", seed=1)]
    assert first == [p.prompt for p in load_prompts("completion-short", "completions", seed=1)]
    assert first != [p.prompt for p in load_prompts("completion-short", "completions", seed=2)]
    # A completion prompt may go to the chat API, as one user message.
    chat = load_prompts("completion-short", "chat", seed=0)[0].request_fields("chat")
    assert chat["messages"][0]["role"] == "user"


def test_bad_prompt_files_name_the_line_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(PromptError, match=r"p\.jsonl:2: a `messages` line cannot be sent to the completions API"):
        load_prompts(str(path), "completions", seed=0)
    path.write_text('{"prompt": "ok"}\n{"prompt": "a", "messages": []}\n')
    with pytest.raises(PromptError, match=r"p\.jsonl:2: .*exactly one of `prompt`"):
        load_prompts(str(path), "chat", seed=0)
    path.write_text("{not json\n")
    with pytest.raises(PromptError, match=r"p\.jsonl:1: not JSON"):
        load_prompts(str(path), "chat", seed=0)
    with pytest.raises(PromptError, match="shipped sets are chat-long, chat-short"):
        load_prompts("no-such-set", "chat", seed=0)


def test_request_body_asks_for_fixed_lengths_and_per_chunk_usage() -> None:
    workload = Workload(url="http://127.0.0.1:8000/v1/", max_tokens=7)
    assert workload.url == "http://127.0.0.1:8000" and workload.prompts == "completion-short"
    prompt = load_prompts("completion-short", "completions", seed=0)[0]
    body = workload.request_body(prompt, "m", {"return_spec_tokens_details": True})
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert body["return_spec_tokens_details"] is True
    assert "stream_options" not in Workload(url="http://x", stream=False).request_body(prompt, "m", {})


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n".encode()


def test_chunks_carrying_several_tokens_are_counted_exactly() -> None:
    acc = StreamAccumulator()
    chunks = [({"role": "assistant", "content": ""}, 0), ({"content": "a"}, 1), ({"content": "bcd"}, 4),
              ({"content": ""}, 5), ({"content": "ef"}, 7)]
    for i, (delta, tokens) in enumerate(chunks):
        acc.feed(_sse({"choices": [{"index": 0, "delta": delta}], "usage": {"completion_tokens": tokens}}),
                 10.0 * (i + 1))
    acc.feed(_sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7}}), 60.0)
    acc.feed(_sse("[DONE]"), 61.0)
    assert acc.done and acc.ttft_ms == 20.0
    # The empty-text chunk at 40 ms still carried a token (held-back text): it is a chunk of its own.
    assert acc.chunk_offsets_ms == [20.0, 30.0, 40.0, 50.0] and acc.chunk_tokens == [1, 3, 1, 2]
    record = RequestRecord(worker="t", index=0, prompt_index=0, api="chat", stream=True, start_unix_s=0, ok=True,
                           ttft_ms=acc.ttft_ms, latency_ms=61.0, chunk_offsets_ms=acc.chunk_offsets_ms,
                           chunk_tokens=acc.chunk_tokens, completion_tokens=7)
    assert record.counted_tokens == 7
    assert record.inter_chunk_ms() == [10.0, 10.0, 10.0]
    assert record.per_token_itl_ms() == pytest.approx([10 / 3] * 3 + [10.0] + [5.0, 5.0])
    assert record.tpot_ms == pytest.approx((61.0 - 20.0) / 6)


def test_logprobs_count_tokens_when_the_server_sends_no_per_chunk_usage() -> None:
    acc = StreamAccumulator()
    acc.feed(_sse({"choices": [{"index": 0, "text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}), 5.0)
    acc.feed(_sse({"choices": [{"index": 0, "text": "c", "logprobs": {"tokens": ["c"]}}]}), 9.0)
    acc.feed(_sse({"choices": [], "usage": {"completion_tokens": 3}}), 9.5)
    # The final usage chunk holds the total, not three more tokens.
    assert acc.chunk_tokens == [2, 1] and acc.usage == {"completion_tokens": 3}
    workload = Workload(url="http://x", api="chat", logprob_token_counts=True)
    prompt = load_prompts("chat-short", "chat", seed=0)[0]
    assert workload.request_body(prompt, "m", {})["top_logprobs"] == 0


def _rec(i: int, ttft: float | None, latency: float, tokens: int | None, ok: bool = True) -> RequestRecord:
    return RequestRecord(worker="t", index=i, prompt_index=i, api="completions", stream=True, start_unix_s=100 + i,
                         ok=ok, ttft_ms=ttft, latency_ms=latency, completion_tokens=tokens, prompt_tokens=5,
                         chunk_offsets_ms=[ttft or 0.0], chunk_tokens=[tokens], error=None if ok else "HTTP 500: x")


def test_summary_goodput_and_unknowns() -> None:
    # TPOT: (1000 - 100) / 9 = 100 ms; (1000 - 400) / 9 = 66.7 ms; (2000 - 100) / 9 = 211 ms.
    records = [_rec(0, 100, 1000, 10), _rec(1, 400, 1000, 10), _rec(2, 100, 2000, 10), _rec(3, None, 5, None, False)]
    workload = Workload(url="http://x", max_tokens=10, ttft_limit_ms=200, tpot_limit_ms=150)
    s = summarise(records, workload=workload, locust=LocustSettings(users=1), model="m")
    assert (s.requests.ok, s.requests.failed, s.requests.errors) == (3, 1, {"HTTP 500: x": 1})
    assert s.goodput.good_requests == 1  # only the first meets both limits
    assert s.tpot_ms is not None and s.tpot_ms.p50 == pytest.approx(100.0)
    assert s.acceptance is None and s.client_overhead.server_mean_ttft_ms is None  # not measured: None, not 0
    assert s.throughput.duration_s == pytest.approx(4.0)  # from 100 s to 102 s + 2 s
    assert s.throughput.output_tokens_per_s == pytest.approx(30 / 4.0)
    no_limits = summarise(records, workload=Workload(url="http://x"), locust=LocustSettings(), model="m")
    assert no_limits.goodput.good_requests is None


def test_write_atomic_replaces_whole_files(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "summary.json"
    write_atomic(target, "old")
    write_atomic(target, b"new")
    assert target.read_text() == "new"
    assert [p.name for p in target.parent.iterdir()] == ["summary.json"]  # no temporary file left behind


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kimi_eagle.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_rejects_bad_input_with_a_message(tmp_path: Path) -> None:
    result = run_cli("loadtest", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "cannot reach http://127.0.0.1:9/v1/models" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("loadtest", "--url", "http://127.0.0.1:9", "--prompts", "nope", timeout=60)
    assert result.returncode == 2 and "no prompt set 'nope'" in result.stderr


def check_run(out: Path, max_tokens: int) -> RunSummary:
    summary = load_summary(out / "summary.json")
    records = load_records(out / "requests.jsonl")
    assert summary.requests.ok == len(records) > 0 and summary.requests.failed == 0
    # Token counts per chunk add up exactly to the server's usage, request by request.
    assert summary.tokens.per_chunk_counts_match_usage is True
    assert summary.tokens.requests_with_per_chunk_counts == len(records)
    for r in records:
        assert r.counted_tokens == r.completion_tokens == max_tokens
    for name in ("report.md", "latency_cdf.png", "acceptance_per_position.png", "locust_stats.csv",
                 "engine_before.json", "engine_after.json"):
        assert (out / name).is_file(), name
    return summary


