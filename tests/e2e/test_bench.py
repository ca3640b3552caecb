"""`kimi-eagle bench MODE --quick` for real: two vLLM servers, real requests, real Locust, real files. It proves the
benchmark still runs end to end and that its figures hang together; it asserts nothing about speed."""


from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kimi_eagle.bench import configs
from kimi_eagle.bench.plan import QUICK
from kimi_eagle.bench.result import BenchResult
from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, HELDOUT_PROMPTS_FILE, PREDICTABLE_PROMPTS_FILE, TARGET_DIR
from kimi_eagle.loadtest import serve_bench
from tests.helpers.cli import exit_message
from tests.helpers.server import EXACT_PROFILE

pytestmark = pytest.mark.e2e


def test_quick_benchmark_writes_consistent_results(tmp_path: Path) -> None:
    for needed in (TARGET_DIR, DRAFT_DIR, HELDOUT_PROMPTS_FILE):
        if not needed.exists():
            pytest.fail(f"{needed} is missing: build the tiny pair first (`kimi-eagle fixtures --rebuild`)")
    # The exactness profile: its outputs are compared token for token below (and its graphs are the session's).
    done = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "bench", "speedup", "--quick", "--out",
                           str(tmp_path), "--profile", EXACT_PROFILE], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, exit_message(done)
    [json_path] = tmp_path.glob("quick-*.json")
    result = BenchResult.model_validate_json(json_path.read_text())
    assert result.command == f"kimi-eagle bench speedup --quick --out {tmp_path} --profile {EXACT_PROFILE}"
    assert result.machine.cpus >= 1 and result.machine.cpu_model

    held = {p.concurrency: p for p in result.throughput if p.workload == "held-out"}
    assert sorted(held) == QUICK.concurrency
    for p in [*held.values(), *(p for p in result.throughput if p.workload == "ceiling")]:
        assert p.num_speculative_tokens == 3
        assert p.plain_tokens_per_s.n == p.spec_tokens_per_s.n == QUICK.repeats
        assert p.plain_tokens_per_s.min > 0 and p.spec_tokens_per_s.min > 0
        acc = p.acceptance
        assert acc is not None and acc.verify_steps > 0 and len(acc.per_position) == 3
        assert acc.mean_acceptance_length == pytest.approx(1 + sum(acc.per_position), abs=1e-6)
        # A chain stops at its first rejection: position j+1 is never accepted more often than position j.
        assert all(a >= b - 1e-9 for a, b in zip(acc.per_position, acc.per_position[1:]))
    # Greedy float32 with the trained draft gives the target's own output, token for token.
    same, compared = held[1].identical_outputs
    assert compared == QUICK.requests_per_sample and same == compared

    starts = {c.config: c for c in result.cold_starts}
    assert set(starts) == {"plain", "spec-k3"}
    assert not starts["plain"].draft and starts["spec-k3"].draft
    for c in starts.values():
        assert 0 < c.seconds_to_healthy <= c.seconds_to_first_token
        # API server, engine core and worker at least; each holds some hundreds of MB.
        assert len(c.peak_rss_bytes_by_process) >= 2 and c.peak_rss_bytes > 500 * 2**20

    assert result.checks == []  # quick mode skips the checks-off server
    h = result.harness
    assert h is not None and h.concurrency == max(QUICK.concurrency)
    assert h.locust_requests_ok and h.locust_tokens_per_s and h.locust_cpu_s_per_1k_tokens
    assert sorted(r.concurrency for r in result.recommendations) == QUICK.concurrency
    for r in result.recommendations:
        assert r.cost.calibrated_at_k == [3] and r.acceptance_from_k == 3
        assert set(r.predicted_speedup_by_k) == {1, 2, 3}
        # One measured k calibrates the model: there it reproduces the measurement.
        assert r.predicted_speedup_by_k[3] == pytest.approx(r.measured_speedup_by_k[3])

    # Each point and side also as a `vllm bench serve --append-result` line, read back by the A/B's reader.
    vllm_form = serve_bench.read(json_path.with_suffix(".vllm_bench_serve.jsonl"))
    assert len(vllm_form) == 2 * len(result.throughput)
    plain, spec = (next(r for r in vllm_form if r.label == f"held-out c=1 {side}") for side in ("plain", "spec k=3"))
    assert plain.completed == spec.completed == QUICK.repeats * QUICK.requests_per_sample
    assert plain.total_output_tokens == plain.completed * QUICK.max_tokens and plain.mean_ttft_ms is None
    assert plain.spec_decode_num_drafts is None and spec.spec_decode_num_drafts == held[1].acceptance.verify_steps
    assert spec.output_throughput == pytest.approx(spec.total_output_tokens / spec.duration)
    assert spec.mean_e2el_ms and spec.mean_e2el_ms > 0

    report = json_path.with_suffix(".md").read_text()
    assert "## 7. Recommended num_speculative_tokens" in report and result.command in report
    assert "Profile setting to use" in done.stdout and "concurrency   1:" in done.stdout



