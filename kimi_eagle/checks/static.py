"""The static checks, one function each: every fault of a draft (and of the draft against its target), before serving.
`diagnosis.py` runs them all and gathers the report."""

from __future__ import annotations

import difflib
from collections import defaultdict

from kimi_eagle.checks import engines as eng
from kimi_eagle.checks.checkpoint import INDEX_NAME, Checkpoint, CheckpointError, TensorInfo, load_numpy, same_bytes
from kimi_eagle.checks.findings import Finding, Severity, finding, listing
from kimi_eagle.checks.layout import (
    MLA_DRAFT_ARCHITECTURES,
    MLA_MODEL_TYPES,
    SGLANG_MLA_ARCHITECTURE,
    DraftSpec,
    TargetSpec,
)


def checkpoint_name(param: str, shard: object) -> str:
    """The speculators checkpoint name that fills (param, shard): the inverse of the engines' mapping."""
    name = param.removeprefix("model.")
    if name == "draft_id_to_target_id":
        return "d2t"
    if shard in ("q_a", "kv_a"):
        name = name.replace("fused_qkv_a_proj", {"q_a": "q_a_proj", "kv_a": "kv_a_proj_with_mqa"}[shard])
    elif shard in ("q", "k", "v"):
        name = name.replace("qkv_proj", f"{shard}_proj")
    elif shard in (0, 1):
        name = name.replace("gate_up_proj", ("gate_proj", "up_proj")[shard])
    return name


class Context:
    """What the checks share: the draft, the target (if any) and the engines' models of the draft."""

    def __init__(self, draft: Checkpoint, spec: DraftSpec, target: TargetSpec | None) -> None:
        self.draft, self.spec, self.target = draft, spec, target
        self.target_vocab = target.vocab_size if target else spec.vocab_size
        self.target_hidden = target.hidden_size if target else spec.target_hidden_size
        self.models = {"vllm": eng.vllm_model(spec, self.target_vocab),
                       "sglang": eng.sglang_model(spec, self.target_vocab)}
        has_d2t = any("d2t" in k for k in draft.tensors)
        self.fates = {
            name: {"vllm": eng.vllm_fate(name, spec, self.models["vllm"], has_d2t),
                   "sglang": eng.sglang_fate(name, spec, self.models["sglang"])}
            for name in sorted(draft.tensors)
        }

    def expected_names(self, engine: str) -> list[str]:
        return [checkpoint_name(p.name, s) for p in self.models[engine].params.values() for s in p.shards]


def suggest(name: str, expected: list[str]) -> str:
    if name.endswith(".bias"):
        return (f"{name}: the engine builds no bias here; if the draft was trained with biases set attention_bias "
                "/ mlp_bias in its layer config, else delete the tensor")
    for prefix in ("model.", "decoder.", "draft.", "eagle.", "module.", "draft_model."):
        if name.startswith(prefix) and name.removeprefix(prefix) in expected:
            return f"{name} -> {name.removeprefix(prefix)} (drop the '{prefix}' prefix)"
    close = difflib.get_close_matches(name, expected, n=1, cutoff=0.75)
    return f"{name} -> {close[0]}?" if close else f"{name}: no close match"


def check_keys(ctx: Context) -> list[Finding]:
    out = []
    for engine in eng.ENGINES:
        label = eng.ENGINE_LABELS[engine]
        bad = {n: f[engine] for n, f in ctx.fates.items() if f[engine].status in ("dropped", "load-error")}
        if bad:
            expected = ctx.expected_names(engine)
            silent = sum(f.status == "dropped" for f in bad.values())
            out.append(finding(
                "unloaded-tensor", Severity.REFUSAL,
                f"{len(bad)} checkpoint tensor(s) load into nothing in {label}",
                listing([f"{n} ({f.note})" for n, f in bad.items()])
                + (f"; {silent} of them dropped silently" if silent else ""),
                f"names the engine maps onto its parameters, e.g. {listing(expected[:3])}",
                "per tensor: " + listing([suggest(n, expected) for n in bad]), engine))
        targets = defaultdict(list)
        for n, f in ctx.fates.items():
            if f[engine].fills:
                targets[(f[engine].param, f[engine].shard)].append(n)
        clashes = {k: v for k, v in targets.items() if len(v) > 1}
        if clashes:
            out.append(finding(
                "duplicate-tensor", Severity.REFUSAL, f"several tensors fill the same {label} parameter",
                listing([" and ".join(v) + f" -> {p}" for (p, _), v in clashes.items()]),
                "one tensor per parameter (both `layers.0.*` and `midlayer.*` are accepted, not both at once)",
                "delete the stale copy from the checkpoint", engine))
        out.extend(_unfilled(ctx, engine, targets))
    return out


