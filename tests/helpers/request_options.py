"""Every request option of vLLM 0.32's OpenAI completions and chat APIs, as a client sends it, and what an answer
is made of: the parity suite sends each option to a server with the draft and to the target alone, the fuzzer
draws combinations of them.

An option is kept under speculation when both servers give the same answer (greedy options, and sampled ones that
are greedy by construction: top-k 1, min-p 1), or, where sampling decides, when the option's own effect holds on
both (n choices, a forced token, a seed that repeats). A 4xx from both is the target alone's own refusal, kept too.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

PROMPT = "The history of the river"
MESSAGES = [{"role": "user", "content": "Tell me about the history of the river."}]
MAX_TOKENS = 8
LOGPROB_TOLERANCE = 0.02  # the draft changes which kernel computes a logprob (a 1 + k token step), not its value


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[tuple[str, float, tuple[str, ...]]] = field(default_factory=list)  # token, logprob, top tokens
    prompt_logprobs: list | None = None


@dataclass
class Answer:
    status: int
    error: str = ""
    choices: list[Choice] = field(default_factory=list)
    usage: dict | None = None

    def tokens(self) -> list[list[int]]:
        return [c.token_ids for c in self.choices]


@dataclass(frozen=True)
class Option:
    """One request option. `body` is merged over the API's greedy base request; a callable body gets the target
    alone's greedy answer to the base request (a token to ban, a word to forbid). `expect` is the option's own effect,
    checked on both servers; `greedy` says the answer must be the base request's greedy answer."""

    name: str
    api: str  # "completions" or "chat"
    body: dict | Callable[[Answer], dict]
    stream: bool = False
    sampled: bool = False  # sampling decides the tokens: the servers' answers are not compared token for token
    greedy: bool = False
    expect: Callable[[Answer, dict], str | None] | None = None

    def request(self, greedy_answer: Answer) -> dict:
        extra = self.body(greedy_answer) if callable(self.body) else self.body
        return {**base_request(self.api), **extra, **({"stream": True} if self.stream else {})}


def base_request(api: str) -> dict:
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    return {"prompt": PROMPT, **common} if api == "completions" else {"messages": MESSAGES, **common}


def ask(url: str, model: str, api: str, body: dict, timeout_s: float = 120) -> Answer:
    """One request, streamed or not, read into the same Answer."""
    path = "/v1/completions" if api == "completions" else "/v1/chat/completions"
    with requests.post(f"{url}{path}", json={"model": model, **body}, stream=bool(body.get("stream")),
                       timeout=timeout_s) as response:
        if response.status_code != 200:
            return Answer(response.status_code, response.text[:400])
        if not body.get("stream"):
            data = response.json()
            choices = sorted(data["choices"], key=lambda c: c["index"])
            return Answer(200, choices=[_choice(c, api, data) for c in choices], usage=data.get("usage"))
        return _read_stream(response, api)


def _read_stream(response: requests.Response, api: str) -> Answer:
    choices: dict[int, Choice] = {}
    usage = None
    for line in response.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line.removeprefix("data: "))
        if "error" in chunk:  # vLLM reports a failure after the headers inside the stream
            return Answer(int(chunk["error"].get("code") or 500), json.dumps(chunk["error"])[:400])
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices", []):
            part = _choice(c, api, chunk)
            whole = choices.setdefault(c["index"], Choice())
            whole.text += part.text
            whole.token_ids += part.token_ids
            whole.logprobs += part.logprobs
            whole.finish_reason = part.finish_reason or whole.finish_reason
            whole.prompt_logprobs = part.prompt_logprobs or whole.prompt_logprobs
    return Answer(200, choices=[choices[i] for i in sorted(choices)], usage=usage)


