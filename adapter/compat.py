"""The vLLM versions whose code the plugin's patches were read against: one list, one check for all of them.

On any other version a patch is not applied and says so, so an upgrade re-reads upstream instead of patching code
that has moved."""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm.kimi_eagle")  # under "vllm": its handlers and format

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def supported(feature: str) -> bool:
    """True on a version the patches were written for; otherwise logs that `feature` is not installed."""
    if vllm_version() in SUPPORTED_VLLM_VERSIONS:
        return True
    logger.warning("kimi-eagle: %s not installed: written against vLLM %s, found %s", feature,
                   SUPPORTED_VLLM_VERSIONS, vllm_version())
    return False
