"""The `vllm.general_plugins` entry point. vLLM calls it in every process it starts (API server, engine
core, workers), possibly more than once per process, so everything here is idempotent.

`KIMI_EAGLE_RUNTIME_CHECKS=0` turns off the draft guards, the acceptance alarm and the draft fail-safe (the CPU
fixes stay: without them the pair cannot run); `make bench` uses it to measure what the checks cost.
"""

from __future__ import annotations

from kimi_eagle import envs

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from kimi_eagle.processes import freeze_what_is_loaded

    freeze_what_is_loaded()  # first: vLLM has imported its modules, and loads plugins before any model
    from kimi_eagle.adapter import compat

    if not compat.supported():
        compat.log_unsupported()  # one ERROR, and nothing patched: code that moved is not patched blind
        return
    from kimi_eagle.adapter import (
        compile_cache,
        cpu_fixes,
        cpu_layout,
        draft_bypass,
        mla_draft,
        model_inspection,
        spec_sampling,
    )

    cpu_fixes.apply()
    spec_sampling.install()  # logit_bias and min_p under speculation, as the target alone applies them
    mla_draft.install()  # MLA drafts (lightseekorg/kimi-k2.5-eagle3-mla's layout) load as they are on disk
    cpu_layout.install()
    draft_bypass.install()  # steps with k=0 skip the draft; with the runtime checks on, the fail-safe too
    compile_cache.install()  # before any model is compiled: the key must see what the model captures
    model_inspection.install()  # on a CPU, no child Python per architecture on a first start
    if envs.runtime_checks():
        from kimi_eagle.adapter import acceptance_alarm, draft_guard

        draft_guard.install()
        acceptance_alarm.install()
    from kimi_eagle.adapter import surface

    surface.logger.info("kimi-eagle: vLLM %s: %s", compat.vllm_version(), surface.installed_summary())
