"""The default profile's KV cache: stated in bytes, the same on every machine, checked before anything starts; and
the root cause read from a recorded failed start."""


from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_eagle.fixtures.pair_spec import DRAFT_DIR, TARGET_DIR
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.preflight import KV_CACHE_BYTES_FLAG, flag_value, kv_cache_fits
from kimi_eagle.serve.profile import load_profile
from kimi_eagle.serve.server_log import describe_failure, root_cause
from kimi_eagle.serve.sizing import DraftShape, TargetShape, size_deployment
from tests.helpers.cli import DATA

# Each tiny profile's dtype, its bytes per value, and the KV bytes per token of target + draft in it.
KV_BY_PROFILE = {"tiny-cpu": ("bfloat16", 2, 7_424), "tiny-cpu-exact": ("float32", 4, 14_848)}


RECORDED_FAILURE = DATA / "vllm-0.32-cpu-start-failure.txt"


@pytest.mark.parametrize("name", KV_BY_PROFILE)
def test_the_tiny_profile_asks_for_its_kv_cache_in_bytes_not_as_a_share_of_the_host(name: str) -> None:
    """A share (`--gpu-memory-utilization`) is of the NUMA node's memory minus the worker's RSS on CPU: 0.9 GiB on one
    machine, a negative KV cache on another. Bytes are the same everywhere."""
    argv = build_command(load_profile(name)).argv
    assert "--gpu-memory-utilization" not in argv
    assert int(flag_value(argv, KV_CACHE_BYTES_FLAG)) > 0


@pytest.mark.parametrize("name", KV_BY_PROFILE)
def test_the_tiny_profiles_kv_cache_holds_every_sequence_it_admits(name: str) -> None:
    """max-num-seqs sequences of max-model-len tokens, for the target's MLA layers and the draft's layer."""
    dtype, value_bytes, bytes_per_token = KV_BY_PROFILE[name]
    profile = load_profile(name)
    target = TargetShape.from_text_config(json.loads((TARGET_DIR / "config.json").read_text())["text_config"])
    draft = DraftShape.from_config(json.loads((DRAFT_DIR / "config.json").read_text()),
                                   target_hidden_size=target.hidden_size)
    assert profile.vllm_args["dtype"] == dtype
    sizing = size_deployment(target, draft, context_tokens=profile.vllm_args["max-model-len"],
                             concurrency=profile.vllm_args["max-num-seqs"], tensor_parallel_size=1,
                             kv_cache_bytes=value_bytes)
    assert sizing.target_kv_bytes_per_token + sizing.draft_kv_bytes_per_token == bytes_per_token
    requested = profile.vllm_args["kv-cache-memory-bytes"]
    assert sizing.kv_cache_bytes <= requested < 1.2 * sizing.kv_cache_bytes  # enough, and not far more


def test_preflight_passes_the_profile_and_refuses_a_kv_cache_the_machine_cannot_hold(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert kv_cache_fits(build_command(load_profile("tiny-cpu"))) is True
    too_big = build_command(load_profile("tiny-cpu"), extra_args=[KV_CACHE_BYTES_FLAG, "64T"])
    assert kv_cache_fits(too_big) is False
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "the KV cache needs 65536.00 GiB (--kv-cache-memory-bytes 64T)" in err and "NUMA node" in err


def test_serve_refuses_an_impossible_kv_cache_in_one_line_before_starting_vllm() -> None:
    result = subprocess.run([sys.executable, "-m", "kimi_eagle.cli", "serve", "--", KV_CACHE_BYTES_FLAG,
                             "1099511627776"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "pre-flight: the KV cache needs 1024.00 GiB" in result.stderr
    assert "Starting vLLM" not in result.stderr


def test_root_cause_of_a_recorded_failed_start_is_the_workers_error_not_the_last_frames() -> None:
    """vLLM 0.32's own log of a start that asked for a negative KV cache (the old share-based profile on a machine
    whose NUMA node reported 11 GiB): its last line is 'Engine core initialization failed. See root cause above.'"""
    lines = RECORDED_FAILURE.read_text().splitlines()
    assert any(line.startswith("RuntimeError: Engine core initialization failed") for line in lines[-4:])
    assert root_cause(lines) == ("ValueError: Available memory on node 0 (9.08/11.34 GiB) on kv cache allocation is "
                                 "less than requested memory for kv (-0.08/0.91 GiB). Reduce CPU memory used by "
                                 "other processes. (in vLLM's Worker process)")


def test_root_cause_falls_back_to_the_first_engine_error_then_to_a_plain_traceback() -> None:
    engine_only = ["(EngineCore pid=7) INFO 12-01 01:00:00 [core.py:1] starting",
                   "(EngineCore pid=7) ERROR 12-01 01:00:01 [core.py:2] EngineCore failed to start.",
                   "(EngineCore pid=7) ERROR 12-01 01:00:01 [core.py:2] Traceback (most recent call last):"]
    assert root_cause(engine_only) == "EngineCore failed to start. (in vLLM's EngineCore process)"
    api_server = ["Traceback (most recent call last):", '  File "x.py", line 1, in <module>',
                  "argparse.ArgumentError: bad", "KeyError: 'model'"]
    assert root_cause(api_server) == "KeyError: 'model'"
    assert root_cause([*api_server, *engine_only]) == "EngineCore failed to start. (in vLLM's EngineCore process)"
    assert root_cause(["INFO all good", "Warming up done."]) is None


def test_a_failure_without_a_root_cause_shows_the_end_of_its_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("\n".join(f"line {i}" for i in range(40)))
    text = describe_failure(log, None)
    assert "no error line in its log" in text and text.endswith("line 39") and "line 27" not in text
    log.write_text(RECORDED_FAILURE.read_text())
    assert describe_failure(log, None).startswith("root cause: ValueError: Available memory on node 0")

