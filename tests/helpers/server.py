"""Real vLLM servers for the tests: the handle a fixture yields, and what tests read off a running one."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

# The profile of the session's servers: the default pair in float32, where speculation must give the target's own
# greedy output token for token (the default profile, tiny-cpu, serves it in bfloat16: faster, not exact).
EXACT_PROFILE = "tiny-cpu-exact"
DEFAULT_PROFILE = "tiny-cpu"  # what `make serve` starts

# A prompt whose greedy continuation any corruption of the engine's state would change.
REFERENCE_PROMPT = "def parse_args(argv):\n    parser = argparse.ArgumentParser("


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT, without /v1
    model: str
    log: Path
    ready_s: float


def server_processes(url: str) -> list[psutil.Process]:
    """The process listening on the URL's port and all its descendants (API server, engine core, workers)."""
    port = int(url.rsplit(":", 1)[1])
    pids = {c.pid for c in psutil.net_connections(kind="tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid}
    assert pids, f"no process listens on port {port}"
    root = psutil.Process(min(pids))
    return [root, *root.children(recursive=True)]


def server_rss_bytes(url: str) -> int:
    total = 0
    for p in server_processes(url):
        with contextlib.suppress(psutil.NoSuchProcess):  # a helper process ended between listing and reading
            total += p.memory_info().rss
    return total


def greedy_ids(url: str, model: str, max_tokens: int = 16, headers: dict | None = None) -> list[int]:
    """Token ids of a greedy completion of REFERENCE_PROMPT: any corruption of engine state changes them."""
    r = requests.post(f"{url}/v1/completions", headers=headers, timeout=120, json={
        "model": model, "prompt": REFERENCE_PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.status_code == 200, r.text[:500]
    return r.json()["choices"][0]["token_ids"]


def engine_gauges(url: str) -> dict[str, float]:
    """vLLM's request gauges and token counters, summed over engines: num_requests_running/_waiting, ..."""
    wanted = {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:generation_tokens_total",
              "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"}
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] += sample.value
    return out


def metric_value(url: str, name: str) -> float | None:
    """One sample of /metrics by its name (summed over its labels), or None when the server exports none."""
    values = [sample.value for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=10).text)
              for sample in family.samples if sample.name == name]
    return sum(values) if values else None


def wait_idle(url: str, timeout_s: float = 60) -> float:
    """Seconds until no request is running or waiting; fails the test if the engine keeps some."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        g = engine_gauges(url)
        if g["vllm:num_requests_running"] == 0 and g["vllm:num_requests_waiting"] == 0:
            return time.monotonic() - started
        time.sleep(0.5)
    g = engine_gauges(url)
    pytest.fail(f"the engine still holds {g['vllm:num_requests_running']:.0f} running and "
                f"{g['vllm:num_requests_waiting']:.0f} waiting requests {timeout_s:.0f}s after the clients left")
