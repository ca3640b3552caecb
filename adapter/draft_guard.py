"""Guards around vLLM's EAGLE-3 draft loading: every silent mismatch becomes a refusal that names its cause.

vLLM 0.32 loads an EAGLE-3 draft and runs it even when tensors load into nothing, parameters stay unfilled
(`Eagle3LlamaForCausalLM.load_weights` and the MLA class's `Eagle3DeepseekV2ForCausalLM.load_weights` return no
set of loaded names, so vLLM's own check never runs), or the aux layer ids it captures disagree with what the
draft's `fc` was sized for. Acceptance then collapses with no word in the log.
These guards wrap the proposer's `load_model`:
- before: the static checks shared with `kimi-eagle doctor` (refusals stop the engine), and one set of aux
  ids for both sides (vLLM sizes `fc` from `num_aux_hidden_states` but captures the top-level id list);
- during: every draft parameter is filled with a sentinel before loading, so one nothing loaded is seen;
- after: the target must expose aux hidden states, and the first draft step checks the width reaching `fc`.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kimi_eagle import envs
from kimi_eagle.adapter import compat
from kimi_eagle.adapter.checks.layout import default_aux_ids

logger = logging.getLogger("vllm.kimi_eagle")  # under "vllm": its handlers and format

SHARED_FROM_TARGET = ("embed_tokens", "lm_head")  # a draft may legitimately borrow these from the target
_SENTINEL_INT = -(2**62)


class DraftRefusedError(RuntimeError):
    """The draft cannot be served as configured; the message says what was found, expected, and the fix."""


def _draft_and_target_dirs(proposer) -> tuple[Path | None, Path | None]:
    draft = Path(proposer.speculative_config.model or "")
    target = Path(proposer.vllm_config.model_config.model or "")
    return (draft if draft.is_dir() else None), (target if target.is_dir() else None)


def run_static_checks(proposer) -> None:
    # Static checks read the draft's files; a draft that is not a local folder cannot be read, and the runtime
    # guards below must still hold (tests turn the static checks off to reach them).
    if not envs.static_checks():
        logger.warning("kimi-eagle: %s=0: static draft checks skipped", envs.STATIC_CHECKS.name)
        return
    from kimi_eagle.adapter.checks import Severity, refusal_message
    from kimi_eagle.adapter.checks import run_static_checks as static_checks

    draft_dir, target_dir = _draft_and_target_dirs(proposer)
    if draft_dir is None:
        logger.warning("kimi-eagle: draft %r is not a local folder; static draft checks skipped",
                       proposer.speculative_config.model)
        return
    findings = static_checks(draft_dir, target_dir)
    for finding in findings:
        if finding.severity == Severity.WARNING and finding.applies_to("vllm"):
            logger.warning("kimi-eagle: %s: %s (expected %s). %s", finding.title, finding.found, finding.expected,
                           finding.fix)
    if message := refusal_message(findings, engine="vllm"):
        raise DraftRefusedError(message)


def align_aux_layer_ids(proposer) -> tuple[int, ...]:
    """The ids the target will capture, made the ids the draft's `fc` is sized for. Returns them."""
    hf_config = proposer.speculative_config.draft_model_config.hf_config
    ids = getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None) or \
        (getattr(hf_config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    layers = proposer.vllm_config.model_config.get_total_num_hidden_layers()
    if not ids:
        ids = tuple(default_aux_ids(layers))
        logger.warning("kimi-eagle: the draft config names no aux layer ids; vLLM captures its default "
                       "(2, L//2, L-3) = %s for this %d-layer target, the rule speculators trains with by default. "
                       "If the draft was trained on other layers, set eagle_aux_hidden_state_layer_ids in its "
                       "config.json (`kimi-eagle doctor DRAFT --probe` measures which ids fit).", ids, layers)
    ids = tuple(ids)
    if getattr(hf_config, "num_aux_hidden_states", None) not in (None, len(ids)):
        raise DraftRefusedError(f"draft config: num_aux_hidden_states={hf_config.num_aux_hidden_states} but "
                           f"{len(ids)} aux layer ids {list(ids)}: make them agree (fc is num_aux x hidden wide)")
    hf_config.num_aux_hidden_states = len(ids)
    return ids


def _fill_with_sentinel(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan") if param.is_floating_point() else _SENTINEL_INT)


def _unfilled(model: torch.nn.Module) -> list[str]:
    missing = []
    for name, param in model.named_parameters():
        if param.numel() == 0:
            continue
        unfilled = torch.isnan(param).all() if param.is_floating_point() else (param == _SENTINEL_INT).all()
        if unfilled:
            missing.append(name)
    return missing


def guard_weight_loading(model_cls: type) -> None:
    """Wrap the draft class's `load_weights`: sentinel first, then refuse parameters nothing filled."""
    original = model_cls.load_weights
    if getattr(original, "_kimi_eagle_guarded", False):
        return

    def load_weights(self, weights):
        _fill_with_sentinel(self)
        loaded = original(self, weights)
        missing = [n for n in _unfilled(self) if not any(part in n for part in SHARED_FROM_TARGET)]
        if missing:
            raise DraftRefusedError(
                f"draft checkpoint leaves {len(missing)} parameter(s) unfilled: {', '.join(missing)}. vLLM would "
                "run them as uninitialised memory and accept almost nothing. Expected every draft parameter in the "
                "checkpoint (only embed_tokens and lm_head may be shared from the target). Fix the checkpoint "
                "(re-save it with speculators), or run `kimi-eagle doctor DRAFT` for the key table.")
        return loaded

    load_weights._kimi_eagle_guarded = True
    model_cls.load_weights = load_weights


def _shared_tensors_report(proposer, target_model) -> None:
    draft = proposer.model
    for part in SHARED_FROM_TARGET:
        owner = draft.model if part == "embed_tokens" else draft
        module = getattr(owner, part, None)
        weight = getattr(module, "weight", None)
        if weight is not None and weight.is_floating_point() and torch.isnan(weight).all():
            raise DraftRefusedError(f"draft {part} was neither in the checkpoint nor shared from the target: "
                               f"add {part}.weight to the draft checkpoint")


def check_first_step_width(draft_model, ids: tuple[int, ...], target_hidden: int) -> None:
    """Wrap `combine_hidden_states` on this instance for one call; afterwards the class method is used again,
    so the hot path after the first step runs exactly vLLM's code."""
    expected_in = len(ids) * target_hidden
    draft_hidden = draft_model.config.hidden_size

    def first_call(hidden_states: torch.Tensor) -> torch.Tensor:
        del draft_model.combine_hidden_states  # back to the class's method for every later step
        width = hidden_states.shape[-1]
        if width != expected_in:
            layers = width / target_hidden
            raise DraftRefusedError(
                f"the draft's fc expects {expected_in} = {len(ids)} aux layers {list(ids)} x hidden {target_hidden}, "
                f"but the target sent {width} ({layers:g} layer(s)): the target did not capture the aux hidden "
                "states the draft was trained on. Check that the target class supports EAGLE-3 aux outputs for "
                "these ids (`kimi-eagle doctor DRAFT --target TARGET`).")
        combined = type(draft_model).combine_hidden_states(draft_model, hidden_states)
        if combined.shape[-1] != draft_hidden:
            raise DraftRefusedError(f"fc was not applied: {combined.shape[-1]} wide after combine_hidden_states, "
                               f"expected the draft hidden size {draft_hidden}")
        logger.info("kimi-eagle: first draft step checked: fc received %d = %d x %d (aux layers %s)",
                    width, len(ids), target_hidden, list(ids))
        return combined

    draft_model.combine_hidden_states = first_call


def _inject_fault(target_model, ids: tuple[int, ...]) -> None:
    """Simulate a target class that does not forward the aux-layer capture (the SGLang Kimi-K2.5 failure):
    only the last layer is captured. Used by tests to prove the first-step check names it."""
    if envs.fault() != "aux-single-layer":
        return
    original = target_model.set_aux_hidden_state_layers

    def capture_one(layers: tuple[int, ...]) -> None:
        original(tuple(layers)[-1:])

    target_model.set_aux_hidden_state_layers = capture_one
    logger.warning("kimi-eagle: FAULT INJECTION %s=aux-single-layer: target captures only layer %s", envs.FAULT.name,
                   ids[-1:])


def install() -> bool:
    """Wrap the EAGLE proposer's `load_model` (vLLM 0.32: `SpecDecodeBaseProposer.load_model`)."""
    if not compat.supported("draft guards"):
        return False
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    original = SpecDecodeBaseProposer.load_model
    if getattr(original, "_kimi_eagle_guarded", False):
        return True
    guard_weight_loading(Eagle3LlamaForCausalLM)
    guard_weight_loading(Eagle3DeepseekV2ForCausalLM)  # the MLA draft class: its load_weights returns nothing

    def load_model(self, target_model) -> None:
        if self.method != "eagle3":
            return original(self, target_model)
        run_static_checks(self)
        ids = align_aux_layer_ids(self)
        if not supports_eagle3(target_model):
            raise DraftRefusedError(f"target class {type(target_model).__name__} does not expose EAGLE-3 aux hidden "
                               f"states in vLLM {compat.vllm_version()}: serve it without the draft, or with a vLLM "
                               "whose model class implements SupportsEagle3")
        original(self, target_model)
        _shared_tensors_report(self, target_model)
        target_hidden = self.vllm_config.model_config.get_hidden_size()
        check_first_step_width(self.model, ids, target_hidden)
        _inject_fault(target_model, ids)
        logger.info("kimi-eagle: draft guards active: aux layers %s, fc %d -> %d", list(ids),
                    len(ids) * target_hidden, self.model.config.hidden_size)

    load_model._kimi_eagle_guarded = True
    SpecDecodeBaseProposer.load_model = load_model
    return True
