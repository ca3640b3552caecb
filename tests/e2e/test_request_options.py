"""Every request option of the OpenAI completions and chat APIs, sent to a server with the draft and to the target
alone: on the default profile as `make serve` starts it (bfloat16, k=4 with its schedule, the fail-safe on) and on
the exactness profile. Each is kept (the same answer, or its effect where sampling decides) or refused by both.
The fuzzer (test_request_fuzz.py) draws combinations of the same options."""

from __future__ import annotations

import pytest

from tests.helpers.request_options import OPTIONS, Answer, Option, ask, base_request, differences
from tests.helpers.server import Server, greedy_ids

pytestmark = pytest.mark.e2e

PAIRS = {"default": ("default_server", "default_plain_server"), "exact": ("spec_server", "plain_server")}
# Each profile's tests run where its shared servers are (tests/conftest.py: SERVER_GROUPS).
PROFILES = [pytest.param(profile, marks=pytest.mark.xdist_group(profile)) for profile in PAIRS]


@pytest.fixture(scope="module")
def greedy_answers() -> dict[tuple[str, str], Answer]:
    """The base request's greedy answer per server and API: what options that ban or force a token start from."""
    return {}


def _greedy(server: Server, api: str, cache: dict[tuple[str, str], Answer]) -> Answer:
    if (server.url, api) not in cache:
        answer = ask(server.url, server.model, api, base_request(api))
        assert answer.status == 200, answer.error
        cache[server.url, api] = answer
    return cache[server.url, api]


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_request_option_is_kept_under_speculation(profile: str, option: Option, request: pytest.FixtureRequest,
                                                  greedy_answers: dict) -> None:
    spec, plain = (request.getfixturevalue(name) for name in PAIRS[profile])
    body = option.request(_greedy(plain, option.api, greedy_answers))
    with_draft = ask(spec.url, spec.model, option.api, body)
    alone = ask(plain.url, plain.model, option.api, body)
    assert with_draft.status < 500, f"{option.name}: the server with the draft failed: {with_draft.error}"
    assert with_draft.status == alone.status, (
        f"{option.name}: HTTP {with_draft.status} with the draft, {alone.status} for the target alone: "
        f"{with_draft.error or alone.error}")
    print(f"parity | {option.name} | {profile} | " + ("kept" if alone.status == 200 else
                                                      f"refused by both: {alone.status} {alone.error[:120]}"))
    if alone.status != 200:
        return  # refused by the target alone too: the same 4xx is the answer a client gets without speculation
    for name, answer in (("with the draft", with_draft), ("target alone", alone)):
        if option.expect and (broken := option.expect(answer, body)):
            pytest.fail(f"{option.name} ({name}): {broken}")
    if option.greedy:
        greedy = _greedy(spec, option.api, greedy_answers)
        assert with_draft.tokens() == greedy.tokens(), f"{option.name}: greedy by construction, yet not greedy"
    if not option.sampled:
        assert not (diff := differences(with_draft, alone)), f"{option.name}: " + "; ".join(diff)


def test_top_k_at_t08_leaves_the_default_server_serving(default_server: Server, default_plain_server: Server) -> None:
    """The request that took `make serve` down (a top-k at T > 0 reaching the rejection sampler on a step without
    draft tokens): answered, and the server's greedy answers are still the target alone's."""
    for top_k, temperature in ((50, 0.8), (1, 0.6)):
        answer = ask(default_server.url, default_server.model, "completions",
                     {"prompt": "The history of the river", "max_tokens": 32, "temperature": temperature,
                      "top_k": top_k})
        assert answer.status == 200, f"top_k {top_k} at T {temperature}: {answer.error}"
    assert greedy_ids(default_server.url, default_server.model) == greedy_ids(default_plain_server.url,
                                                                              default_plain_server.model)
