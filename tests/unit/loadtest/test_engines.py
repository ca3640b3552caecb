"""Engine readers: SGLang against real SGLang 0.5.23 responses (replayed over real HTTP), SGLang's acceptance
formulas on hand-computed cases, and vLLM's counter deltas on hand-written Prometheus text."""


from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kimi_eagle.acceptance import SpecRequestFigures, sglang_request_figures
from kimi_eagle.loadtest.engines import (
    ENGINES,
    EngineError,
    EngineSnapshot,
    Sample,
    SglangReader,
    VllmReader,
    get_engine,
    parse_metrics,
    sglang_num_speculative_tokens,
)
from kimi_eagle.loadtest.records import RequestRecord, StreamAccumulator


@pytest.fixture
def replay_url(sglang_recordings: Path) -> Iterator[str]:
    """An HTTP server that answers each GET path with the recorded bodies, in the recorded order (the first
    GET /metrics gets metrics_before.txt, the next ones metrics_after.txt)."""
    index = json.loads((sglang_recordings / "index.json").read_text())
    bodies: dict[str, list[bytes]] = {}
    for entry in index["entries"]:
        if entry["method"] == "GET" and entry["status"] == 200:
            bodies.setdefault(entry["path"], []).append((sglang_recordings / entry["file"]).read_bytes())
    served: dict[str, int] = {}

    class Replay(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path not in bodies:
                self.send_response(404)
                self.end_headers()
                return
            n = served.get(self.path, 0)
            served[self.path] = n + 1
            body = bodies[self.path][min(n, len(bodies[self.path]) - 1)]
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Replay)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_sglang_reader_on_recorded_server(replay_url: str) -> None:
    reader = get_engine("sglang", replay_url)
    before, after = reader.snapshot(), reader.snapshot()
    assert reader.served_model() == "tiny-llama"
    # All six recorded speculative gauges are read (they are 0.0: the recorded server did not speculate).
    assert {s.name for s in after.samples if s.name.startswith("sglang:spec_")} == {
        "sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:spec_cap_length",
        "sglang:spec_block_accept_length", "sglang:spec_num_steps", "sglang:spec_num_draft_tokens"}
    acceptance = reader.acceptance(before, after, [])
    assert acceptance.speculation == "off"
    assert acceptance.mean_acceptance_length is None and acceptance.acceptance_rate is None  # unknown, not 0
    assert acceptance.engine_reported["gauge spec_accept_length (last log window)"] == 0.0
    # Hand-computed from the two recorded histograms: count 1 -> 7 + 4, sum 0.12843 -> 0.30256 + 0.05928.
    timing = reader.server_timing(before, after)
    assert timing.requests == 10
    assert timing.mean_ttft_ms == pytest.approx((0.30255920802255787 + 0.05928377600002932
                                                 - 0.1284251979468536) / 10 * 1000)
    config = reader.server_config(after)
    assert (config.model, config.dtype, config.tensor_parallel_size, config.pipeline_parallel_size,
            config.data_parallel_size, config.speculative_method, config.num_speculative_tokens) == (
        "tiny-llama", "auto", 1, 1, 1, None, None)
    assert config.max_num_seqs == 4096  # max_running_requests is null; the effective figure is in internal_states
    assert reader.request_extras() == {"return_spec_tokens_details": True}


def test_sglang_responses_without_speculation_carry_no_figures(sglang_recordings: Path) -> None:
    body = json.loads((sglang_recordings / "v1_completions_spec_details.json").read_text())
    assert sglang_request_figures(body) is None
    assert sglang_request_figures(json.loads((sglang_recordings / "generate.json").read_text())) is None


def _replay_sse(path: Path) -> StreamAccumulator:
    acc = StreamAccumulator()
    for i, line in enumerate(path.read_bytes().splitlines(keepends=True)):
        acc.feed(line, float(i))
    return acc


@pytest.mark.parametrize("name", ["v1_completions_stream.sse.txt", "v1_chat_completions_stream.sse.txt"])
def test_recorded_sglang_streams(sglang_recordings: Path, name: str) -> None:
    acc = _replay_sse(sglang_recordings / name)
    assert acc.done and acc.error is None
    assert acc.usage is not None and acc.usage["completion_tokens"] == 16
    # SGLang's first chunk has empty text: TTFT is taken at the first chunk that shows text, not there.
    assert acc.ttft_ms is not None and acc.ttft_ms > 0
    assert acc.chunk_offsets_ms[0] == acc.ttft_ms
    # This SGLang sends no per-chunk usage or logprobs: per-chunk counts are unknown, never guessed.
    assert acc.chunk_tokens and all(n is None for n in acc.chunk_tokens)
    record = RequestRecord(worker="t", index=0, prompt_index=0, api="x", stream=True, start_unix_s=0, ok=True,
                           chunk_offsets_ms=acc.chunk_offsets_ms, chunk_tokens=acc.chunk_tokens,
                           completion_tokens=16)
    assert record.counted_tokens is None
    assert record.per_token_itl_ms() == []
    assert len(record.inter_chunk_ms()) == len(acc.chunk_offsets_ms) - 1