def _unfilled(ctx: Context, engine: str, targets: dict) -> list[Finding]:
    label, spec, target = eng.ENGINE_LABELS[engine], ctx.spec, ctx.target
    missing, shared, unshareable = [], [], []
    for param in ctx.models[engine].params.values():
        if param.name == "draft_id_to_target_id" or not param.needed:
            continue  # the vocabulary check reports a missing d2t with its own reasons
        for shard in param.shards:
            if (param.name, shard) in targets:
                continue
            what = param.name + (f" ({shard} shard)" if shard is not None else "")
            if not param.shareable:
                missing.append(f"{what} <- {checkpoint_name(param.name, shard)} absent")
            elif "embed_tokens" in param.name and target and target.hidden_size != spec.hidden_size:
                unshareable.append(f"{what}: the target's embeddings are {target.hidden_size} wide, "
                                   f"the draft's {spec.hidden_size}")
            elif "lm_head" in param.name and target and (spec.draft_vocab_size != target.vocab_size
                                                          or target.hidden_size != spec.hidden_size):
                unshareable.append(f"{what}: the target's head has {target.vocab_size} rows of width "
                                   f"{target.hidden_size}, the draft needs {spec.draft_vocab_size} "
                                   f"of {spec.hidden_size}")
            else:
                shared.append(what)
    out = []
    if missing:
        out.append(finding(
            "unfilled-parameter", Severity.REFUSAL, f"{len(missing)} draft parameter(s) nothing fills in {label}",
            listing(missing),
            "every parameter but embeddings and lm_head in the checkpoint (the engine would run them "
            "uninitialised, without an error)",
            "re-export the draft with all of its tensors (speculators' save_pretrained writes them all)", engine))
    if unshareable:
        out.append(finding(
            "unshareable-missing", Severity.REFUSAL,
            f"a missing tensor cannot be taken from the target in {label}",
            listing(unshareable), "the draft's own tensor when its shape differs from the target's",
            "export the draft's embed_tokens / lm_head with it", engine))
    if shared:
        out.append(finding(
            "shared-from-target", Severity.INFO, "shared from the target",
            listing(shared) + " absent from the draft", "nothing: the engine uses the target's tensor",
            "nothing to do", engine))
    return out


def check_shapes(ctx: Context) -> list[Finding]:
    out = []
    spec = ctx.spec
    for engine in eng.ENGINES:
        model = ctx.models[engine]
        for name, fates in ctx.fates.items():
            fate = fates[engine]
            if not fate.fills or fate.param == "draft_id_to_target_id":
                continue  # d2t: the vocabulary check says more
            have = ctx.draft.tensors[name].shape
            want = model.params[fate.param].shards[fate.shard]
            if have == want:
                continue
            if fate.param == "model.fc.weight":
                n_aux = want[1] // spec.target_hidden_size
                out.append(finding(
                    "fc-width", Severity.REFUSAL, "fc does not fit the aux states the engine feeds it",
                    f"{name} {list(have)}: input {have[1]} = {have[1] / ctx.target_hidden:g} x target hidden "
                    f"{ctx.target_hidden}",
                    f"[{spec.hidden_size}, {want[1]}] = {n_aux} aux states x {spec.target_hidden_size}",
                    "the fc width, the number of aux ids and the target's hidden size must agree: retrain or "
                    "fix the config's aux ids / target_hidden_size", engine))
            elif ".qkv_proj.weight" in fate.param and have[1] != want[1]:
                out.append(finding(
                    "qkv-width", Severity.REFUSAL, f"{name} has the wrong input width",
                    f"{list(have)} (input {have[1]})",
                    f"{list(want)}: input 2 x hidden ({want[1]}) for the first layer (embedding and hidden "
                    "concatenated)", "the draft is not an EAGLE-3 layer of this hidden size: check hidden_size "
                    "in the config", engine))
            elif fate.param == "lm_head.weight":
                out.append(finding(
                    "lm-head-rows", Severity.REFUSAL, "lm_head does not match draft_vocab_size",
                    f"{name} {list(have)}", f"[{spec.draft_vocab_size}, {spec.hidden_size}] "
                    f"(draft_vocab_size {spec.draft_vocab_size})",
                    "set draft_vocab_size to lm_head's row count, or export the matching lm_head", engine))
            else:
                out.append(finding(
                    "tensor-shape", Severity.REFUSAL, f"{name} has the wrong shape",
                    f"{list(have)}", f"{list(want)} from the config",
                    "the config does not describe this checkpoint: fix hidden/intermediate sizes or heads",
                    engine))
    return out


