"""Structured outputs at T > 0 under speculation, on the default profile as `make serve` starts it: JSON schema,
regex, choice and grammar, with n > 1, top-k and top-p, streamed and not, at mixed concurrency. No answer >= 500, no
token outside the vocabulary, every output valid for its constraint, drafts accepted, and the server alive and
serving the target alone's greedy answers afterwards.

Upstream reports of structured output under EAGLE-3 killing an engine point at vLLM's placeholder draft token (-1):
`Scheduler.update_draft_token_ids_in_output` pads the drafts a grammar refuses with it. That runs only from
`EngineCore.step_with_batch_queue` for a step whose sampling waits on the previous step's tokens
(`pending_structured_output_tokens`, set by `AsyncScheduler` alone); the CPU platform turns async scheduling off
(`CpuPlatform.check_and_update_config`), so here a grammar trims the drafts instead (`Scheduler.
update_draft_token_ids`) and no placeholder reaches the rejection sampler. The other ways in the issue were read too:
the k schedule and the fail-safe give fewer or no draft tokens (an empty list, never -1), and a request that ends
mid-draft drops its drafts with it. The plugin's CPU rejection sampler logs
the first placeholder it meets (`cpu_fixes.PLACEHOLDER_REACHED`): the run below asserts it met none, so a path that
does reach one shows here. The fix itself is proven on vLLM's own test (tests/upstream) and on the kernel
(tests/unit/adapter/test_plugin.py).
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jsonschema
import pytest
import regex
import requests

from kimi_eagle.adapter.cpu_fixes import PLACEHOLDER_REACHED
from tests.helpers.request_options import MESSAGES, PROMPT, Answer, ask
from tests.helpers.server import Server, engine_gauges, greedy_ids, wait_idle

pytestmark = pytest.mark.e2e

REQUESTS = int(os.environ.get("KIMI_EAGLE_STRUCTURED_FUZZ_REQUESTS", "240"))
SEED = int(os.environ.get("KIMI_EAGLE_FUZZ_SEED", "20261207"))
MAX_TOKENS = 48  # the regex, choice and grammar answers end well within it


@dataclass(frozen=True)
class Constraint:
    name: str
    request: dict  # merged into the body: `structured_outputs` or `response_format`
    pattern: str  # the language the constraint allows, as a regular expression (JSON: without whitespace)
    is_json: bool = False

    def problem(self, text: str, finish_reason: str | None) -> str | None:
        """An answer that stopped is in the language; one cut by `max_tokens` is a prefix of it (the tiny target
        likes JSON's optional whitespace, alone as with the draft)."""
        compact = _without_json_whitespace(text) if self.is_json else text
        if finish_reason == "stop":
            if regex.fullmatch(self.pattern, compact) and (not self.is_json or _matches_schema(text)):
                return None
        elif finish_reason == "length" and regex.fullmatch(self.pattern, compact, partial=True):
            return None
        return f"{finish_reason!r} answer not valid for its {self.name}: {text!r}"


RIVERS = ["Nile", "Rhine", "Danube", "Volga"]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["river", "km"],
          "properties": {"river": {"enum": RIVERS}, "km": {"type": "integer", "minimum": 1, "maximum": 9999}}}
_RIVER, _KM = '"river":"(Nile|Rhine|Danube|Volga)"', '"km":[1-9][0-9]{0,3}'
SCHEMA_AS_REGEX = rf"\{{({_RIVER},{_KM}|{_KM},{_RIVER})\}}"
REGEX = r"(Nile|Rhine|Danube) is [1-9][0-9]{0,3} km long"
GRAMMAR = '''root ::= river " flows " direction "."
river ::= "Nile" | "Rhine" | "Danube" | "Volga"
direction ::= "north" | "south" | "east" | "west"
'''
GRAMMAR_AS_REGEX = r"(Nile|Rhine|Danube|Volga) flows (north|south|east|west)\."


def _without_json_whitespace(text: str) -> str:
    out, in_string, escaped = [], False, False
    for char in text:
        if in_string:
            escaped = char == "\\" and not escaped
            in_string = char != '"' or escaped
        elif char == '"':
            in_string = True
        elif char in " \t\n\r":
            continue
        out.append(char)
    return "".join(out)