def _choice(c: dict, api: str, response: dict) -> Choice:
    """One choice of a response (or a stream's chunk); chat gives the prompt's logprobs once, beside the choices."""
    if api == "completions":
        text = c.get("text") or ""
        lp = c.get("logprobs") or {}
        tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens") or [])
        logprobs = [(t, v if v is not None else -math.inf, tuple(sorted(top or {})))
                    for t, v, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], tops)]
    else:
        message = c.get("message") or c.get("delta") or {}
        text = message.get("content") or ""
        content = (c.get("logprobs") or {}).get("content") or []
        logprobs = [(e["token"], e["logprob"], tuple(sorted(t["token"] for t in e.get("top_logprobs") or [])))
                    for e in content]
    return Choice(text=text, token_ids=list(c.get("token_ids") or []), finish_reason=c.get("finish_reason"),
                  logprobs=logprobs, prompt_logprobs=c.get("prompt_logprobs") or response.get("prompt_logprobs"))


def differences(with_draft: Answer, alone: Answer) -> list[str]:
    """How two answers to one request differ: empty when the draft changed nothing a client can see."""
    out = []
    if len(with_draft.choices) != len(alone.choices):
        return [f"{len(with_draft.choices)} choices with the draft, {len(alone.choices)} without"]
    for i, (a, b) in enumerate(zip(with_draft.choices, alone.choices)):
        for name in ("text", "token_ids", "finish_reason"):
            if getattr(a, name) != getattr(b, name):
                out.append(f"choice {i} {name}: {getattr(a, name)!r} with the draft, {getattr(b, name)!r} without")
        if [(t, top) for t, _, top in a.logprobs] != [(t, top) for t, _, top in b.logprobs]:
            out.append(f"choice {i} logprob tokens: {a.logprobs[:3]} with the draft, {b.logprobs[:3]} without")
        elif any(abs(x - y) > LOGPROB_TOLERANCE for (_, x, _), (_, y, _) in zip(a.logprobs, b.logprobs)
                 if math.isfinite(x) or math.isfinite(y)):
            out.append(f"choice {i} logprob values differ by more than {LOGPROB_TOLERANCE}")
        if (a.prompt_logprobs is None) != (b.prompt_logprobs is None):
            out.append(f"choice {i} prompt_logprobs: given on one server only")
    if (with_draft.usage is None) != (alone.usage is None):
        out.append(f"usage: {with_draft.usage} with the draft, {alone.usage} without")
    elif with_draft.usage and alone.usage:
        for key in ("prompt_tokens", "completion_tokens"):
            if with_draft.usage.get(key) != alone.usage.get(key):
                out.append(f"usage {key}: {with_draft.usage.get(key)} with the draft, {alone.usage.get(key)} without")
    return out


def check_option_kept(option: Option, with_draft_url: str, alone_url: str, model: str,
                      greedy_cache: dict[tuple[str, str], Answer]) -> str:
    """Send one option to a server with a draft and to the target alone; fail the test where the draft changed what
    a client gets. Returns "kept", or "refused by both: ..." (the target alone's own 4xx, the answer without
    speculation). `greedy_cache` keeps each server's greedy answer to the base request across options."""
    body = option.request(_greedy(alone_url, model, option.api, greedy_cache))
    with_draft = ask(with_draft_url, model, option.api, body)
    alone = ask(alone_url, model, option.api, body)
    assert with_draft.status < 500, f"{option.name}: the server with the draft failed: {with_draft.error}"
    assert with_draft.status == alone.status, (
        f"{option.name}: HTTP {with_draft.status} with the draft, {alone.status} for the target alone: "
        f"{with_draft.error or alone.error}")
    if alone.status != 200:
        return f"refused by both: {alone.status} {alone.error[:120]}"
    for name, answer in (("with the draft", with_draft), ("target alone", alone)):
        if option.expect and (broken := option.expect(answer, body)):
            raise AssertionError(f"{option.name} ({name}): {broken}")
    if option.greedy:
        greedy = _greedy(with_draft_url, model, option.api, greedy_cache)
        assert with_draft.tokens() == greedy.tokens(), f"{option.name}: greedy by construction, yet not greedy"
    if not option.sampled:
        assert not (diff := differences(with_draft, alone)), f"{option.name}: " + "; ".join(diff)
    return "kept"


