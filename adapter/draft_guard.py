"""Guards around vLLM's EAGLE-3 draft loading: every silent mismatch becomes a refusal that names its cause.

vLLM 0.32 loads an EAGLE-3 draft and runs it even when tensors load into nothing, parameters stay unfilled
(`Eagle3LlamaForCausalLM.load_weights` and the MLA class's `Eagle3DeepseekV2ForCausalLM.load_weights` return no
set of loaded names, so vLLM's own check never runs), or the aux layer ids it captures disagree with what the
draft's `fc` was sized for. Acceptance then collapses with no word in the log.

Each guard sits where both of vLLM's model runners pass, never in a runner's proposer: V1 (the CPU's runner, and
the GPU's before 0.32) loads the draft in `SpecDecodeBaseProposer.load_model`, V2 (every CUDA GPU from 0.32) in
`v1/worker/gpu/spec_decode/eagle/utils.py: load_eagle_model`, and each sets the target's capture its own way.
- the speculative config as vLLM builds it (`SpeculativeConfig.__post_init__`, API server and `kimi-eagle serve`'s
  validation alike): one set of aux ids, written where both runners and the compile key read them (V2 reads no
  `eagle_config` ids; ids written as strings are refused), and a target class that can capture aux states at all;
- the draft classes' `load_weights`: the static checks shared with `kimi-eagle doctor`, then every draft parameter
  is filled with a sentinel before loading, so one that nothing loaded is seen;
- the target's capture (where `set_aux_hidden_state_layers` ends: vLLM's `EagleModelMixin`, and DeepSeek-V2/V3's
  own setter, which Kimi-K2.5's wrapper calls): the layers the runner asks for must be the draft's;
- the draft's first `combine_hidden_states`: the width reaching `fc` (the seed's failure: one 7168-wide layer
  where `fc` was trained on 21504), and `embed_tokens` / `lm_head` either loaded or shared from the target.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kimi_eagle import envs
from kimi_eagle.adapter import compat, surface
from kimi_eagle.adapter.runners import model_runner
from kimi_eagle.checks.layout import DraftConfigError, default_aux_ids, layer_ids

logger = logging.getLogger("vllm.kimi_eagle")  # under "vllm": its handlers and format

SHARED_FROM_TARGET = ("embed_tokens", "lm_head")  # a draft may legitimately borrow these from the target
_SENTINEL_INT = -(2**62)


class DraftRefusedError(RuntimeError):
    """The draft cannot be served as configured; the message says what was found, expected, and the fix."""


# --- the speculative config as vLLM builds it ------------------------------------------------------------------
def _declared_ids(hf_config) -> tuple[list[int] | None, str]:
    """The draft's aux ids as V1 reads them (top level, else `eagle_config`), and where they were written."""
    try:
        top = layer_ids(getattr(hf_config, "eagle_aux_hidden_state_layer_ids", None))
        if top:
            return top, "top level"
        eagle_config = getattr(hf_config, "eagle_config", None)
        nested = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
        ids = layer_ids(nested, "eagle_config.eagle_aux_hidden_state_layer_ids")
        return ids, "eagle_config"
    except DraftConfigError as exc:
        raise DraftRefusedError(f"draft config: {exc}. Fix: {exc.fix}") from None


def align_aux_layer_ids(speculative_config) -> tuple[int, ...]:
    """Make the draft config's top-level aux ids the ids its `fc` is sized for, and return them.

    V1 reads the top level, else `eagle_config`; V2 and vLLM's compile key read only the top level, so a SpecForge
    draft (ids under `eagle_config` alone) on V2 had the target capture the model's default layers, silently."""
    hf_config = speculative_config.draft_model_config.hf_config
    ids, where = _declared_ids(hf_config)
    layers = speculative_config.target_model_config.get_total_num_hidden_layers()
    if not ids:
        ids = default_aux_ids(layers)
        logger.warning("kimi-eagle: the draft config names no aux layer ids; vLLM captures its default "
                       "(2, L//2, L-3) = %s for this %d-layer target, the rule speculators trains with by default. "
                       "If the draft was trained on other layers, set eagle_aux_hidden_state_layer_ids in its "
                       "config.json (`kimi-eagle doctor DRAFT --probe` measures which ids fit).", ids, layers)
    elif where == "eagle_config":
        logger.info("kimi-eagle: aux layer ids %s read from the draft's eagle_config and set at its top level, where "
                    "Model Runner V2 and the compile key read them", ids)
    if getattr(hf_config, "num_aux_hidden_states", None) not in (None, len(ids)):
        raise DraftRefusedError(f"draft config: num_aux_hidden_states={hf_config.num_aux_hidden_states} but "
                                f"{len(ids)} aux layer ids {list(ids)}: make them agree (fc is num_aux x hidden wide)")
    hf_config.eagle_aux_hidden_state_layer_ids = list(ids)
    hf_config.num_aux_hidden_states = len(ids)
    return tuple(ids)