def test_sglang_per_request_figures_follow_vllm_definitions() -> None:
    # Hand-computed: 10 verify steps with 3 drafts each (speculative_num_draft_tokens 4), 24 accepted,
    # 35 completion tokens (the first from prefill). SGLang's own spec_accept_length = 35 / 10 = 3.5 counts the
    # prefill token; vLLM's definition is 1 + 24 / 10 = 3.4. SGLang's spec_accept_rate = 24 / (10 x (4 - 1)).
    details = {"spec_verify_ct": 10, "spec_num_correct_drafts": 24, "spec_num_proposed_drafts": 30,
               "spec_accept_length": 3.5, "spec_accept_rate": 24 / (10 * (4 - 1))}
    figures = sglang_request_figures({"choices": [], "sglext": {"spec_tokens_details": details}})
    assert figures is not None
    assert figures.mean_acceptance_length == pytest.approx(3.4)
    assert figures.acceptance_rate == pytest.approx(0.8) == pytest.approx(details["spec_accept_rate"])
    assert (figures.num_verify_steps, figures.num_accepted_tokens, figures.num_draft_tokens) == (10, 24, 30)
    assert figures.acceptance_histogram is None
    # /generate carries the same numbers in meta_info.
    same = sglang_request_figures({"meta_info": {**details, "completion_tokens": 35}})
    assert same is not None and same.mean_acceptance_length == pytest.approx(3.4)
    # A choice-level sglext is found too.
    assert sglang_request_figures({"choices": [{"sglext": {"spec_tokens_details": details}}]}) is not None


def test_sglang_k_is_draft_tokens_minus_the_root() -> None:
    # SGLang's cookbook for Kimi-K2.5: --speculative-num-steps 3 --speculative-eagle-topk 1
    # --speculative-num-draft-tokens 4 is vLLM's num_speculative_tokens 3.
    assert sglang_num_speculative_tokens({"speculative_num_draft_tokens": 4, "speculative_eagle_topk": 1,
                                          "speculative_num_steps": 3}) == 3
    assert sglang_num_speculative_tokens({"speculative_num_draft_tokens": 8, "speculative_eagle_topk": 4,
                                          "speculative_num_steps": 3}) == 3
    assert sglang_num_speculative_tokens(None) is None


def _snapshot(kind: str, info: dict | None, samples: list[Sample]) -> EngineSnapshot:
    return EngineSnapshot(kind=kind, taken_unix_s=0.0, samples=samples, server_info=info)


def _record(spec: SpecRequestFigures | None) -> RequestRecord:
    return RequestRecord(worker="t", index=0, prompt_index=0, api="completions", stream=True, start_unix_s=0,
                         ok=True, spec=spec)


