"""`kimi-eagle loadtest` without an engine: prompt sets, request bodies, per-request figures, and Locust runs
against a stand-in that replays a recorded SGLang stream (interrupts, dead servers, keys, distributed mode)."""


from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kimi_eagle.loadtest.engines import API_KEY_ENVS
from kimi_eagle.loadtest.files import write_atomic
from kimi_eagle.loadtest.metrics import summarise
from kimi_eagle.loadtest.prompts import PromptError, load_prompts, shipped_sets
from kimi_eagle.loadtest.records import RequestRecord, StreamAccumulator
from kimi_eagle.loadtest.results import load_records, load_summary
from kimi_eagle.loadtest.runner import LocustRun, run_locust
from kimi_eagle.loadtest.summary import LocustSettings
from kimi_eagle.loadtest.workload import Workload
from kimi_eagle.processes import free_port
from tests.helpers.cli import REPO, exit_message, run_cli
from tests.helpers.sglang_stand_in import StandIn
from tests.helpers.terminal import ctrl_c_as_in_a_terminal


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


def test_cli_rejects_bad_input_with_a_message(tmp_path: Path) -> None:
    result = run_cli("loadtest", "--url", "http://127.0.0.1:9", "--out", str(tmp_path), timeout=60)
    assert result.returncode == 2
    assert "cannot reach http://127.0.0.1:9/v1/models" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("loadtest", "--url", "http://127.0.0.1:9", "--prompts", "nope", timeout=60)
    assert result.returncode == 2 and "no prompt set 'nope'" in result.stderr




@pytest.fixture
def stand_in(sglang_recordings: Path) -> Iterator[StandIn]:
    server = StandIn(sglang_recordings)
    yield server
    server.close()


def _loadtest_args(url: str, out: Path, *extra: str) -> list[str]:
    return ["loadtest", "--url", url, "--engine", "sglang", "--model", "tiny-llama", "--max-tokens", "16",
            "--out", str(out), *extra]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_interrupted_run_stops_locust_and_keeps_what_it_gathered(stand_in: StandIn, tmp_path: Path,
                                                                 sig: signal.Signals) -> None:
    out = tmp_path / "run"
    cli = subprocess.Popen([sys.executable, "-m", "kimi_eagle.cli",
                            *_loadtest_args(stand_in.url, out, "--users", "2", "--run-time", "5m")],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        # The live progress line shows answered requests: interrupt then, well before --run-time.
        assert cli.stderr is not None
        for line in cli.stderr:
            if re.search(r"users 2 \| [1-9]\d* ok", line):
                break
        else:
            pytest.fail("Locust never reported an answered request")
        locust = psutil.Process(cli.pid).children(recursive=True)
        assert locust, "Locust runs as a child process"
        cli.send_signal(sig)
        _, stderr = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert cli.returncode == 130, f"exit {cli.returncode} after the interrupt, expected 130: {stderr[-300:]!r}"
    assert "interrupted; results so far in" in stderr and "Traceback" not in stderr
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in locust)
    summary = load_summary(out / "summary.json")
    assert summary.interrupted is True and summary.requests.ok >= 1
    assert len(load_records(out / "requests.jsonl")) == summary.requests.total
    assert (out / "report.md").read_text().count("**Interrupted**") == 1
    assert (out / "locust_stats.csv").is_file() and not (out / ".locust-csv").exists()


def test_a_dead_server_gets_a_request_a_second_per_user_not_a_busy_loop(tmp_path: Path) -> None:
    # Locust itself (the CLI refuses a dead server before it starts): as if the server died during a run.
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: every connection is refused
    run = LocustRun(workload=Workload(url=dead, model="m", max_tokens=16), out_dir=tmp_path / "dead", users=2,
                    run_time="4s")
    code, summary = run_locust(run, timeout_s=120)
    assert code == 1  # failed requests: a run that is not clean
    # 2 users x (4 s / 1 s back-off, + the first attempt) at most; without the back-off, thousands.
    assert 2 <= summary.requests.total <= 2 * 6, summary.requests
    assert summary.requests.ok == 0
    assert all(msg.startswith("no HTTP answer: ConnectionRefusedError") for msg in summary.requests.errors)
    assert summary.acceptance is None  # the engine could not be read: unknown, not zero


@pytest.mark.parametrize("variable", ["VLLM_API_KEY", "OPENAI_API_KEY"])
def test_api_key_from_the_environment_is_sent_and_never_written(sglang_recordings: Path, tmp_path: Path,
                                                                variable: str) -> None:
    key = f"sk-test-{variable.lower()}-5f3a9c"
    server = StandIn(sglang_recordings, line_delay_s=0.0, key=key)
    try:
        env = {k: v for k, v in os.environ.items() if k not in API_KEY_ENVS}
        out = tmp_path / "run"
        args = _loadtest_args(server.url, out, "--max-requests", "3", "--run-time", "60s")
        refused = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", *args], cwd=REPO, capture_output=True,
                                 text=True, timeout=60, env=env)
        assert refused.returncode == 2
        assert "answered 401: the server wants an API key and no key was sent: set VLLM_API_KEY or " \
               "OPENAI_API_KEY" in refused.stderr and "Traceback" not in refused.stderr
        result = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", *args], cwd=REPO, capture_output=True,
                                text=True, timeout=120, env={**env, variable: key})
    finally:
        server.close()
    assert result.returncode == 0, exit_message(result)
    summary = load_summary(out / "summary.json")
    assert summary.requests.ok == 3 and summary.acceptance is not None  # the engine's GETs got through too
    sent = server.authorizations[server.authorizations.index(f"Bearer {key}"):]
    assert len(sent) >= 3 + 2 and set(sent) == {f"Bearer {key}"}
    assert key not in result.stdout + result.stderr
    assert not [p for p in out.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]


def test_distributed_run_ended_by_run_time_loses_no_request(stand_in: StandIn, tmp_path: Path) -> None:
    # Each request takes about a second; --run-time ends the run with requests in flight on both workers. The
    # master drains the workers first, so every stream the server completed is in the summary.
    stand_in.line_delay_s = 0.06
    out = tmp_path / "dist"
    result = run_cli(*_loadtest_args(stand_in.url, out, "--workers", "2", "--users", "2", "--run-time", "6s"),
                     timeout=180)
    assert result.returncode == 0, exit_message(result)
    summary = load_summary(out / "summary.json")
    records = load_records(out / "requests.jsonl")
    assert summary.locust.mode == "distributed" and summary.locust.workers == 2
    assert summary.requests.failed == 0 and summary.interrupted is False
    assert summary.requests.total == len(records) == stand_in.streams_completed
    assert len({r.worker for r in records}) == 2
    assert summary.client_overhead.harness_cpu_percent_max is not None  # the workers report theirs