def refuse_target_without_eagle3(speculative_config) -> None:
    """V1 and V2 each fail later with a RuntimeError of their own ("Model does not support EAGLE3 interface")."""
    from vllm.model_executor.model_loader.utils import get_model_cls
    from vllm.model_executor.models.interfaces import supports_eagle3

    target_config = speculative_config.target_model_config
    target_cls = get_model_cls(target_config)
    if not supports_eagle3(target_cls):
        raise DraftRefusedError(f"target class {target_cls.__name__} does not expose EAGLE-3 aux hidden states in "
                                f"vLLM {compat.vllm_version()}: serve it without the draft, or with a vLLM whose "
                                "model class implements SupportsEagle3")


def guard_speculative_config() -> None:
    def make(original):
        def post_init(self) -> None:
            original(self)
            if (self.method == "eagle3" and self.draft_model_config is not None
                    and self.target_model_config is not None):
                align_aux_layer_ids(self)
                refuse_target_without_eagle3(self)

        return post_init

    surface.wrap("vllm.config.speculative", "SpeculativeConfig.__post_init__", make)


# --- the draft classes' load_weights -----------------------------------------------------------------------------
def _eagle3_config():
    """The speculative config of the engine loading a model, when it is EAGLE-3's (both runners load under
    `set_current_vllm_config`)."""
    from vllm.config import get_current_vllm_config_or_none

    vllm_config = get_current_vllm_config_or_none()
    spec = getattr(vllm_config, "speculative_config", None)
    return vllm_config, (spec if getattr(spec, "method", None) == "eagle3" else None)


def run_static_checks(speculative_config) -> None:
    # Static checks read the draft's files; a draft that is not a local folder cannot be read, and the runtime
    # guards below must still hold (tests turn the static checks off to reach them).
    if not envs.static_checks():
        logger.warning("kimi-eagle: %s=0: static draft checks skipped", envs.STATIC_CHECKS.name)
        return
    from kimi_eagle.checks import Severity, refusal_message
    from kimi_eagle.checks import run_static_checks as static_checks

    draft_dir = Path(speculative_config.model or "")
    target_dir = Path(speculative_config.target_model_config.model or "")
    if not draft_dir.is_dir():
        logger.warning("kimi-eagle: draft %r is not a local folder; static draft checks skipped",
                       speculative_config.model)
        return
    findings = static_checks(draft_dir, target_dir if target_dir.is_dir() else None)
    for finding in findings:
        if finding.severity == Severity.WARNING and finding.applies_to("vllm"):
            logger.warning("kimi-eagle: %s: %s (expected %s). %s", finding.title, finding.found, finding.expected,
                           finding.fix)
    if message := refusal_message(findings, engine="vllm"):
        raise DraftRefusedError(message)


