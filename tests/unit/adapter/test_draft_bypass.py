"""The draft fail-safe's decisions (`DraftBypass`), fed step by step as vLLM's scheduler feeds it."""

from __future__ import annotations

import logging

import pytest

from kimi_eagle.adapter.draft_bypass import REPORT_EVERY_S, RETRY_TIMEOUT_S, DraftBypass, State

K = 3


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def steps(bypass: DraftBypass, n: int, requests: int, accepted_per_draft: int) -> None:
    """`n` scheduler steps of `requests` drafts of K tokens each, every draft accepting the same number."""
    for _ in range(n):
        bypass.before_schedule()
        for r in range(requests):
            bypass.count_draft(f"req-{r}", K, accepted_per_draft)
        bypass.end_step()


def test_a_collapsed_draft_is_bypassed_once_a_window_is_full(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    bypass = DraftBypass(window_drafts=100, min_rate=0.05, retry_every_s=300, clock=clock)
    with caplog.at_level(logging.WARNING, logger="vllm.kimi_eagle"):
        steps(bypass, 24, 4, 0)  # 96 drafts: not yet a window
        assert bypass.drafting
        steps(bypass, 1, 4, 0)
    assert not bypass.drafting and bypass.state is State.BYPASSED
    assert caplog.text.count("DRAFT BYPASSED") == 1
    assert "0 of 300 drafted tokens accepted" in caplog.text and "kimi-eagle doctor" in caplog.text


def test_a_draft_that_pays_is_never_bypassed(clock: Clock) -> None:
    bypass = DraftBypass(window_drafts=100, min_rate=0.05, retry_every_s=300, clock=clock)
    steps(bypass, 500, 4, 1)  # 1 of 3 accepted: 33%
    assert bypass.drafting and bypass.bypasses == 0


def test_drafts_verified_after_the_switch_do_not_count_as_a_retry(clock: Clock) -> None:
    """The step after the switch still verifies drafts proposed before it: they must not end the bypass."""
    bypass = DraftBypass(window_drafts=10, min_rate=0.05, retry_every_s=300, clock=clock)
    steps(bypass, 5, 2, 0)
    assert not bypass.drafting
    steps(bypass, 20, 2, 3)  # drafts in flight, all accepted: still bypassed until the retry is due
    assert not bypass.drafting


def start_retry(bypass: DraftBypass, clock: Clock, after_s: float, new_requests: int = 2) -> None:
    clock.now += after_s
    bypass.before_schedule()
    assert bypass.state is State.RETRYING and bypass.drafting
    for r in range(new_requests):
        bypass.admitted(f"req-{r}")


def test_a_retry_resumes_drafting_when_acceptance_recovered(clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    bypass = DraftBypass(window_drafts=10, min_rate=0.05, retry_every_s=60, clock=clock)
    steps(bypass, 5, 2, 0)
    clock.now += 59
    steps(bypass, 1, 0, 0)
    assert not bypass.drafting
    start_retry(bypass, clock, 1)
    with caplog.at_level(logging.WARNING, logger="vllm.kimi_eagle"):
        steps(bypass, 5, 2, 2)
    assert bypass.state is State.DRAFTING and "speculation resumed" in caplog.text


def test_a_retry_judges_only_requests_admitted_after_it_began(clock: Clock) -> None:
    """Requests that ran through the bypass have holes in the draft's KV cache: their drafts would judge unfairly."""
    bypass = DraftBypass(window_drafts=10, min_rate=0.05, retry_every_s=60, clock=clock)
    steps(bypass, 5, 2, 0)
    start_retry(bypass, clock, 60, new_requests=0)
    steps(bypass, 50, 2, 0)  # only requests from before the retry: not counted
    assert bypass.state is State.RETRYING
    bypass.admitted("req-1")
    steps(bypass, 10, 2, 3)  # req-1 counts, req-0 does not
    assert bypass.state is State.DRAFTING


def test_a_retry_that_sees_no_new_requests_ends_bypassed(clock: Clock) -> None:
    bypass = DraftBypass(window_drafts=10, min_rate=0.05, retry_every_s=60, clock=clock)
    steps(bypass, 5, 2, 0)
    start_retry(bypass, clock, 60, new_requests=0)
    clock.now += RETRY_TIMEOUT_S
    steps(bypass, 1, 2, 3)
    assert bypass.state is State.BYPASSED and bypass.bypasses == 2


def test_a_failed_retry_bypasses_again_without_a_second_warning(clock: Clock,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    bypass = DraftBypass(window_drafts=10, min_rate=0.05, retry_every_s=60, clock=clock)
    with caplog.at_level(logging.INFO, logger="vllm.kimi_eagle"):
        steps(bypass, 5, 2, 0)
        start_retry(bypass, clock, 60)
        steps(bypass, 5, 2, 0)
    assert bypass.state is State.BYPASSED and bypass.bypasses == 2
    assert caplog.text.count("DRAFT BYPASSED") == 1 and "still bypassed" in caplog.text
    assert bypass.bypassed_at == clock.now  # the next retry counts from the failed one


def test_the_bypass_is_reported_on_the_switch_then_once_a_period(clock: Clock) -> None:
    bypass = DraftBypass(window_drafts=10, min_rate=0.05, retry_every_s=60, clock=clock)
    steps(bypass, 4, 2, 0)
    assert bypass.state is State.DRAFTING and not bypass.report_due()  # a drafting engine's own records say so
    steps(bypass, 1, 2, 0)
    assert bypass.state is State.BYPASSED
    assert bypass.report_due() and bypass.report_due()  # due until a step carried it
    bypass.reported()
    clock.now += REPORT_EVERY_S / 2
    assert not bypass.report_due()
    clock.now += REPORT_EVERY_S / 2
    assert bypass.report_due()
    bypass.reported()
    start_retry(bypass, clock, 60)
    assert not bypass.report_due()  # retrying: the retry's drafts set the gauge to 0
    steps(bypass, 5, 2, 0)
    assert bypass.state is State.BYPASSED and bypass.report_due()  # at once, not a period after the last report


def test_retry_zero_never_retries(clock: Clock) -> None:
    bypass = DraftBypass(window_drafts=10, min_rate=0.05, retry_every_s=0, clock=clock)
    steps(bypass, 5, 2, 0)
    clock.now += 10**6
    steps(bypass, 3, 0, 0)
    assert bypass.state is State.BYPASSED


@pytest.mark.parametrize("builder_class", ["SpecDecodeCPUMLAMetadataBuilder", "SpecDecodeAMXMLAMetadataBuilder"])
def test_a_plain_step_splits_its_batch_as_the_target_alone_and_gives_the_threshold_back(builder_class: str) -> None:
    """With a draft of k tokens, vLLM raises the target's MLA builder's decode threshold to 1 + k, and a uniform batch
    of one-token decodes then misses `split_decodes_and_prefills`' shortcut. A plain step builds with the builder
    class's own 1, the target alone's, and the next drafting step finds 1 + k again."""
    from types import SimpleNamespace

    from kimi_eagle.adapter import cpu_mla_spec_decode
    from kimi_eagle.adapter.draft_bypass import _as_the_target_alone

    target = object.__new__(getattr(cpu_mla_spec_decode, builder_class))  # the real class: its own threshold counts
    target.reorder_batch_threshold = 1 + K
    draft = SimpleNamespace(reorder_batch_threshold=1)
    spec = object()
    runner = SimpleNamespace(
        drafter=SimpleNamespace(_draft_attn_layer_names={"draft.attn"}), speculative_config=spec,
        attn_groups=[[SimpleNamespace(layer_names=["target.attn"], metadata_builders=[target]),
                      SimpleNamespace(layer_names=["draft.attn"], metadata_builders=[draft])]],
        kv_cache_config=SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["target.attn", "draft.attn"])]),
        input_batch=SimpleNamespace(block_table=SimpleNamespace()), reorder_batch_threshold=1 + K)
    for _ in range(2):  # the second step reuses what the first found
        with _as_the_target_alone(runner):
            assert (target.reorder_batch_threshold, runner.reorder_batch_threshold) == (1, 1)
            assert runner.speculative_config is None
            assert [[g.layer_names for g in kv] for kv in runner.attn_groups] == [[["target.attn"]]]
        assert (target.reorder_batch_threshold, runner.reorder_batch_threshold) == (1 + K, 1 + K)
        assert runner.speculative_config is spec and len(runner.attn_groups[0]) == 2
