"""One table of workload options: kimi-eagle's parser, Locust's parser and the runner's argv all come from it."""


from __future__ import annotations

import argparse

import pytest

from kimi_eagle.loadtest.workload import OPTIONS, Workload, add_workload_options, workload_argv, workload_from_options

CHANGED = Workload(url="http://127.0.0.1:1", engine="sglang", model="m", api="chat", stream=False, prompts="chat-long",
                   max_tokens=7, ignore_eos=False, temperature=0.5, seed=3, ttft_limit_ms=250.0, tpot_limit_ms=40.0,
                   logprob_token_counts=True, request_rate_per_s=2.0)


@pytest.mark.parametrize("unset", ["none", "empty"], ids=["kimi-eagle", "locust-form"])
@pytest.mark.parametrize("workload", [CHANGED, Workload(url="http://127.0.0.1:1")], ids=["changed", "defaults"])
def test_argv_and_parser_round_trip(workload: Workload, unset: str) -> None:
    parser = argparse.ArgumentParser()
    add_workload_options(parser, unset=unset)
    options = parser.parse_args(workload_argv(workload))
    back = workload_from_options(options, url=workload.url, engine=workload.engine,
                                 request_rate_per_s=workload.request_rate_per_s)
    assert back == workload


def test_every_field_a_client_sets_has_one_flag() -> None:
    commands_own = {"url", "engine", "request_rate_per_s", "request_timeout_s"}
    assert {o.field for o in OPTIONS} == set(Workload.model_fields) - commands_own
    assert len({o.flag for o in OPTIONS}) == len(OPTIONS)


def test_the_locust_form_reads_empty_as_not_given() -> None:
    parser = argparse.ArgumentParser()
    add_workload_options(parser, unset="empty")
    options = parser.parse_args([])
    assert (options.model, options.ttft_limit_ms) == ("", 0.0)
    workload = workload_from_options(options, url="http://h:1", engine="vllm", request_rate_per_s=None)
    assert workload.model is None and workload.ttft_limit_ms is None and workload.prompts == "completion-short"

