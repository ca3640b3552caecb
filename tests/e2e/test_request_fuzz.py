"""Random combinations of valid request options (a seeded generator), streamed and not, at mixed concurrency, against
the default profile as `make serve` starts it: no answer >= 500, and the server still serves the target alone's
greedy answers at the end. A draw that finds a fault becomes an option of tests/helpers/request_options.py."""

from __future__ import annotations

import os
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from kimi_eagle.serve.profile import load_profile
from tests.helpers.request_options import ask, random_request
from tests.helpers.server import DEFAULT_PROFILE, Server, greedy_ids, wait_idle

pytestmark = pytest.mark.e2e

QUEUE_BOUND = int(load_profile(DEFAULT_PROFILE).vllm_args["max-num-queued-reqs"])
REQUESTS = int(os.environ.get("KIMI_EAGLE_FUZZ_REQUESTS", "1000"))
SEED = int(os.environ.get("KIMI_EAGLE_FUZZ_SEED", "20261203"))


def sequences(draw: tuple[str, dict]) -> int:
    """The engine requests one HTTP request becomes: one per prompt of a batch, times `n`."""
    api, body = draw
    prompt = body.get("prompt")
    prompts = len(prompt) if api == "completions" and isinstance(prompt, list) and isinstance(prompt[0], str) else 1
    return prompts * body.get("n", 1)


def test_random_request_options_never_fail_the_default_server(default_server: Server,
                                                               default_plain_server: Server) -> None:
    rng = random.Random(SEED)
    draws = [random_request(rng) for _ in range(REQUESTS)]
    statuses: Counter[int] = Counter()
    failures: list[str] = []
    options: Counter[str] = Counter()
    sent = 0
    with ThreadPoolExecutor(max_workers=24) as pool:
        while sent < len(draws):
            wave = draws[sent: sent + rng.choice([1, 2, 4, 8, 16, 24])]  # mixed concurrency, waves of 1 to 24
            # Within the profile's queue bound: beyond it vLLM answers 503 "busy, try again" by design (the
            # reliability tests' overload case), which is not what the fuzzer looks for.
            while len(wave) > 1 and sum(map(sequences, wave)) > QUEUE_BOUND:
                wave = wave[:-1]
            answers = list(pool.map(lambda d: ask(default_server.url, default_server.model, d[0], d[1]), wave))
            for (api, body), answer in zip(wave, answers):
                statuses[answer.status] += 1
                options.update(body.keys())
                if answer.status >= 500:
                    failures.append(f"HTTP {answer.status} for {api} {body}: {answer.error}")
            sent += len(wave)
    print(f"fuzzer: {sent} requests (seed {SEED}), statuses {dict(statuses)}, options drawn {dict(options)}")
    assert not failures, f"{len(failures)} answers >= 500; the first: {failures[0]}"
    wait_idle(default_server.url)
    assert greedy_ids(default_server.url, default_server.model) == greedy_ids(default_plain_server.url,
                                                                              default_plain_server.model)