def check_hidden(ctx: Context) -> list[Finding]:
    spec, target = ctx.spec, ctx.target
    if target is None or spec.target_hidden_size == target.hidden_size:
        return []
    source = "target_hidden_size" if spec.declared_target_hidden_size else "hidden_size (no target_hidden_size)"
    return [finding("hidden-size", Severity.REFUSAL, "the draft expects a target of another hidden size",
                    f"draft {source} = {spec.target_hidden_size}", f"the target's hidden size {target.hidden_size}",
                    "this draft was trained for another target: use a draft trained on this one")]


def _fc_states(ctx: Context) -> int | None:
    fc = next((i for n, i in ctx.draft.tensors.items() if n.removeprefix("model.") == "fc.weight"), None)
    if fc is None or len(fc.shape) != 2 or ctx.target_hidden == 0 or fc.shape[1] % ctx.target_hidden:
        return None
    return fc.shape[1] // ctx.target_hidden


def _ids_places(spec: DraftSpec) -> list[tuple[str, list[int]]]:
    """Every place of the config that holds aux ids, named as a user finds it in config.json."""
    if spec.format == "speculators":
        places = [("the top level (or transformer_layer_config)", spec.top_level_ids),
                  ("transformer_layer_config.eagle_config", spec.eagle_config_ids),
                  ("the top-level eagle_config", spec.unread_ids)]
    else:
        places = [("the top level", spec.top_level_ids), ("eagle_config", spec.eagle_config_ids)]
    return [(where, ids) for where, ids in places if ids]


def _ids_disagree(spec: DraftSpec) -> list[Finding]:
    places = _ids_places(spec)
    if len({tuple(ids) for _, ids in places}) < 2:
        return []
    engines = {"vLLM 0.32": spec.vllm_target_ids, "SGLang 0.5.23": spec.sglang_ids}
    reads = "; ".join(f"{engine} captures {ids if ids else 'its default layers'}" for engine, ids in engines.items())
    return [finding("aux-ids-disagree", Severity.WARNING, "the config's aux layer ids disagree between places",
                    "; ".join(f"{ids} under {where}" for where, ids in places),
                    f"one set of ids wherever they are written ({reads})",
                    "write the ids the draft was trained with in every place (the training run's config says "
                    "which); an engine that reads another place captures other layers and accepts little")]


def check_aux_ids(ctx: Context) -> list[Finding]:
    spec, target = ctx.spec, ctx.target
    out: list[Finding] = _ids_disagree(spec)
    declared = spec.declared_ids
    fc_states = _fc_states(ctx)
    if declared:
        if len(set(declared)) != len(declared):
            out.append(finding("aux-ids-duplicate", Severity.REFUSAL, "an aux layer id is repeated",
                               f"eagle_aux_hidden_state_layer_ids {declared}", "distinct layer ids",
                               "use the ids the draft was trained with (speculators: [2, N//2, N-3])"))
        if fc_states is not None and len(declared) != fc_states:
            out.append(finding("aux-ids-count", Severity.REFUSAL, "the number of aux ids does not match fc",
                               f"{len(declared)} ids {declared}; fc takes {fc_states} x {ctx.target_hidden}",
                               f"{fc_states} id(s)", "give exactly the ids the draft was trained with"))
        if len(declared) != spec.vllm_fc_count and spec.vllm_target_ids:
            out.append(finding("aux-ids-count", Severity.REFUSAL, "vLLM sizes fc for another number of aux states",
                               f"{len(declared)} ids, but vLLM builds fc for {spec.vllm_fc_count} (it reads "
                               "num_aux_hidden_states or eagle_config's ids, else 3)",
                               f"{len(declared)} aux states in fc", "set num_aux_hidden_states in the layer config",
                               "vllm"))
    if target is None:
        return out
    n = target.num_layers
    default = target.default_aux_ids
    if declared:
        bad = [i for i in declared if not 0 <= i <= n]
        if bad:
            out.append(finding("aux-ids-range", Severity.REFUSAL, "aux layer ids outside the target's layers",
                               f"ids {bad} for a target with {n} layers",
                               f"0..{n} (i < {n}: the input of layer i; {n}: the final pre-norm state)",
                               "use ids of this target (speculators' default for it: "
                               f"{default}); a draft trained on a deeper model does not fit this one"))
    if not declared:
        out.append(finding("aux-ids-missing", Severity.WARNING, "the draft does not say which target layers it reads",
                           "no eagle_aux_hidden_state_layer_ids (top level or eagle_config)",
                           f"explicit ids; vLLM will silently use (2, L//2, L-3) = {tuple(default)} for L = {n}, "
                           "the rule speculators trains with by default",
                           f"add \"eagle_aux_hidden_state_layer_ids\": {default} to config.json if that is what the "
                           "draft was trained with"))
    elif spec.unread_ids and not spec.vllm_target_ids:
        same = spec.unread_ids == default
        out.append(finding("aux-ids-unread", Severity.INFO if same else Severity.REFUSAL,
                           "vLLM does not read where the aux ids are written",
                           f"ids {spec.unread_ids} only under the top-level eagle_config of a speculators config",
                           f"the top-level eagle_aux_hidden_state_layer_ids; vLLM uses {tuple(default)} instead"
                           + (" (the same ids)" if same else ""),
                           f"move them to \"eagle_aux_hidden_state_layer_ids\": {spec.unread_ids}", "vllm"))
    out.extend(_sglang_aux(ctx, declared, default))
    return out


