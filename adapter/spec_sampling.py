"""`logit_bias` and `min_p` under speculation, applied exactly as the target alone applies them.

vLLM 0.32 refuses both when a draft is configured (`SamplingParams._validate_spec_decode`: 400) and, behind that
refusal, does not even build their logits processors (`build_logitsprocs` keeps only min-tokens with a speculative
config), so lifting the refusal alone would serve them silently ignored. Here:

- the engine builds vLLM's own built-in processors with a draft too, so the plain sampler (the bonus token, a
  step without draft tokens, a bypassed draft) applies them as it does without a draft;
- the verification of each draft position gets the same: the request's bias added to its rows before the
  penalties (the plain sampler's order: masks, bias, penalties) and the min-p filter after them, on the
  temperature-scaled probabilities and before top-k/top-p, as `Sampler.sample` does. The draft proposes what it
  likes; what the rejection sampler accepts and resamples is the target's biased, filtered distribution.

Only on the V1 model runner (the CPU runner, which has no Triton), the path these patches were read against;
elsewhere the refusal stays and says that `--no-draft` serves the parameter.
"""

from __future__ import annotations

import torch

from kimi_eagle.adapter import compat, surface

NO_DRAFT_HINT = ("this server speculates with a draft, and this vLLM cannot apply {names} exactly under speculation; "
                 "`kimi-eagle serve PROFILE --no-draft` serves the target alone, which applies {them}")


def applies_here() -> bool:
    """The patched path is the V1 runner's, which vLLM's CPU platform uses when Triton has no CPU backend."""
    from vllm import envs
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    return (current_platform.is_cpu() and compat.supported()
            and not HAS_TRITON and envs.VLLM_USE_V2_MODEL_RUNNER is not True)


def _builtin_processor(sampling_metadata, cls):
    for processor in sampling_metadata.logitsprocs.all:
        if isinstance(processor, cls):
            return processor
    return None


def _request_rows(num_draft_tokens: list[int]) -> list[range]:
    """The rows of the verification logits each request owns, in batch order."""
    rows, start = [], 0
    for n in num_draft_tokens:
        rows.append(range(start, start + n))
        start += n
    return rows


def add_logit_bias(logits: torch.Tensor, biases: dict[int, dict[int, float]], num_draft_tokens: list[int]) -> None:
    """Each request's `logit_bias` on each of its draft positions (in place)."""
    request_rows = _request_rows(num_draft_tokens)
    rows, token_ids, values = [], [], []
    for batch_index, bias in biases.items():
        for row in request_rows[batch_index]:
            rows.extend([row] * len(bias))
            token_ids.extend(bias.keys())
            values.extend(bias.values())
    if rows:
        index = (torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor,
                 num_draft_tokens: list[int]) -> None:
    """vLLM's `MinPLogitsProcessor` on the draft positions (in place): a token whose probability at the request's
    temperature is below `min_p` times the top one is masked. Computed on logits / T as the plain sampler does,
    so the same tokens go; masking the unscaled logits leaves the temperature to `apply_sampling_constraints`."""
    counts = torch.tensor(num_draft_tokens, device=logits.device)
    row_min_p = torch.repeat_interleave(min_p.reshape(-1)[: counts.numel()], counts)
    keep_all = row_min_p <= 0
    if bool(keep_all.all()):
        return
    row_temperature = torch.repeat_interleave(temperature[: counts.numel()], counts)
    row_temperature = torch.where(row_temperature < 1e-5, 1.0, row_temperature)  # greedy rows: argmax, kept
    probs = torch.softmax(logits / row_temperature.unsqueeze(1), dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * row_min_p.unsqueeze(1)
    logits.masked_fill_((probs < threshold) & ~keep_all.unsqueeze(1), float("-inf"))


def _build_logitsprocs(upstream):
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        if vllm_config.speculative_config is None or is_pooling_model or custom_logitsprocs:
            return upstream(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    return build_logitsprocs


def _apply_logits_processors(upstream):
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        bias = _builtin_processor(sampling_metadata, LogitBiasLogitsProcessor)
        if bias is not None and bias.biases:
            add_logit_bias(logits, bias.biases, metadata.num_draft_tokens)
        logits = upstream(self, logits, sampling_metadata, metadata)
        min_p = _builtin_processor(sampling_metadata, MinPLogitsProcessor)
        if min_p is not None and min_p.min_p_count and not sampling_metadata.all_greedy:
            filter_min_p(logits, min_p.min_p, sampling_metadata.temperature, metadata.num_draft_tokens)
        return logits

    return apply_logits_processors


def _validate_spec_decode(upstream, lifted: bool):
    def validate_spec_decode(self, speculative_config) -> None:
        if lifted:
            return
        from vllm.exceptions import VLLMValidationError

        try:
            upstream(self, speculative_config)
        except VLLMValidationError:
            names = [name for name, on in (("min_p", self.min_p > 1e-5), ("logit_bias", bool(self.logit_bias))) if on]
            raise VLLMValidationError(
                f"{' and '.join(names)}: " + NO_DRAFT_HINT.format(names=" and ".join(names),
                                                                  them="them" if len(names) > 1 else "it"),
                parameter=names[0] if names else None) from None

    return validate_spec_decode


def install() -> bool:
    """Every process: the API server validates requests, the worker samples. Returns whether the parameters are
    served under speculation here (otherwise they are refused with the `--no-draft` hint)."""
    if not compat.supported():
        return False
    lifted = applies_here()
    surface.wrap("vllm.sampling_params", "SamplingParams._validate_spec_decode",
                 lambda upstream: _validate_spec_decode(upstream, lifted))
    if not lifted:
        return False
    surface.wrap("vllm.v1.worker.gpu_model_runner", "build_logitsprocs", _build_logitsprocs)
    surface.wrap("vllm.v1.sample.rejection_sampler", "RejectionSampler.apply_logits_processors",
                 _apply_logits_processors)
    return True