def test_sglang_run_acceptance_sums_requests_not_averages(sglang_recordings: Path) -> None:
    info = json.loads((sglang_recordings / "get_server_info.raw.json").read_text())
    info.update(speculative_algorithm="EAGLE3", speculative_num_steps=3, speculative_eagle_topk=1,
                speculative_num_draft_tokens=4)
    reader = SglangReader("http://unused")
    snap = _snapshot("sglang", info, [])
    # Request 1: 10 steps, 24 accepted; request 2: 30 steps, 30 accepted. Pooled: 1 + 54 / 40 = 2.35, rate
    # 54 / 120 = 0.45 (the mean of the two per-request lengths, 3.4 and 2.0, would say 2.7).
    records = [_record(SpecRequestFigures(source="s", num_verify_steps=10, num_accepted_tokens=24,
                                          num_draft_tokens=30)),
               _record(SpecRequestFigures(source="s", num_verify_steps=30, num_accepted_tokens=30,
                                          num_draft_tokens=90))]
    acceptance = reader.acceptance(snap, snap, records)
    assert acceptance.speculation == "on" and acceptance.num_speculative_tokens == 3
    assert acceptance.mean_acceptance_length == pytest.approx(2.35)
    assert acceptance.acceptance_rate == pytest.approx(0.45)
    assert acceptance.per_position_acceptance_rate is None  # no histograms returned: unknown, not zeros
    # With SGLang's per-request histograms (index j: verify steps with exactly j accepted drafts), per-position
    # rates follow: request 1 [1, 2, 3, 4] (0+2+6+12 = 20 accepted in 10 steps), request 2 [5, 5, 0, 0].
    # Summed [6, 7, 3, 4] over 20 steps: position 0 accepted in 14, position 1 in 7, position 2 in 4.
    with_histograms = [
        _record(SpecRequestFigures(source="s", num_verify_steps=10, num_accepted_tokens=20, num_draft_tokens=30,
                                   acceptance_histogram=[1, 2, 3, 4])),
        _record(SpecRequestFigures(source="s", num_verify_steps=10, num_accepted_tokens=5, num_draft_tokens=30,
                                   acceptance_histogram=[5, 5, 0, 0]))]
    by_histogram = reader.acceptance(snap, snap, with_histograms)
    assert by_histogram.per_position_acceptance_rate == pytest.approx([14 / 20, 7 / 20, 4 / 20])
    assert by_histogram.mean_acceptance_length == pytest.approx(1 + 25 / 20)
    # Without per-request figures, a verify counter gives the run delta (tokens per verify step).
    before = _snapshot("sglang", info, [Sample(name="sglang:spec_verify_calls_total", labels={}, value=100),
                                        Sample(name="sglang:generation_tokens_total", labels={}, value=1000)])
    after = _snapshot("sglang", info, [Sample(name="sglang:spec_verify_calls_total", labels={}, value=140),
                                       Sample(name="sglang:generation_tokens_total", labels={}, value=1100)])
    by_counter = reader.acceptance(before, after, [])
    assert by_counter.mean_acceptance_length == pytest.approx(100 / 40)
    assert by_counter.acceptance_rate == pytest.approx((2.5 - 1) / 3)
    # Neither: speculation is on but there is no run delta.
    neither = reader.acceptance(snap, snap, [])
    assert neither.speculation == "on" and neither.mean_acceptance_length is None


VLLM_METRICS = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {drafts}
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {draft_tokens}
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {accepted}
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="0"}} {p0}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="1"}} {p1}
vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="2"}} {p2}
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{{engine="0",model_name="m"}} 5.0
"""


def test_vllm_acceptance_is_the_runs_delta_not_since_boot() -> None:
    reader = VllmReader("http://unused")
    keep = reader.keep
    before = _snapshot("vllm", None, parse_metrics(VLLM_METRICS.format(
        drafts=1000, draft_tokens=3000, accepted=2900, p0=990, p1=970, p2=940), keep))
    after = _snapshot("vllm", None, parse_metrics(VLLM_METRICS.format(
        drafts=1100, draft_tokens=3300, accepted=3020, p0=1070, p1=1010, p2=940), keep))
    a = reader.acceptance(before, after, [])
    # Delta: 100 drafts, 300 draft tokens, 120 accepted (80 / 40 / 0 per position).
    assert (a.num_verify_steps, a.num_draft_tokens, a.num_accepted_tokens) == (100, 300, 120)
    assert a.mean_acceptance_length == pytest.approx(2.2)
    assert a.acceptance_rate == pytest.approx(0.4)
    assert a.per_position_acceptance_rate == pytest.approx([0.8, 0.4, 0.0])
    assert a.num_speculative_tokens == 3
    config = reader.server_config(after)
    assert config.num_speculative_tokens == 3 and config.dtype is None  # vLLM does not expose its dtype


def test_vllm_without_speculation_says_so() -> None:
    reader = VllmReader("http://unused")
    plain = _snapshot("vllm", None, parse_metrics("# TYPE vllm:generation_tokens counter\n"
                                                  "vllm:generation_tokens_total 5.0\n", reader.keep))
    a = reader.acceptance(plain, plain, [])
    assert a.speculation == "off" and a.mean_acceptance_length is None
    assert reader.server_config(plain).num_speculative_tokens == 0


def test_unknown_engine_kind_lists_known_ones() -> None:
    with pytest.raises(EngineError, match="known kinds are sglang, vllm"):
        get_engine("trtllm", "http://x")
    assert set(ENGINES) == {"vllm", "sglang"}


def test_unreachable_server_is_named() -> None:
    with pytest.raises(EngineError, match=r"cannot reach http://127\.0\.0\.1:9/metrics"):
        get_engine("vllm", "http://127.0.0.1:9/v1", timeout_s=2).snapshot()