def _sglang_aux(ctx: Context, declared: list[int] | None, default: list[int]) -> list[Finding]:
    spec = ctx.spec
    out = []
    if spec.format == "speculators":
        out.append(finding("sglang-config-format", Severity.INFO, "SGLang reads flat configs only",
                           "a speculators-format config (SGLang 0.5.23: 'Unrecognized model ... model_type')",
                           "a flat view: architectures [LlamaForCausalLMEagle3], the layer fields, draft_vocab_size "
                           "and the ids under eagle_config; the SGLang results here assume that view",
                           "serve SGLang through a flat view of this draft (kimi-eagle writes one)", "sglang"))
    elif declared and not spec.eagle_config_ids:
        same = declared == default
        out.append(finding("aux-ids-ignored", Severity.INFO if same else Severity.REFUSAL,
                           "SGLang ignores the top-level aux ids",
                           f"ids {declared} at the top level only", f"eagle_config.eagle_aux_hidden_state_layer_ids; "
                           f"SGLang falls back to {default}" + (" (the same ids)" if same else ""),
                           f"add \"eagle_config\": {{\"eagle_aux_hidden_state_layer_ids\": {declared}}}", "sglang"))
    ids = spec.sglang_ids
    if ids and ids[0] == 1:
        out.append(finding("aux-ids-shifted", Severity.WARNING, "SGLang shifts ids that start at 1",
                           f"ids {ids}", f"SGLang captures {[i + 1 for i in ids]} (it adds 1 when the first id is 1)",
                           "check which convention the draft was trained with", "sglang"))
    return out


def _load_vocab_map(info: TensorInfo, out: list[Finding]):
    """d2t or t2d as an array; None, with the same refusal as the weight-health check, when its file cannot be read
    (truncated, header edited): a damaged file is a finding, not a traceback."""
    try:
        return load_numpy(info)
    except (CheckpointError, OSError) as exc:
        out.append(finding("weights-unreadable", Severity.REFUSAL, f"{info.name} cannot be read",
                           f"{info.file.name}: {exc}", "a complete safetensors file",
                           "the file is truncated or corrupt: download or export it again"))
        return None