def _matches_schema(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CONSTRAINTS = [
    Constraint("response_format json_schema", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "river", "schema": SCHEMA}}}, SCHEMA_AS_REGEX, is_json=True),
    Constraint("structured_outputs json", {"structured_outputs": {"json": SCHEMA}}, SCHEMA_AS_REGEX, is_json=True),
    Constraint("regex", {"structured_outputs": {"regex": REGEX}}, REGEX),
    Constraint("choice", {"structured_outputs": {"choice": RIVERS}}, "|".join(RIVERS)),
    Constraint("grammar", {"structured_outputs": {"grammar": GRAMMAR}}, GRAMMAR_AS_REGEX),
]


def random_structured_request(rng: random.Random) -> tuple[str, Constraint, dict]:
    api = rng.choice(["completions", "chat"])
    constraint = rng.choice(CONSTRAINTS)
    body: dict = {"max_tokens": MAX_TOKENS, "temperature": rng.choice([0.3, 0.8, 1.0, 1.5]),
                  "n": rng.choice([1, 2, 3, 4]), "return_token_ids": True, **constraint.request}
    body.update({"prompt": PROMPT} if api == "completions" else {"messages": MESSAGES})
    if rng.random() < 0.4:
        body["top_k"] = rng.choice([2, 5, 50])
    if rng.random() < 0.4:
        body["top_p"] = rng.choice([0.3, 0.9])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 30)
    if rng.random() < 0.3:
        body["stream"] = True
    return api, constraint, body


def problems(answer: Answer, constraint: Constraint, body: dict, vocab_size: int) -> list[str]:
    if answer.status >= 500:
        return [f"HTTP {answer.status}: {answer.error}"]
    if answer.status != 200:
        return [f"HTTP {answer.status} for a valid request: {answer.error}"]
    out = [] if len(answer.choices) == body["n"] else [f"{len(answer.choices)} choices, {body['n']} asked for"]
    for c in answer.choices:
        outside = [t for t in c.token_ids if not 0 <= t < vocab_size]
        if outside or not c.token_ids:
            out.append(f"token ids outside the vocabulary of {vocab_size}: {outside or 'none returned'}")
        problem = constraint.problem(c.text, c.finish_reason)
        if problem:
            out.append(problem)
    return out


def _vocab_size(server: Server) -> int:
    models = requests.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    root = models[0]["root"]
    with open(os.path.join(root, "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)["vocab_size"]


def test_structured_outputs_at_t_above_0_hold_under_speculation(default_server: Server,
                                                               default_plain_server: Server) -> None:
    rng = random.Random(SEED)
    draws = [random_structured_request(rng) for _ in range(REQUESTS)]
    vocab_size = _vocab_size(default_server)
    accepted_before = engine_gauges(default_server.url)["vllm:spec_decode_num_accepted_tokens_total"]
    failures: list[str] = []
    drawn: Counter[str] = Counter()
    finishes: Counter[str | None] = Counter()
    sent = 0
    with ThreadPoolExecutor(max_workers=8) as pool:
        while sent < len(draws):
            wave = draws[sent: sent + rng.choice([1, 2, 4, 8])]  # at most 32 sequences: within the queue bound
            answers = list(pool.map(lambda d: ask(default_server.url, default_server.model, d[0], d[2]), wave))
            for (api, constraint, body), answer in zip(wave, answers):
                drawn[constraint.name] += 1
                finishes.update(c.finish_reason for c in answer.choices)
                failures += [f"{api} {constraint.name} {body}: {p}" for p in
                             problems(answer, constraint, body, vocab_size)]
            sent += len(wave)
    accepted = engine_gauges(default_server.url)["vllm:spec_decode_num_accepted_tokens_total"] - accepted_before
    print(f"structured fuzzer: {sent} requests (seed {SEED}), {dict(drawn)}, answers "
          f"finished {dict(finishes)}, {accepted:.0f} draft tokens accepted")
    assert not failures, f"{len(failures)} problems; the first: {failures[0]}"
    assert accepted > 0, "no draft token was accepted: the run did not exercise speculation"
    wait_idle(default_server.url)
    assert greedy_ids(default_server.url, default_server.model) == greedy_ids(default_plain_server.url,
                                                                              default_plain_server.model)
    assert PLACEHOLDER_REACHED not in default_server.log.read_text(errors="replace")
