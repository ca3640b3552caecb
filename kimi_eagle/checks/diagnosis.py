"""`diagnose`: every static check of a draft (and of the draft against its target) at once, gathered into one
report: the findings, which engine loads which checkpoint tensor, the aux ids each engine uses, the weights'
health. Used by the vLLM plugin at engine start (the refusals) and by `kimi-eagle doctor` (the whole report)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from pydantic import BaseModel, Field

from kimi_eagle.checks import engines as eng
from kimi_eagle.checks import static
from kimi_eagle.checks.checkpoint import Checkpoint, CheckpointError, open_checkpoint
from kimi_eagle.checks.findings import Finding, Severity, finding, listing
from kimi_eagle.checks.layout import DraftConfigError, DraftSpec, draft_spec, target_spec
from kimi_eagle.checks.static import Context
from kimi_eagle.checks.weights import HealthRow, TrainedVerdict, check_weights

CHECKS = (static.check_keys, static.check_shapes, static.check_hidden, static.check_aux_ids, static.check_vocab,
          static.check_verifier, static.check_options, static.check_target)


class KeyFate(BaseModel):
    status: str = Field(description="loaded / consumed / ignored / dropped / load-error / missing / shared")
    param: str | None = None
    note: str = ""


class CoverageRow(BaseModel):
    key: str | None = Field(description="Checkpoint tensor name; None for an engine parameter nothing fills.")
    shape: tuple[int, ...] | None = None
    engines: dict[str, KeyFate] = Field(default_factory=dict)


class EngineVerdict(BaseModel):
    """What one engine makes of the pair as it is on disk, in one line, with the tensors it loses and the fixes."""

    verdict: str = Field(description="`loads as is`, `loads, but ...` or `refuses or fails: ...`; prefixed by `does "
                                     "not load it as is` where the engine needs a rewritten config.")
    dropped: list[str] = Field(default_factory=list, description="Checkpoint tensors it would drop without a word.")
    unfilled: list[str] = Field(default_factory=list, description="Its parameters no tensor fills (none shared).")
    load_errors: list[str] = Field(default_factory=list, description="Tensors whose load fails loudly.")
    problems: list[str] = Field(default_factory=list, description="Codes of the warnings and refusals about it.")
    fixes: list[str] = Field(default_factory=list)


class Diagnosis(BaseModel):
    draft: str
    target: str | None
    layout: str | None = Field(None, description="Which published layout the draft is in, as its files show it.")
    findings: list[Finding] = Field(default_factory=list)
    coverage: list[CoverageRow] = Field(default_factory=list)
    aux_ids: dict[str, list[int] | None] = Field(default_factory=dict, description="The ids each engine uses.")
    health: list[HealthRow] = Field(default_factory=list)
    trained: TrainedVerdict = Field(default_factory=lambda: TrainedVerdict(verdict="not checked", reason="skipped"))
    engines: dict[str, EngineVerdict] = Field(default_factory=dict, description="Per engine (vllm, sglang).")


def merge_engines(findings: list[Finding]) -> list[Finding]:
    """A fault both engines share is reported once, as engine 'all'."""
    by_text = defaultdict(list)
    for f in findings:
        by_text[(f.code, f.severity, f.title, f.found, f.expected)].append(f)
    out, seen = [], set()
    for f in findings:
        key = (f.code, f.severity, f.title, f.found, f.expected)
        if key in seen:
            continue
        seen.add(key)
        group = by_text[key]
        engines = {g.engine for g in group}
        out.append(f.model_copy(update={"engine": "all"}) if engines >= {"vllm", "sglang"} else f)
    return sorted(out, key=lambda f: -f.severity)


def _coverage(ctx: Context) -> list[CoverageRow]:
    rows = []
    for name, fates in ctx.fates.items():
        rows.append(CoverageRow(key=name, shape=ctx.draft.tensors[name].shape, engines={
            e: KeyFate(status=f.status, param=f.param + (f" [{f.shard}]" if f.shard is not None else "")
                       if f.param else None, note=f.note) for e, f in fates.items()}))
    for engine in eng.ENGINES:
        filled = {(f[engine].param, f[engine].shard) for f in ctx.fates.values() if f[engine].fills}
        for p in ctx.models[engine].params.values():
            for s in p.shards:
                if (p.name, s) not in filled and p.needed:
                    status = "shared" if p.shareable else "missing"
                    rows.append(CoverageRow(key=None, engines={engine: KeyFate(
                        status=status, param=p.name + (f" [{s}]" if s is not None else ""),
                        note="taken from the target" if p.shareable else "nothing fills it")}))
    return rows


NEEDS_A_VIEW = ("sglang-config-format",)


def engine_verdicts(findings: list[Finding], coverage: list[CoverageRow]) -> dict[str, EngineVerdict]:
    """Per engine: whether it loads the pair as it is on disk, what it would lose, and what to do."""
    out = {}
    for engine in eng.ENGINES:
        fates = [(row.key, row.engines[engine]) for row in coverage if engine in row.engines]
        dropped = [key for key, fate in fates if fate.status == "dropped"]
        unfilled = [fate.param for _, fate in fates if fate.status == "missing"]
        errors = [key for key, fate in fates if fate.status == "load-error"]
        relevant = [f for f in findings if f.applies_to(engine) and f.severity >= Severity.WARNING]
        refusals = [f for f in relevant if f.severity == Severity.REFUSAL]
        if refusals:
            verdict = "refuses or fails: " + "; ".join(f.title for f in refusals)
        elif relevant or dropped or unfilled:
            losses = [f"drops {len(dropped)} tensor(s) silently"] if dropped else []
            losses += [f"leaves {len(unfilled)} parameter(s) unfilled"] if unfilled else []
            verdict = "loads, but " + "; ".join(losses + [f.title for f in relevant])
        else:
            verdict = "loads as is"
        # A config format the engine cannot read at all; the report's figures assume the view kimi-eagle writes.
        if reformat := next((f for f in findings if f.applies_to(engine) and f.code in NEEDS_A_VIEW), None):
            verdict = f"does not load it as is ({reformat.title}: {reformat.fix}); through that view it " + \
                verdict.replace("loads as is", "loads")
        out[engine] = EngineVerdict(verdict=verdict, dropped=dropped, unfilled=unfilled, load_errors=errors,
                                    problems=list(dict.fromkeys(f.code for f in relevant)),
                                    fixes=list(dict.fromkeys(f.fix for f in relevant)))
    return out


def describe_layout(spec: DraftSpec, draft: Checkpoint) -> str:
    """The layout in the words of who publishes it: speculators, or a flat SpecForge/EAGLE config."""
    names = [n.removeprefix("model.") for n in draft.tensors]
    keys = ("midlayer.*" if any(n.startswith("midlayer.") for n in names)
            else "layers.N.*" if any(n.startswith("layers.") for n in names) else "no layer weights")
    ids = ("ids at the top level" if spec.top_level_ids else "ids under eagle_config" if spec.eagle_config_ids
           else "ids only under the top-level eagle_config" if spec.unread_ids else "no aux ids")
    if spec.format == "speculators":
        kind = "speculators (speculators_model_type eagle3, transformer_layer_config)"
    else:
        kind = f"flat SpecForge/EAGLE config ({', '.join(spec.architectures) or 'no architectures'})"
    flags = [name for name in ("fc_norm", "norm_output", "norm_before_fc") if getattr(spec, name)]
    layer = f"{spec.model_type} layer" + (" (MLA attention)" if spec.mla else "")
    return f"{spec.layout}: {kind}; {layer}; weights {keys}; {ids}" + (
        f"; EAGLE-3.1 flags {', '.join(flags)}" if flags else "")


def _target_unreadable(exc: Exception) -> Finding:
    return finding("target-unreadable", Severity.REFUSAL, "the target cannot be read", str(exc),
                   "a checkpoint folder: config.json, and every weight file its index names",
                   getattr(exc, "fix", "fix the path"))


def check_target_alone(target_dir: Path) -> list[Finding]:
    """The checks of a target served without a draft: what its checkpoint's files hold, from headers alone."""
    try:
        target = open_checkpoint(Path(target_dir))
    except CheckpointError as exc:
        return [_target_unreadable(exc)]
    return static.check_copies(target, "target", compare_data=False)


