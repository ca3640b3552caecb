"""Exposure of the served stack, checked on running servers: the API key enforced on every route that does work."""


from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from kimi_eagle.processes import free_port
from kimi_eagle.serve.command import build_command
from kimi_eagle.serve.launch import running_server
from kimi_eagle.serve.profile import load_profile
from tests.helpers.server import EXACT_PROFILE

pytestmark = pytest.mark.xdist_group("keyed-server")  # its tests share the module's keyed server: one worker

# --- the real server with a key ------------------------------------------------------------------------------------
COMPLETION = {"prompt": "def main(", "max_tokens": 4, "temperature": 0}


# Routes vLLM 0.32 serves by default outside its guarded prefixes (/v1, /v2, /inference, /cohere) that do work: a
# completion through the SageMaker route, tokenizer calls, scoring, elastic scaling.
UNGUARDED_BY_VLLM = [("POST", "/invocations", COMPLETION), ("POST", "/tokenize", {"prompt": "def main("}),
                     ("POST", "/detokenize", {"tokens": [1, 2, 3]}), ("POST", "/generative_scoring", {}),
                     ("POST", "/scale_elastic_ep", {})]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, str, Path]]:
    key = secrets.token_urlsafe(32)
    command = build_command(load_profile(EXACT_PROFILE), port=free_port(), api_key=key)
    log = tmp_path_factory.mktemp("keyed") / "server.log"
    with running_server(command, log_path=log, timeout_s=600):
        yield command.url, command.served_model_name, key, log


@pytest.mark.e2e
def test_requests_without_the_key_get_401_and_with_it_succeed(keyed_server) -> None:
    url, model, key, _ = keyed_server
    body = {"model": model, **COMPLETION}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
        assert requests.get(f"{url}/v1/models", headers=headers, timeout=30).status_code == 401
        assert requests.post(f"{url}/v1/completions", json=body, headers=headers, timeout=30).status_code == 401
    ok = requests.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


@pytest.mark.e2e
@pytest.mark.parametrize(("method", "path", "body"), UNGUARDED_BY_VLLM, ids=[p for _, p, _ in UNGUARDED_BY_VLLM])
def test_routes_outside_v1_need_the_key_too(keyed_server, method: str, path: str, body: dict) -> None:
    url, model, key, _ = keyed_server
    body = {"model": model, **body} if "prompt" in body else body
    without = requests.request(method, f"{url}{path}", json=body, timeout=60)
    assert without.status_code == 401, f"{path} answered {without.status_code} without a key: {without.text[:200]}"
    with_key = requests.request(method, f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                                timeout=120)
    assert with_key.status_code != 401, with_key.text[:300]  # reaches the route (which may refuse an empty body)
    if path == "/invocations":
        assert with_key.status_code == 200 and with_key.json()["usage"]["completion_tokens"] == 4


@pytest.mark.e2e
def test_probes_stay_open_and_the_log_never_holds_the_key(keyed_server) -> None:
    url, _, key, log = keyed_server
    assert requests.get(f"{url}/health", timeout=10).status_code == 200
    assert "vllm:num_requests_running" in requests.get(f"{url}/metrics", timeout=10).text
    assert key not in log.read_text()