def _fill_with_sentinel(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan") if param.is_floating_point() else _SENTINEL_INT)


def _is_unfilled(param: torch.Tensor) -> bool:
    if param.numel() == 0:
        return False
    return bool(torch.isnan(param).all() if param.is_floating_point() else (param == _SENTINEL_INT).all())


def _unfilled(model: torch.nn.Module) -> list[str]:
    return [name for name, param in model.named_parameters() if _is_unfilled(param)]


def guard_weight_loading(module: str, attribute: str) -> None:
    """Wrap a draft class's `load_weights`: static checks, sentinel, refuse parameters nothing filled, then arm the
    first-step check."""

    def make(original):
        def load_weights(self, weights):
            vllm_config, spec = _eagle3_config()
            if spec is not None:
                run_static_checks(spec)
            _fill_with_sentinel(self)
            loaded = original(self, weights)
            missing = [n for n in _unfilled(self) if not any(part in n for part in SHARED_FROM_TARGET)]
            if missing:
                raise DraftRefusedError(
                    f"draft checkpoint leaves {len(missing)} parameter(s) unfilled: {', '.join(missing)}. vLLM "
                    "would run them as uninitialised memory and accept almost nothing. Expected every draft "
                    "parameter in the checkpoint (only embed_tokens and lm_head may be shared from the target). Fix "
                    "the checkpoint (re-save it with speculators), or run `kimi-eagle doctor DRAFT` for the key "
                    "table.")
            if spec is not None:
                ids = tuple(spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids)
                target_hidden = spec.target_model_config.get_hidden_size()
                check_first_step_width(self, ids, target_hidden)
                logger.info("kimi-eagle: draft guards active: aux layers %s, fc %d -> %d. vLLM %s, %s",
                            list(ids), len(ids) * target_hidden, self.config.hidden_size, compat.vllm_version(),
                            surface.coverage_line(model_runner(vllm_config)))
            return loaded

        return load_weights

    surface.wrap(module, attribute, make)


# --- the target's capture ------------------------------------------------------------------------------------------
# Where each runner's `model.set_aux_hidden_state_layers(ids)` ends: the mixin most EAGLE-3 targets share, and the
# DeepSeek-V2/V3 setter of its own that Kimi-K2.5's wrapper (`KimiK25ForConditionalGeneration`) delegates to.
CAPTURE_SETTERS = (("vllm.model_executor.models.interfaces", "EagleModelMixin._set_aux_hidden_state_layers"),
                   ("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM.set_aux_hidden_state_layers"))
DRAFT_CLASSES = (("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM.load_weights"),
                 ("vllm.model_executor.models.deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM.load_weights"))


def _refuse_other_capture(layers) -> None:
    _, spec = _eagle3_config()
    if spec is None:
        return
    draft_ids = tuple(getattr(spec.draft_model_config.hf_config, "eagle_aux_hidden_state_layer_ids", None) or ())
    if draft_ids and tuple(layers) != draft_ids:
        raise DraftRefusedError(
            f"the target was asked to capture aux layers {list(layers)}, but the draft's fc was sized for "
            f"{list(draft_ids)}: the draft would fuse the wrong layers and accept little. Write the ids the draft "
            "was trained on as eagle_aux_hidden_state_layer_ids at the top level of its config.json.")


def guard_aux_capture(module: str, attribute: str) -> None:
    """Wrap a target's capture setter: the layers a runner asks for must be those the draft's fc was sized for."""

    def make(original):
        capture = _with_fault_injection(original)

        def set_layers(self, layers) -> None:
            _refuse_other_capture(layers)
            capture(self, layers)

        return set_layers

    surface.wrap(module, attribute, make)


def _with_fault_injection(set_layers):
    """`KIMI_EAGLE_FAULT=aux-single-layer`: a target class that silently captures only the last of the layers it is
    asked for (the SGLang Kimi-K2.5 failure), below the capture guard, so that tests prove the first-step check
    names it on either runner. Read at each call (once per model load)."""

    def capture(self, layers) -> None:
        if envs.fault() == "aux-single-layer":
            logger.warning("kimi-eagle: FAULT INJECTION %s=aux-single-layer: target captures only layer %s",
                           envs.FAULT.name, list(layers)[-1:])
            layers = tuple(layers)[-1:]
        set_layers(self, layers)

    return capture


# --- the first draft step --------------------------------------------------------------------------------------------
def _capturing_cuda_graph() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_unshared(draft_model) -> None:
    """After loading, each runner shares `embed_tokens` / `lm_head` from the target where the draft has none; one
    still holding the sentinel was neither in the checkpoint nor shared."""
    for part in SHARED_FROM_TARGET:
        owner = getattr(draft_model, "model", draft_model) if part == "embed_tokens" else draft_model
        weight = getattr(getattr(owner, part, None), "weight", None)
        if weight is not None and weight.is_floating_point() and _is_unfilled(weight):
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
        if not _capturing_cuda_graph():  # reading a tensor's values would break a CUDA graph capture
            _refuse_unshared(draft_model)
        combined = type(draft_model).combine_hidden_states(draft_model, hidden_states)
        if combined.shape[-1] != draft_hidden:
            raise DraftRefusedError(f"fc was not applied: {combined.shape[-1]} wide after combine_hidden_states, "
                                    f"expected the draft hidden size {draft_hidden}")
        logger.info("kimi-eagle: first draft step checked: fc received %d = %d x %d (aux layers %s)",
                    width, len(ids), target_hidden, list(ids))
        return combined

    draft_model.combine_hidden_states = first_call


def install() -> bool:
    """Install every draft guard (vLLM 0.32, both model runners)."""
    if not compat.supported():
        return False
    guard_speculative_config()
    for module, attribute in DRAFT_CLASSES:  # the MLA draft class's load_weights returns nothing either
        guard_weight_loading(module, attribute)
    for module, attribute in CAPTURE_SETTERS:
        guard_aux_capture(module, attribute)
    return True
