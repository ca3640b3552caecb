"""logit_bias and min_p under speculation: each draft position gets what vLLM's own processors give the target
alone's row (checked against those processors), and a request that cannot be served so says that `--no-draft` can."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kimi_eagle.adapter import spec_sampling, surface


def _min_p_processor(min_p: list[float]):
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8))
    processor = MinPLogitsProcessor(config, torch.device("cpu"), False)
    processor.min_p = torch.tensor(min_p).unsqueeze(1)
    processor.min_p_count = sum(1 for p in min_p if p > 0)
    return processor


def test_min_p_on_draft_positions_masks_what_vllms_processor_masks_on_the_plain_row() -> None:
    torch.manual_seed(0)
    min_p, temperature, num_draft_tokens = [0.3, 0.0, 0.05], torch.tensor([0.7, 1.0, 1.5]), [2, 3, 1]
    logits = torch.randn(6, 64) * 3
    rows = torch.repeat_interleave(torch.arange(3), torch.tensor(num_draft_tokens))
    # The target alone: each row scaled by its request's temperature, then vLLM's processor with that min_p.
    expected = torch.cat([_min_p_processor([min_p[r]] * n).apply(logits[rows == r] / temperature[r])
                          for r, n in enumerate(num_draft_tokens)])

    filtered = logits.clone()
    spec_sampling.filter_min_p(filtered, torch.tensor(min_p).unsqueeze(1), temperature, num_draft_tokens)
    assert torch.equal(torch.isinf(filtered), torch.isinf(expected)), "min_p masked other tokens than vLLM's own"
    assert torch.isinf(filtered[:2]).any() and not torch.isinf(filtered[2:5]).any(), "min_p 0 must mask nothing"
    kept = ~torch.isinf(filtered)
    assert torch.equal(filtered[kept], logits[kept]), "min_p must leave the kept logits unscaled"


def test_logit_bias_lands_on_every_draft_position_of_its_request_only() -> None:
    logits = torch.zeros(6, 16)
    spec_sampling.add_logit_bias(logits, {0: {3: 5.0}, 2: {7: -100.0, 1: 2.0}}, [2, 3, 1])
    assert logits[0:2, 3].tolist() == [5.0, 5.0] and logits[0:2].sum() == 10.0
    assert not logits[2:5].any(), "request 1 asked for no bias"
    assert logits[5, 7] == -100.0 and logits[5, 1] == 2.0


def test_a_request_without_draft_tokens_this_step_gets_no_rows() -> None:
    logits = torch.zeros(1, 16)
    spec_sampling.add_logit_bias(logits, {0: {3: 5.0}, 1: {4: 1.0}}, [0, 1])
    assert logits[0, 4] == 1.0 and logits.sum() == 1.0


def test_the_engine_builds_vllms_own_processors_with_a_draft() -> None:
    """vLLM 0.32 builds only min-tokens when a draft is configured: logit_bias and min_p would be dropped."""
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

    config = SimpleNamespace(speculative_config=object(), scheduler_config=SimpleNamespace(max_num_seqs=4))
    upstream = {type(p) for p in build_logitsprocs(config, torch.device("cpu"), False, False).all}
    assert LogitBiasLogitsProcessor not in upstream, "upstream builds logit_bias with a draft now: drop the patch"
    built = {type(p) for p in spec_sampling._build_logitsprocs(build_logitsprocs)(
        config, torch.device("cpu"), False, False).all}
    assert {LogitBiasLogitsProcessor, MinPLogitsProcessor} <= built


@pytest.mark.parametrize("lifted", [False, True])
def test_refusal_names_the_parameter_and_no_draft_or_is_lifted(lifted: bool) -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    upstream = surface.original_of(SamplingParams._validate_spec_decode)  # the plugin may be installed here
    validate = spec_sampling._validate_spec_decode(upstream, lifted)
    params = SamplingParams(temperature=0.8, min_p=0.1)
    if lifted:
        validate(params, object())
        return
    with pytest.raises(VLLMValidationError, match=r"min_p.*--no-draft"):
        validate(params, object())