def test_quick_configs_benchmark_serves_the_default_layout_streamed_and_not(tmp_path: Path) -> None:
    """The two bfloat16 configurations with the worker inside the engine core (the default profile and its target
    alone), one server at a time, a streamed and a non-streamed load each."""
    done = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "bench", "configs", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, exit_message(done)
    [json_path] = tmp_path.glob("configs-quick-*.json")
    result = configs.ConfigsResult.model_validate_json(json_path.read_text())
    plain, draft = (c.name for c in configs.QUICK.configs)
    loads = [p.name for p in configs.QUICK.points]
    assert sorted((p.config, p.load) for p in result.points) == sorted((c, lo) for c in (plain, draft) for lo in loads)
    for p in result.points:
        assert p.tokens_per_s.n == 1 and p.tokens_per_s.min > 0
        assert (p.ratio_to_fastest_without_draft is not None) == (p.config == draft)
    # The draft speculates in bfloat16 too (float32 gives about 2.9 on these prompts).
    assert set(result.mean_acceptance_length) == {draft} and result.mean_acceptance_length[draft] >= 2.0
    assert sorted(s.config for s in result.starts) == sorted([plain, draft])
    assert all(s.seconds_to_healthy > 0 and s.peak_rss_bytes > 500 * 2**20 for s in result.starts)
    assert result.fastest == draft and result.verdict in done.stdout
    assert f"| {draft} |" in json_path.with_suffix(".md").read_text()


def test_quick_tune_measures_a_schedule_and_serves_it(tmp_path: Path) -> None:
    """`bench tune --quick`: the sweep, a schedule made of it, the tuned server measured beside the others, and a
    load across the schedule's boundary; the schedule the run wrote into a copy of the profile loads."""
    from kimi_eagle.bench.tune import QUICK as TUNE_QUICK
    from kimi_eagle.bench.tune import TuneResult, recommended_schedule
    from kimi_eagle.serve.profile import PROFILES_DIR, load_profile

    profile = tmp_path / "tiny-cpu-exact.yaml"
    profile.write_text((PROFILES_DIR / f"{EXACT_PROFILE}.yaml").read_text())
    # The prompts the draft predicts best: on the held-out ones, one quick round on one core often found no k faster
    # than the target alone, and the run stopped after the sweep, with the schedule, its proof and the profile
    # written never reached (three runs of the suite of four on 2026-12-05).
    done = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "bench", "tune", "--quick", "--out",
                           str(tmp_path), "--profile", str(profile), "--write-profile",
                           "--prompts", str(PREDICTABLE_PROMPTS_FILE)],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, exit_message(done)
    [json_path] = tmp_path.glob("tune-quick-*.json")
    result = TuneResult.model_validate_json(json_path.read_text())
    assert result.max_num_seqs == 16
    assert {p.concurrency for p in result.sweep} == {*TUNE_QUICK.concurrency, 16}
    assert {p.config for p in result.sweep} == {"alone", *(f"k={k}" for k in TUNE_QUICK.ks)}, "the sweep's servers"
    assert all(p.tokens_per_s.min > 0 and p.tokens_per_s.n == TUNE_QUICK.rounds for p in result.sweep)
    assert result.verdict in done.stdout
    assert result.schedule is not None, f"the draft paid at no load on the prompts it predicts best: {result.verdict}"
    assert result.schedule[0][0] == 1 and result.schedule[-1][1] == 16
    assert {p.config for p in result.proof} >= {"alone", "tuned"}
    assert all(p.tokens_per_s.n == TUNE_QUICK.proof_rounds for p in result.proof)
    assert {p.concurrency for p in result.proof_points} == {*TUNE_QUICK.concurrency, 16}
    # What --write-profile writes is the schedule after the proof where the proof overruled the sweep (a quick run's
    # one proof round can find the target alone faster at some load), else the sweep's; nothing when neither pays.
    written = load_profile(str(profile)).speculative
    recommended = recommended_schedule(result)
    if recommended is None:
        assert "serve without the draft" in result.verdict
        assert written == load_profile(EXACT_PROFILE).speculative
    else:
        assert written.num_speculative_tokens_per_batch_size == [tuple(r) for r in recommended]
        assert written.num_speculative_tokens == max(k for _, _, k in recommended)
    if result.crossing is not None:
        assert result.crossing.segments >= 2 and result.crossing.tokens_per_s > 0