def check_vocab(ctx: Context) -> list[Finding]:
    spec = ctx.spec
    v, dv = ctx.target_vocab, spec.draft_vocab_size
    out = []
    if ctx.target and spec.vocab_size != v:
        out.append(finding("vocab-size", Severity.REFUSAL, "the draft's vocab_size differs from the target's",
                           f"transformer config vocab_size {spec.vocab_size}", f"the target's {v}",
                           "set the draft layer's vocab_size to the target's (it sizes the embedding and the logits)"))
    tensors = {n.removeprefix("model.").rsplit(".", 1)[-1]: i for n, i in ctx.draft.tensors.items()
               if n.endswith(("d2t", "t2d"))}
    d2t_info, t2d_info = tensors.get("d2t"), tensors.get("t2d")
    if dv != v and d2t_info is None:
        out.append(finding("vocab-mapping-missing", Severity.REFUSAL,
                           "draft vocabulary without a mapping to the target's",
                           f"draft_vocab_size {dv}, target vocab {v}, no d2t tensor",
                           "d2t [draft vocab] (target id = draft id + d2t[id])",
                           "export d2t (and t2d) with the draft; without it vLLM maps draft id i to target id i"))
    d2t = _load_vocab_map(d2t_info, out) if d2t_info is not None else None
    if d2t is None:
        return out
    d2t = d2t.astype("int64")
    import numpy as np

    if d2t.shape != (dv,):
        out.append(finding("d2t-length", Severity.REFUSAL, "d2t does not cover the draft vocabulary",
                           f"d2t shape {list(d2t.shape)}", f"[{dv}] (draft_vocab_size)",
                           "export d2t from the same training run as lm_head"))
        return out
    targets = np.arange(dv) + d2t
    bad = np.flatnonzero((targets < 0) | (targets >= v))
    if bad.size:
        out.append(finding("d2t-range", Severity.REFUSAL, "d2t maps draft ids outside the target vocabulary",
                           f"{bad.size} draft ids, e.g. {bad[0]} -> {targets[bad[0]]}", f"target ids in 0..{v - 1}",
                           "d2t holds offsets (target = draft + d2t), not target ids: re-export it"))
    if np.unique(targets).size != dv:
        out.append(finding("d2t-duplicates", Severity.WARNING, "d2t maps several draft ids to one target id",
                           f"{dv - np.unique(targets).size} collisions", "a one-to-one mapping",
                           "re-export d2t: colliding ids overwrite each other's logits"))
    t2d = _load_vocab_map(t2d_info, out) if t2d_info is not None else None
    if t2d is not None:
        t2d = t2d.astype(bool)
        if t2d.shape != (v,):
            out.append(finding("t2d-length", Severity.REFUSAL, "t2d does not cover the target vocabulary",
                               f"t2d shape {list(t2d.shape)}", f"[{v}] (target vocab)", "export t2d for this target"))
        elif not bad.size:
            in_t2d = set(np.flatnonzero(t2d).tolist())
            in_d2t = set(targets.tolist())
            if in_t2d != in_d2t:
                out.append(finding("t2d-mismatch", Severity.REFUSAL, "t2d and d2t disagree",
                                   f"{len(in_d2t - in_t2d)} ids d2t reaches are not in t2d, "
                                   f"{len(in_t2d - in_d2t)} ids in t2d are not reached by d2t",
                                   "t2d true exactly at the target ids d2t reaches",
                                   "d2t and t2d come from different exports: re-export both together"))
    return out


def check_verifier(ctx: Context) -> list[Finding]:
    spec, target = ctx.spec, ctx.target
    if target is None or not spec.verifier_architectures:
        return []
    if set(spec.verifier_architectures) & set(target.architectures):
        return []
    return [finding("verifier-mismatch", Severity.WARNING, "the draft was trained against another architecture",
                    f"speculators_config.verifier: {spec.verifier_architectures} ({spec.verifier_name})",
                    f"the target being served: {target.architectures}",
                    "fine when it is the same model under another class name (e.g. its language model alone); "
                    "otherwise use a draft trained on this target")]