def _greedy(url: str, model: str, api: str, cache: dict[tuple[str, str], Answer]) -> Answer:
    if (url, api) not in cache:
        answer = ask(url, model, api, base_request(api))
        assert answer.status == 200, answer.error
        cache[url, api] = answer
    return cache[url, api]


# --- what an option promises, checked on both servers ---------------------------------------------------------

def _every_token_is(token_id: int) -> Callable[[Answer, dict], str | None]:
    def check(answer: Answer, body: dict) -> str | None:
        bad = [ids for ids in answer.tokens() if set(ids) != {token_id}]
        return f"logit_bias +100 on {token_id}, yet generated {bad[0]}" if bad else None
    return check


def _n_choices(answer: Answer, body: dict) -> str | None:
    want = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                               and not isinstance(body["prompt"][0], int) else 1)
    return None if len(answer.choices) == want else f"{len(answer.choices)} choices, {want} asked for"


def _at_least(n: int) -> Callable[[Answer, dict], str | None]:
    def check(answer: Answer, body: dict) -> str | None:
        short = [len(ids) for ids in answer.tokens() if len(ids) < n]
        return f"min_tokens {n}, yet {short[0]} tokens" if short else None
    return check


def _only(allowed: Callable[[dict], set[int]]) -> Callable[[Answer, dict], str | None]:
    def check(answer: Answer, body: dict) -> str | None:
        extra = {t for ids in answer.tokens() for t in ids} - allowed(body)
        return f"tokens outside the allowed set: {sorted(extra)}" if extra else None
    return check


def _first_is_not(answer: Answer, body: dict) -> str | None:
    banned = {int(t) for t in body["logit_bias"]}
    hits = [ids[0] for ids in answer.tokens() if ids and ids[0] in banned]
    return f"logit_bias -100 on {hits[0]}, yet it came first" if hits else None


def _one_of(choices: list[str]) -> Callable[[Answer, dict], str | None]:
    def check(answer: Answer, body: dict) -> str | None:
        bad = [c.text for c in answer.choices if c.text not in choices]
        return f"structured choice {choices}, yet {bad[0]!r}" if bad else None
    return check


def _valid_json_when_done(answer: Answer, body: dict) -> str | None:
    for c in answer.choices:
        if c.finish_reason == "stop":
            try:
                json.loads(c.text)
            except ValueError:
                return f"finished JSON that does not parse: {c.text!r}"
    return None


def _has_usage(answer: Answer, body: dict) -> str | None:
    usage = answer.usage or {}
    got = sum(len(ids) for ids in answer.tokens())
    return None if usage.get("completion_tokens") == got else f"usage {usage}, {got} tokens streamed"


def _has_logprobs(count: int) -> Callable[[Answer, dict], str | None]:
    def check(answer: Answer, body: dict) -> str | None:
        c = answer.choices[0]
        if len(c.logprobs) < len(c.token_ids):
            return f"{len(c.logprobs)} logprobs for {len(c.token_ids)} tokens"
        short = [top for _, _, top in c.logprobs if len(top) < count]
        return f"fewer than {count} top logprobs: {short[0]}" if short else None
    return check


def _has_prompt_logprobs(answer: Answer, body: dict) -> str | None:
    return None if answer.choices[0].prompt_logprobs else "no prompt_logprobs"


def _tokens(answer: Answer) -> list[int]:
    return answer.choices[0].token_ids


def _second_token(greedy: Answer) -> int:
    return _tokens(greedy)[1]


def _first_word(greedy: Answer) -> str:
    return (greedy.choices[0].text.split() or ["river"])[0]


BATCH = [f"{PROMPT} number {i}" for i in range(10)]  # more requests than the default schedule drafts for (8)