def test_quick_bypass_benchmark_trips_the_fail_safe(tmp_path: Path) -> None:
    from kimi_eagle.bench.bypass import CONFIGS, BypassResult

    done = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "bench", "bypass", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, exit_message(done)
    [json_path] = tmp_path.glob("bypass-quick-*.json")
    result = BypassResult.model_validate_json(json_path.read_text())
    assert {p.config for p in result.points} == set(CONFIGS)
    assert all(p.tokens_per_s.min > 0 and p.server_cpu_s_per_1k_tokens.min > 0 for p in result.points)
    assert all((p.cpu_ratio_to_target_alone is None) == (p.config == CONFIGS[0]) for p in result.points)
    # The first batch trips it: 200 drafts of a draft that accepts nothing take a couple of hundred steps.
    assert len(result.seconds_to_bypass) == 1 and result.seconds_to_bypass[0] is not None
    logs = {p.name: p.read_text() for p in tmp_path.glob("bypass-quick-*-files/logs/*.log")}
    assert sum("DRAFT BYPASSED" in text for text in logs.values()) == 1  # on the fail-safe's server only
    assert result.verdict in done.stdout


def test_quick_startup_benchmark_times_a_first_and_a_second_start(tmp_path: Path) -> None:
    """`bench startup --quick`: `kimi-eagle serve` twice on an empty compile cache of its own; the second start
    loads the target's graph the first compiled, is the faster, and answers as the first did (the loaded graph
    computes what the compiled one did). Its cache links the inductor kernels of the suite's servers (the quick
    plan), so the first start traces and saves every graph but compiles only kernels no server compiled before.
    The output folder is relative, as `make bench`'s default `bench/results` is: the compile cache under it is then
    relative too."""
    from kimi_eagle.bench import startup

    done = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "bench", "startup", "--quick", "--out",
                           "results"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, exit_message(done)
    [json_path] = (tmp_path / "results").glob("startup-quick-*.json")
    result = startup.StartupResult.model_validate_json(json_path.read_text())
    first, second = result.starts
    assert (first.start, first.cache_files_before) == ("first", 0)
    assert second.start == "second" and second.cache_files_before > 0
    assert second.seconds_to_ready < first.seconds_to_ready
    assert (first.loaded_compiled_target, second.loaded_compiled_target) == (False, True), \
        "the first start should compile the target's graph and the second load it"
    assert first.answer_token_ids and len(first.answer_token_ids) == startup.ANSWER_TOKENS
    assert second.answer_token_ids == first.answer_token_ids, "the loaded graph answered otherwise than the compiled"
    assert result.verdict in done.stdout


def test_quick_guidellm_benchmark_puts_both_tools_side_by_side(tmp_path: Path) -> None:
    """`bench guidellm --quick`: GuideLLM (the optional peer, `make guidellm`) and the load test on the profile and
    on --no-draft, each row read back from the tools' own files."""
    from kimi_eagle.bench import guidellm

    try:
        guidellm.find_guidellm()
    except guidellm.GuideLLMMissingError as exc:
        pytest.skip(f"optional: {exc}")
    done = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "bench", "guidellm", "--quick", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, exit_message(done)
    [json_path] = tmp_path.glob("guidellm-quick-*.json")
    result = guidellm.GuideLLMResult.model_validate_json(json_path.read_text())
    plan = guidellm.QUICK
    expected = {(c, t, s, d) for c in guidellm.CONFIGS for t in plan.temperatures for s in plan.streams
                for d in ("synthetic", "held-out")}
    assert {(r.config, r.temperature, r.streams, r.data) for r in result.rows} == expected
    for row in result.rows:
        assert row.guidellm.output_tokens_per_s > 0 and row.guidellm.requests > 0, f"GuideLLM measured nothing: {row}"
        assert (row.loadtest is not None) == (row.data == "held-out"), f"the load test runs the held-out rows: {row}"
        if row.loadtest:
            assert row.loadtest.output_tokens_per_s > 0, f"the load test measured nothing: {row}"
    assert result.verdict in done.stdout