def diagnose(draft_dir: Path, target_dir: Path | None, *, check_values: bool = True) -> Diagnosis:
    result = Diagnosis(draft=str(draft_dir), target=str(target_dir) if target_dir else None)
    try:
        draft = open_checkpoint(Path(draft_dir))
        spec = draft_spec(draft.config)
    except (CheckpointError, DraftConfigError) as exc:
        result.findings.append(finding(getattr(exc, "code", "draft-unreadable"), Severity.REFUSAL,
                                       "the draft cannot be read", str(exc),
                                       "a speculators-format (or flat) EAGLE-3 draft folder",
                                       getattr(exc, "fix", "fix the folder")))
        return result
    target = None
    # a tensor stored twice: the draft's copies are small enough to compare, the target's data is never read
    findings = static.check_copies(draft, "draft", compare_data=check_values)
    if target_dir is not None:
        try:
            target_checkpoint = open_checkpoint(Path(target_dir))
            target = target_spec(target_checkpoint)
        except (CheckpointError, DraftConfigError) as exc:
            result.findings.append(_target_unreadable(exc))
            return result
        findings.extend(static.check_copies(target_checkpoint, "target", compare_data=False))
    else:
        result.findings.append(finding("no-target", Severity.INFO, "no target given: checks against it skipped",
                                       "no --target", "the target's folder", "pass --target DIR for the full check"))
    if not draft.tensors:
        severity = Severity.WARNING if draft.other_weight_files else Severity.REFUSAL
        result.findings.extend(findings)  # the target's
        result.findings.append(finding("weights-missing", severity, "no safetensors weights in the draft folder",
                                       listing([p.name for p in draft.other_weight_files]) or "no weight files",
                                       "model.safetensors (or shards with model.safetensors.index.json)",
                                       "save the draft with safetensors (speculators does by default)"))
        return result
    result.layout = describe_layout(spec, draft)
    ctx = Context(draft, spec, target)
    for check in CHECKS:
        findings.extend(check(ctx))
    if check_values:
        report = check_weights(draft)
        findings.extend(report.findings)
        result.health, result.trained = report.health, report.trained
    result.findings.extend(merge_engines(findings))
    result.findings.sort(key=lambda f: -f.severity)
    result.coverage = _coverage(ctx)
    result.engines = engine_verdicts(result.findings, result.coverage)
    default = target.default_aux_ids if target else None
    result.aux_ids = {"declared": spec.declared_ids, "vllm": spec.vllm_target_ids or default,
                      "sglang": spec.sglang_ids or default}
    return result


def run_static_checks(draft_dir: Path, target_dir: Path | None) -> list[Finding]:
    """Every finding about the draft (against the target when given), most severe first."""
    return diagnose(draft_dir, target_dir).findings