def check_options(ctx: Context) -> list[Finding]:
    spec = ctx.spec
    out = []
    if spec.mla:
        out.extend(_mla_options(spec))
    elif spec.model_type not in ("llama", "qwen3"):
        out.append(finding("layer-type", Severity.REFUSAL, "unsupported draft layer type",
                           f"model_type {spec.model_type!r}",
                           f"'llama' (or 'qwen3' in vLLM), or an MLA layer ({', '.join(MLA_MODEL_TYPES)})",
                           "export the draft with a Llama layer"))
    elif spec.model_type == "qwen3":
        out.append(finding("layer-type", Severity.WARNING, "a Qwen3 draft layer: key checks assume a Llama layer",
                           "model_type 'qwen3'", "'llama'", "treat the key coverage as approximate", "vllm"))
    if spec.format == "speculators" and spec.declared_norm_before_residual is None:
        out.append(finding("norm-before-residual-default", Severity.WARNING, "norm_before_residual is not set",
                           "no norm_before_residual in the speculators config",
                           "an explicit value: vLLM 0.32 assumes true when it is missing",
                           "write the value the draft was trained with into config.json", "vllm"))
    if spec.embed_requires_grad:
        out.append(finding("embedding-overridden", Severity.WARNING, "SGLang replaces the draft's trained embedding",
                           "embed_requires_grad=true: the draft trained its own embedding",
                           "SGLang 0.5.23's EAGLE-3 worker always installs the target's embedding in the draft",
                           "serve this draft with vLLM (it keeps distinct embeddings), or retrain with frozen "
                           "embeddings",
                           "sglang"))
    # SGLang reads the file's own value (a flat view carries it); vLLM's "true when absent" is vLLM's alone
    unsupported = spec.options_on
    if unsupported:
        out.append(finding("option-unsupported", Severity.REFUSAL, "draft options SGLang cannot honour",
                           ", ".join(f"{o}=true" for o in unsupported),
                           "SGLang 0.5.23's EAGLE-3 draft classes (Llama and MLA) have none of them and ignore them "
                           "silently (EAGLE-3.1's fc_norm / norm_output came in a later release)",
                           "serve this draft with vLLM, or retrain without those options", "sglang"))
    return out


def _mla_options(spec: DraftSpec) -> list[Finding]:
    """What each engine makes of a draft with an MLA layer (vLLM 0.32 `deepseek_eagle3.py`, SGLang 0.5.23
    `kimi_k25_eagle3.py`)."""
    out = []
    flat_fix = (f"publish it in the flat layout (lightseekorg/kimi-k2.5-eagle3-mla's): the layer's config at the top "
                f"level, architectures [\"{SGLANG_MLA_ARCHITECTURE}\"], the aux ids under eagle_config")
    if spec.format == "speculators":
        out.append(finding("mla-speculators-format", Severity.REFUSAL, "an MLA layer in a speculators config",
                           f"transformer_layer_config.model_type {spec.model_type!r}",
                           "vLLM 0.32 reads speculators configs with llama or qwen3 layers only (`update_eagle3` "
                           "raises 'Unsupported model_type')", flat_fix, "vllm"))
    elif not set(spec.architectures) & set(MLA_DRAFT_ARCHITECTURES):
        out.append(finding("mla-architecture", Severity.REFUSAL, "an MLA layer under another draft class",
                           f"architectures {spec.architectures} with model_type {spec.model_type!r}",
                           f"one of {list(MLA_DRAFT_ARCHITECTURES)}: vLLM 0.32 picks the draft class by this name, "
                           "and any other builds a layer the checkpoint does not fit",
                           f"set architectures to [\"{SGLANG_MLA_ARCHITECTURE}\"]", "vllm"))
    if spec.format != "speculators" and SGLANG_MLA_ARCHITECTURE not in spec.architectures:
        out.append(finding("mla-architecture", Severity.REFUSAL, "SGLang does not know this MLA draft class name",
                           f"architectures {spec.architectures}",
                           f"[\"{SGLANG_MLA_ARCHITECTURE}\"], the only name SGLang 0.5.23 registers for its MLA "
                           "draft (vLLM 0.32 knows it too)",
                           f"set architectures to [\"{SGLANG_MLA_ARCHITECTURE}\"]", "sglang"))
    if not spec.mla.q_lora_rank:
        out.append(finding("mla-q-lora-rank", Severity.REFUSAL, "an MLA draft layer without q_lora_rank",
                           "no q_lora_rank: queries projected directly",
                           "both engines' MLA draft classes stack q_a_proj with kv_a_proj_with_mqa (vLLM 0.32 stops "
                           "at load, SGLang 0.5.23 refuses the layer)",
                           "a draft layer with a q_lora_rank (as the Kimi-K2.5 target's)"))
    if spec.norm_before_fc:
        out.append(finding("option-ignored", Severity.REFUSAL, "norm_before_fc on an MLA draft",
                           "norm_before_fc=true",
                           "vLLM 0.32's Eagle3DeepseekV2ForCausalLM has no input_norm: it would skip the norm the "
                           "draft was trained with, without a word (its Llama class honours it)",
                           "serve it with a vLLM whose MLA draft class reads norm_before_fc, or retrain without it",
                           "vllm"))
    if spec.model_type == "deepseek_v3" and spec.format != "speculators":
        out.append(finding("mla-model-type", Severity.INFO, "a plain vLLM 0.32 would not start this draft",
                           "model_type 'deepseek_v3'",
                           "vLLM 0.32 rewrites every deepseek_v3 draft config into its MTP head and then asks for "
                           "'Eagle3DeepSeekMTPModel', which does not exist; kimi-eagle's plugin leaves EAGLE-3 "
                           "configs alone (adapter/mla_draft.py)",
                           "nothing under kimi-eagle; for a vLLM without the plugin set model_type to kimi_k2",
                           "vllm"))
    return out


