"""What vLLM 0.32 needs to serve an EAGLE-3 draft with an MLA layer (`Eagle3DeepseekV2ForCausalLM`, the layout of
lightseekorg/kimi-k2.5-eagle3-mla) as it is on disk.

- Every draft config goes through `SpeculativeConfig.hf_config_override`, written for MTP heads: a config with
  `model_type: deepseek_v3` becomes `deepseek_mtp` with `architectures: [DeepSeekMTPModel]`, and EAGLE-3 then asks
  for `Eagle3DeepSeekMTPModel`, which does not exist ("Model architectures ['Eagle3DeepSeekMTPModel'] are not
  supported"). An EAGLE-3 draft (its architecture says Eagle3) is left as it is.
- On CPU the drafter picks its attention backend on its own (`_create_draft_vllm_config`: "never inherit the
  attention backend"): where the CPU has AMX that is AMX_MLA, which cannot run float32 weights ("expect weight to
  be bfloat16 ..."), even when the target was told `--attention-backend CPU_MLA`. An MLA draft on CPU gets the
  backend the target was given.
"""

from __future__ import annotations

import logging

from kimi_eagle.adapter import compat, surface
from kimi_eagle.checks.layout import MLA_DRAFT_ARCHITECTURES

logger = logging.getLogger("vllm.kimi_eagle")  # under "vllm": its handlers and format


def is_eagle3_architecture(name: str) -> bool:
    """vLLM's own rule for a name that is already an EAGLE-3 draft class (`EAGLEConfig.__init__`)."""
    return name.startswith("Eagle3") or name.endswith("Eagle3")


def keep_eagle3_configs_apart_from_mtp() -> None:
    def make(original):
        def hf_config_override(hf_config):
            architectures = getattr(hf_config, "architectures", None) or [""]
            if is_eagle3_architecture(architectures[0]):
                return hf_config
            return original(hf_config)

        return hf_config_override

    # `surface.wrap` keeps the qualified name, so the draft ModelConfig that holds this override still pickles into
    # the engine process by reference.
    surface.wrap("vllm.config.speculative", "SpeculativeConfig.hf_config_override", make)


def is_mla_draft(speculative_config) -> bool:
    hf_config = speculative_config.draft_model_config.hf_config
    return any(a in MLA_DRAFT_ARCHITECTURES for a in getattr(hf_config, "architectures", None) or [])


def give_mla_drafts_the_targets_backend_on_cpu() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return

    def make(original):
        def _create_draft_vllm_config(self):
            spec = self.speculative_config
            target_backend = self.vllm_config.attention_config.backend
            if spec.attention_backend is None and target_backend is not None and is_mla_draft(spec):
                spec.attention_backend = target_backend
                logger.info("kimi-eagle: the MLA draft uses the target's attention backend %s (vLLM would pick its "
                            "own here)", target_backend.name)
            return original(self)

        return _create_draft_vllm_config

    surface.wrap("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._create_draft_vllm_config", make)


def install() -> bool:
    if not compat.supported():
        return False
    keep_eagle3_configs_apart_from_mtp()
    give_mla_drafts_the_targets_backend_on_cpu()
    return True
