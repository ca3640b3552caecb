"""On a CPU, vLLM inspects a model class in the process that asks, not in a child Python per architecture, and keeps
its answer in its own cache as before."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kimi_eagle.adapter import model_inspection


def test_a_first_inspection_runs_in_this_process_and_fills_vllms_cache(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.models import registry

    assert model_inspection.install()
    assert registry._run_in_subprocess(os.getpid) == os.getpid(), "inspected in a child Python"
    monkeypatch.setattr(registry._LazyRegisteredModel, "_get_cache_dir", staticmethod(lambda: tmp_path))
    kimi = registry.ModelRegistry.models["KimiK25ForConditionalGeneration"]
    info = kimi.inspect_model_cls()
    assert info.architecture == "KimiK25ForConditionalGeneration"
    assert info.is_text_generation_model and info.supports_multimodal
    assert (tmp_path / kimi._get_cache_filename()).is_file(), "vLLM's modelinfos cache was not written"


def test_a_gpu_keeps_vllms_child_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """There the child keeps CUDA out of the caller, which forks workers later."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    assert not model_inspection.install()