def check_target(ctx: Context) -> list[Finding]:
    t = ctx.target
    if t is None or t.layers_in_weights is None:
        return []
    if t.layers_in_weights in (t.num_layers, t.num_layers + t.num_mtp_layers):
        return []
    return [finding("target-layers", Severity.WARNING,
                    "the target's config and its weights disagree on the layer count",
                    f"weights name layers 0..{t.layers_in_weights - 1}", f"{t.num_layers} layers (config.json)",
                    "check that config.json belongs to these weights")]


def _copies_text(checkpoint: Checkpoint, name: str, detail: str) -> str:
    copies = checkpoint.copies[name]
    files = " and ".join(c.file.name for c in copies)
    mapped = checkpoint.weight_map.get(name) if checkpoint.weight_map else None
    return (f"{name} in {files} (vLLM keeps the copy in {copies[-1].file.name}, read last{detail}"
            + (f"; the index maps it to {mapped}" if mapped else "") + ")")


def _difference(copies: list[TensorInfo], compared: bool) -> str:
    if len({(c.dtype, c.shape) for c in copies}) > 1:
        return ": " + " vs ".join(f"{c.dtype} {list(c.shape)}" for c in copies)
    return "; the bytes differ" if compared else "; same dtype and shape, values not read"


def check_copies(checkpoint: Checkpoint, role: str, *, compare_data: bool) -> list[Finding]:
    """A tensor name stored in more than one of the files vLLM reads (`safetensors_files`). vLLM 0.32 yields every
    copy, file by file in `read_order`, and each lands over the one before (the draft classes' `load_weights`
    keep the last in a dict, the target's weight loaders copy each into the parameter): the copy in the file read
    last is served, chosen by file names alone, and nothing says so.

    With `compare_data` (the draft: megabytes) copies with the same dtype, shape and bytes are only a warning.
    Without it (the target: hundreds of GB, of which only headers are read) any duplicate is a refusal: the same
    dtype, shape and byte length say nothing of the values, and a stale shard beside a re-exported one is exactly
    that case."""
    if not checkpoint.copies:
        return []
    identical = [n for n, copies in checkpoint.copies.items()
                 if compare_data and all(same_bytes(c, copies[-1]) for c in copies[:-1])]
    differing = [n for n in checkpoint.copies if n not in identical]
    scope = ("the files its index names" if checkpoint.weight_map is not None
             else "every *.safetensors file of the folder, as it has no index")
    order = (f"vLLM 0.32 reads {scope}, in file-name order (digits as numbers), and each copy overwrites the one "
             "read before")
    out = []
    if differing:
        if checkpoint.weight_map is not None:
            fix = ("re-save the file that should not hold the tensor without it, or take a stale file out of "
                   f"{INDEX_NAME} (vLLM reads every tensor of each file the index names, whatever file the index "
                   "maps a name to)")
        else:
            fix = (f"remove the stale shard, or write a {INDEX_NAME} that names one file per tensor and leaves the "
                   "stale file out (vLLM then reads only the files it names); if every file also holds tensors of "
                   "its own, re-save one without its copy")
        out.append(finding(
            "conflicting-copies", Severity.REFUSAL,
            f"{len(differing)} tensor(s) stored in more than one {role} file"
            + (", with different values" if compare_data else ""),
            listing([_copies_text(checkpoint, n, _difference(checkpoint.copies[n], compare_data))
                     for n in differing]),
            f"each tensor in one file: {order}, so which copy is served depends on the file names"
            + ("" if compare_data else " (only the target's headers are read: identical copies cannot be told "
                                       "from stale ones)"),
            fix))
    if identical:
        out.append(finding(
            "identical-copies", Severity.WARNING,
            f"{len(identical)} tensor(s) stored twice in the {role}, the copies identical",
            listing([_copies_text(checkpoint, n, "") for n in identical]),
            f"each tensor in one file: {order}; the copies are the same now, but a later edit of one file would "
            "change what is served without a word",
            "remove the duplicate copy: the stale shard, or the tensor from all files but one"))
    return out
