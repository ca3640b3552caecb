"""Every request option of the OpenAI completions and chat APIs, sent to a server with the draft and to the target
alone: on the default profile as `make serve` starts it (bfloat16, k=4 with its schedule, the fail-safe on) and on
the exactness profile. Each is kept (the same answer, or its effect where sampling decides) or refused by both.
The fuzzer (test_request_fuzz.py) draws combinations of the same options."""

from __future__ import annotations

import pytest

from tests.helpers.request_options import OPTIONS, Answer, Option, ask, check_option_kept
from tests.helpers.server import Server, greedy_ids

pytestmark = pytest.mark.e2e

PAIRS = {"default": ("default_server", "default_plain_server"), "exact": ("spec_server", "plain_server")}
# Each profile's tests run where its shared servers are (tests/conftest.py: SERVER_GROUPS).
PROFILES = [pytest.param(profile, marks=pytest.mark.xdist_group(profile)) for profile in PAIRS]


@pytest.fixture(scope="module")
def greedy_answers() -> dict[tuple[str, str], Answer]:
    """The base request's greedy answer per server and API: what options that ban or force a token start from."""
    return {}


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_request_option_is_kept_under_speculation(profile: str, option: Option, request: pytest.FixtureRequest,
                                                  greedy_answers: dict) -> None:
    spec, plain = (request.getfixturevalue(name) for name in PAIRS[profile])
    assert spec.model == plain.model
    outcome = check_option_kept(option, spec.url, plain.url, spec.model, greedy_answers)
    print(f"parity | {option.name} | {profile} | {outcome}")


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