def _completions() -> list[Option]:
    c = "completions"
    return [
        Option("greedy", c, {}),
        Option("greedy, streamed, include_usage", c, {"stream_options": {"include_usage": True}}, stream=True,
               expect=_has_usage),
        Option("max_tokens 24 + ignore_eos", c, {"max_tokens": 24, "ignore_eos": True}),
        Option("stop strings", c, {"stop": [" ", "\n"], "max_tokens": 16}),
        Option("stop + include_stop_str_in_output", c, {"stop": [" ", "\n"], "include_stop_str_in_output": True,
                                                        "max_tokens": 16}),
        Option("stop_token_ids", c, lambda g: {"stop_token_ids": [_tokens(g)[3]]}),
        Option("logprobs 5", c, {"logprobs": 5}, expect=_has_logprobs(5)),
        Option("logprobs 0", c, {"logprobs": 0}),
        Option("logprobs, streamed", c, {"logprobs": 3}, stream=True, expect=_has_logprobs(3)),
        Option("echo", c, {"echo": True}),
        Option("echo + logprobs", c, {"echo": True, "logprobs": 2, "max_tokens": 4}),
        Option("prompt_logprobs", c, {"prompt_logprobs": 3}, expect=_has_prompt_logprobs),
        Option("return_tokens_as_token_ids", c, {"logprobs": 1, "return_tokens_as_token_ids": True}),
        Option("presence_penalty", c, {"presence_penalty": 1.5, "max_tokens": 16}),
        Option("frequency_penalty", c, {"frequency_penalty": 1.0, "max_tokens": 16}),
        Option("repetition_penalty", c, {"repetition_penalty": 1.3, "max_tokens": 16}),
        Option("logit_bias: ban the greedy first token", c, lambda g: {"logit_bias": {str(_tokens(g)[0]): -100}},
               expect=_first_is_not),
        Option("logit_bias: force a token", c, lambda g: {"logit_bias": {str(_second_token(g)): 100},
                                                           "ignore_eos": True},
               expect=lambda a, b: _every_token_is(int(next(iter(b["logit_bias"]))))(a, b)),
        Option("logit_bias: nudge", c, lambda g: {"logit_bias": {str(t): 3.0 for t in _tokens(g)[2:5]}}),
        Option("bad_words", c, lambda g: {"bad_words": [_first_word(g)]}),
        Option("allowed_token_ids", c, lambda g: {"allowed_token_ids": sorted(set(_tokens(g)[1:]) | {7, 9})},
               expect=_only(lambda b: set(b["allowed_token_ids"]))),
        Option("min_tokens", c, {"min_tokens": 12, "max_tokens": 16}, expect=_at_least(12)),
        Option("response_format json_object", c, {"response_format": {"type": "json_object"}, "max_tokens": 16},
               expect=_valid_json_when_done),
        Option("response_format json_schema", c, {"max_tokens": 16, "response_format": {
            "type": "json_schema", "json_schema": {"name": "river", "schema": {
                "type": "object", "properties": {"length": {"type": "integer"}}, "required": ["length"]}}}},
            expect=_valid_json_when_done),
        Option("structured_outputs regex", c, {"structured_outputs": {"regex": "[a-z]{2,6}"}}),
        Option("structured_outputs choice", c, {"structured_outputs": {"choice": ["Nile", "Danube", "Rhine"]}},
               expect=_one_of(["Nile", "Danube", "Rhine"])),
        Option("allowed_token_ids + response_format json_object", c, {
            "allowed_token_ids": [57, 152], "response_format": {"type": "json_object"}}),  # 400 from both
        Option("n 3, greedy", c, {"n": 3}, expect=_n_choices),
        Option("batch of 10 prompts", c, {"prompt": BATCH}, expect=_n_choices),
        Option("batch, streamed", c, {"prompt": BATCH[:4], "stream_options": {"include_usage": True}}, stream=True,
               expect=_n_choices),
        Option("prompt as token ids", c, {"prompt": [11, 200, 33, 1024, 57, 900]}),
        Option("skip_special_tokens false", c, {"skip_special_tokens": False}),
        Option("spaces_between_special_tokens false", c, {"spaces_between_special_tokens": False}),
        Option("add_special_tokens false", c, {"add_special_tokens": False}),
        Option("truncate_prompt_tokens", c, {"truncate_prompt_tokens": 3}),
        Option("use_beam_search", c, {"use_beam_search": True, "n": 2, "max_tokens": 6}),
        Option("user, request_id, cache_salt", c, {"user": "u-1", "request_id": "parity-1", "cache_salt": "s1"}),
        Option("stream_interval", c, {"stream_interval": 3}, stream=True),
        Option("priority", c, {"priority": 1}),
        Option("suffix", c, {"suffix": " end"}),
        Option("top_k 1 at T 0.6", c, {"temperature": 0.6, "top_k": 1}, greedy=True),
        Option("min_p 1 at T 1", c, {"temperature": 1.0, "min_p": 1.0}, greedy=True),
        Option("top_p 1e-6 at T 1", c, {"temperature": 1.0, "top_p": 1e-6}, greedy=True),
        Option("logit_bias: force a token at T 1", c, lambda g: {"logit_bias": {str(_second_token(g)): 100},
                                                                  "temperature": 1.0, "ignore_eos": True},
               sampled=True, expect=lambda a, b: _every_token_is(int(next(iter(b["logit_bias"]))))(a, b)),
        Option("top_k 50 at T 0.8", c, {"temperature": 0.8, "top_k": 50, "seed": 3}, sampled=True),
        Option("top_p 0.9 at T 0.8", c, {"temperature": 0.8, "top_p": 0.9, "seed": 3}, sampled=True),
        Option("min_p 0.1 at T 0.8", c, {"temperature": 0.8, "min_p": 0.1, "seed": 3}, sampled=True),
        Option("top_k + top_p + min_p at T 1", c, {"temperature": 1.0, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
               sampled=True),
        Option("temperature 2", c, {"temperature": 2.0}, sampled=True),
        Option("n 4 at T 0.9", c, {"temperature": 0.9, "n": 4}, sampled=True, expect=_n_choices),
        Option("n 3 at T 1, streamed", c, {"temperature": 1.0, "n": 3}, sampled=True, stream=True,
               expect=_n_choices),
    ]


def _chat() -> list[Option]:
    c = "chat"
    return [
        Option("chat greedy", c, {}),
        Option("chat streamed, include_usage", c, {"stream_options": {"include_usage": True}}, stream=True,
               expect=_has_usage),
        Option("chat max_completion_tokens", c, {"max_completion_tokens": 6}),
        Option("chat logprobs + top_logprobs", c, {"logprobs": True, "top_logprobs": 4}, expect=_has_logprobs(4)),
        Option("chat logprobs, streamed", c, {"logprobs": True, "top_logprobs": 2}, stream=True),
        Option("chat stop", c, {"stop": [" "], "max_tokens": 16}),
        Option("chat echo", c, {"echo": True}),
        Option("chat prompt_logprobs", c, {"prompt_logprobs": 2}, expect=_has_prompt_logprobs),
        Option("chat penalties", c, {"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
                                     "max_tokens": 16}),
        Option("chat logit_bias: ban", c, lambda g: {"logit_bias": {str(_tokens(g)[0]): -100}},
               expect=_first_is_not),
        Option("chat bad_words + min_tokens", c, lambda g: {"bad_words": [_first_word(g)], "min_tokens": 6}),
        Option("chat response_format json_object", c, {"response_format": {"type": "json_object"}, "max_tokens": 16},
               expect=_valid_json_when_done),
        Option("chat structured choice", c, {"structured_outputs": {"choice": ["yes", "no"]}},
               expect=_one_of(["yes", "no"])),
        Option("chat continue_final_message", c, {
            "messages": [*MESSAGES, {"role": "assistant", "content": "The river"}],
            "add_generation_prompt": False, "continue_final_message": True}),
        Option("chat system message", c, {"messages": [{"role": "system", "content": "Be brief."}, *MESSAGES]}),
        Option("chat tools, tool_choice auto", c, {"tool_choice": "auto", "tools": [{"type": "function", "function": {
            "name": "length", "parameters": {"type": "object", "properties": {}}}}]}),
        Option("chat top_k 1 at T 0.7", c, {"temperature": 0.7, "top_k": 1}, greedy=True),
        Option("chat min_p 1 at T 1", c, {"temperature": 1.0, "min_p": 1.0}, greedy=True),
        Option("chat n 2 at T 0.8", c, {"temperature": 0.8, "n": 2}, sampled=True, expect=_n_choices),
        Option("chat top_k 40 at T 0.8, streamed", c, {"temperature": 0.8, "top_k": 40}, sampled=True, stream=True),
    ]


OPTIONS: list[Option] = _completions() + _chat()


# --- the fuzzer's draws -------------------------------------------------------------------------------------------

def random_request(rng: random.Random) -> tuple[str, dict]:
    """A random combination of valid options: each drawn on its own, so most requests combine several."""
    api = rng.choice(["completions", "completions", "chat"])
    body: dict = {"max_tokens": rng.choice([1, 2, 5, 8, 16, 24]), "temperature": rng.choice([0, 0, 0.3, 0.8, 1.0,
                                                                                            1.5])}
    if api == "completions":
        body["prompt"] = rng.choice([PROMPT, [PROMPT, "Once upon a time"], BATCH[: rng.randint(1, 10)],
                                     [rng.randrange(4, 4000) for _ in range(rng.randint(1, 40))]])
    else:
        body["messages"] = rng.choice([MESSAGES, [{"role": "system", "content": "Be brief."}, *MESSAGES]])

    def maybe(p: float, key: str, value) -> None:
        if rng.random() < p:
            body[key] = value() if callable(value) else value

    maybe(0.25, "top_k", lambda: rng.choice([-1, 0, 1, 2, 5, 50, 4096]))
    maybe(0.25, "top_p", lambda: rng.choice([1e-6, 0.3, 0.9, 1.0]))
    maybe(0.2, "min_p", lambda: rng.choice([0.0, 0.05, 0.3, 1.0]))
    maybe(0.3, "seed", lambda: rng.randrange(1 << 30))
    maybe(0.15, "n", lambda: rng.randint(1, 4))
    maybe(0.2, "logit_bias", lambda: {str(rng.randrange(4096)): rng.choice([-100, -5, -0.5, 0.5, 5, 100])
                                      for _ in range(rng.randint(1, 4))})
    maybe(0.2, "presence_penalty", lambda: rng.uniform(-2, 2))
    maybe(0.2, "frequency_penalty", lambda: rng.uniform(-2, 2))
    maybe(0.2, "repetition_penalty", lambda: rng.uniform(0.5, 2))
    maybe(0.15, "stop", lambda: rng.sample([" ", "\n", ".", "the", ","], rng.randint(1, 3)))
    maybe(0.1, "stop_token_ids", lambda: [rng.randrange(4096) for _ in range(rng.randint(1, 3))])
    maybe(0.2, "ignore_eos", True)
    maybe(0.1, "min_tokens", lambda: rng.randint(0, 12))
    maybe(0.1, "bad_words", lambda: rng.sample(["river", "the", "of", "a"], rng.randint(1, 2)))
    maybe(0.08, "allowed_token_ids", lambda: rng.sample(range(4096), rng.randint(1, 50)))
    maybe(0.1, "prompt_logprobs", lambda: rng.choice([0, 1, 3]))
    maybe(0.25, "return_token_ids", True)
    if api == "completions":
        maybe(0.2, "logprobs", lambda: rng.choice([0, 1, 5]))
        maybe(0.1, "echo", True)
    else:
        maybe(0.2, "logprobs", True)
        if body.get("logprobs"):
            maybe(0.7, "top_logprobs", lambda: rng.choice([0, 1, 5]))
    maybe(0.1, "response_format", lambda: rng.choice([{"type": "json_object"}, {"type": "text"}]))
    if "response_format" not in body:
        maybe(0.08, "structured_outputs", lambda: rng.choice([{"regex": "[a-z ]{1,12}"},
                                                              {"choice": ["yes", "no", "maybe"]}]))
    if rng.random() < 0.4:
        body["stream"] = True
        maybe(0.5, "stream_options", {"include_usage": True})
    return api, body
