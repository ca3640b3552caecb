"""`doctor --probe`: run the target on calibration prompts, capture every layer's hidden state, and measure how
often the draft's first proposal (step 0) equals the target's next token with the configured aux layer ids and
with alternatives. The draft runs as `kimi_eagle.draft_model.Eagle3Draft`, which computes what vLLM computes.

For models that fit on this machine (the target runs in transformers, float32): the tiny Kimi-K2.5 pair.
The other half of `--probe`, offline acceptance through the real engine, is `doctor/engine_probe.py`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from kimi_eagle.checks import Finding, Severity
from kimi_eagle.checks.checkpoint import CheckpointError, open_checkpoint
from kimi_eagle.checks.layout import DraftConfigError, default_aux_ids, draft_spec, target_spec

MAX_TARGET_PARAMS = 2_000_000_000  # a CPU probe in float32; the real Kimi-K2.5 is 1T
CONTINUATION_TOKENS = 48
PROMPT_TOKENS = 32  # prompts are cut to the shortest one's length, at most this
NO_AGREEMENT = 0.05  # below this for every set of ids the draft predicts nothing (a random draft scores ~1/vocab)


class ProbeError(RuntimeError):
    """The probe cannot run on this pair; the message says why."""


class TargetTooBigError(ProbeError):
    """The target cannot run on this machine: the probe is skipped, which is no fault of the pair."""


class ProbeVariant(BaseModel):
    label: str
    ids: list[int]
    agreement: float = Field(description="Share of positions where the draft's step-0 token is the target's.")


class ProbeResult(BaseModel):
    prompts: int
    prompt_tokens: int = Field(description="Every prompt cut to this many tokens (the shortest prompt's length).")
    positions: int = Field(description="Positions scored (prompt and continuation, all prompts together).")
    configured: list[int]
    variants: list[ProbeVariant]
    verdict: Literal["configured ids fit best", "other ids fit better", "no agreement"]

    def findings(self) -> list[Finding]:
        best = max(self.variants, key=lambda v: v.agreement)
        mine = self.variants[0]
        if self.verdict == "no agreement":
            return [Finding(code="probe-no-agreement", severity=Severity.WARNING,
                            title="the draft almost never proposes the target's next token",
                            found=f"step-0 agreement at most {best.agreement:.1%} for every set of aux ids tried "
                                  f"({self.positions} positions)",
                            expected=f"well above {NO_AGREEMENT:.0%} for the ids the draft was trained with",
                            fix="the draft is untrained or was trained for another target")]
        if self.verdict == "other ids fit better":
            return [Finding(code="probe-ids-not-best", severity=Severity.WARNING,
                            title="other aux layer ids fit the draft better than the configured ones",
                            found=f"configured {mine.ids}: step-0 agreement {mine.agreement:.1%}; "
                                  f"{best.label} {best.ids}: {best.agreement:.1%} ({self.positions} positions)",
                            expected="the configured ids agree best (they are the ones the draft was trained with)",
                            fix=f"check which layers the draft was trained on; try eagle_aux_hidden_state_layer_ids "
                                f"{best.ids}")]
        return []


def judge(variants: list[ProbeVariant], positions: int) -> str:
    """Other ids fit better only when they beat the configured ones by more than two standard errors."""
    mine, best = variants[0], max(variants, key=lambda v: v.agreement)
    if best.agreement < NO_AGREEMENT:
        return "no agreement"
    spread = math.sqrt((mine.agreement * (1 - mine.agreement) + best.agreement * (1 - best.agreement)) / positions)
    return "other ids fit better" if best.agreement - mine.agreement > 2 * spread else "configured ids fit best"


def load_target(folder: Path):
    from kimi_eagle.torch_pair import PairLoadError, load_target_model

    check_runnable_here(folder)
    try:
        return load_target_model(folder)
    except PairLoadError as exc:
        raise ProbeError(f"the probe cannot run this target: {exc}") from None


def check_runnable_here(folder: Path) -> None:
    """Raise TargetTooBigError for a target this machine cannot run (the probe's limit, for transformers and vLLM)."""
    try:
        checkpoint = open_checkpoint(folder)
    except CheckpointError as exc:
        raise ProbeError(str(exc)) from None
    params = sum(_numel(i.shape) for i in checkpoint.tensors.values())
    if params > MAX_TARGET_PARAMS:
        raise TargetTooBigError(f"the target has {params / 1e9:.0f}B parameters: too big for a CPU probe "
                           f"(limit {MAX_TARGET_PARAMS / 1e9:.0f}B); run it on the tiny pair, or give --probe-url "
                           "of a vLLM server that serves this pair")


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def load_draft(folder: Path, target):
    from kimi_eagle.torch_pair import PairLoadError, load_draft_model

    try:
        return load_draft_model(folder, target)
    except PairLoadError as exc:
        raise ProbeError(str(exc)) from None


def prompt_tokens(target_dir: Path, prompts_file: Path | None) -> list[list[int]]:
    from tokenizers import Tokenizer

    from kimi_eagle.doctor.calibration import CalibrationError, calibration_prompts

    try:
        prompts = calibration_prompts(prompts_file)
    except CalibrationError as exc:
        raise ProbeError(str(exc)) from None
    tokenizer_file = target_dir / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ProbeError(f"{target_dir} has no tokenizer.json")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    return [tokenizer.encode(p).ids for p in prompts]


def capture(target, tokens):
    """Every layer's input (ids 0..L-1), the final pre-norm state (id L) and the target's next-token argmax."""
    import torch

    layers = target.model.layers
    states: dict[int, torch.Tensor] = {}
    hooks = [layer.register_forward_pre_hook(
        lambda _m, args, kwargs, i=i: states.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True) for i, layer in enumerate(layers)]
    hooks.append(target.model.norm.register_forward_pre_hook(
        lambda _m, args: states.__setitem__(len(layers), args[0])))
    try:
        logits = target(input_ids=tokens).logits
    finally:
        for h in hooks:
            h.remove()
    return torch.stack([states[i] for i in range(len(layers) + 1)], dim=2), logits.argmax(-1)


def variants(configured: list[int], num_layers: int) -> list[tuple[str, list[int]]]:
    n = num_layers
    candidates = [("configured", configured),
                  ("shifted -1", [i - 1 for i in configured]),
                  ("shifted +1", [i + 1 for i in configured]),
                  ("default (2, L//2, L-3)", default_aux_ids(n)[: len(configured)]),
                  ("one layer repeated", [configured[len(configured) // 2]] * len(configured))]
    seen, out = set(), []
    for label, ids in candidates:
        if len(ids) == len(configured) and all(0 <= i <= n for i in ids) and (label == "configured"
                                                                             or tuple(ids) not in seen):
            seen.add(tuple(ids))
            out.append((label, ids))
    return out


def probe_aux_ids(draft_dir: Path, target_dir: Path, prompts_file: Path | None = None,
                  new_tokens: int = CONTINUATION_TOKENS) -> ProbeResult:
    import torch

    try:
        target_info = target_spec(open_checkpoint(target_dir))
        spec = draft_spec(open_checkpoint(draft_dir).config)
    except (CheckpointError, DraftConfigError) as exc:
        raise ProbeError(str(exc)) from None
    configured = spec.vllm_target_ids or target_info.default_aux_ids
    torch.manual_seed(0)
    with torch.no_grad():
        target = load_target(target_dir)
        draft, n_aux = load_draft(draft_dir, target)
        if n_aux != len(configured):
            raise ProbeError(f"fc takes {n_aux} aux states but {len(configured)} ids are configured: fix the "
                             "config first (`kimi-eagle doctor`)")
        prompts = prompt_tokens(target_dir, prompts_file)
        # cut to one length, so that all prompts run as one batch without padding
        length = min(PROMPT_TOKENS, *map(len, prompts))
        batch = torch.tensor([p[:length] for p in prompts])
        sequence = target.generate(batch, max_new_tokens=new_tokens, do_sample=False,
                                   attention_mask=torch.ones_like(batch))
        states, target_next = capture(target, sequence)
        t = sequence.shape[1] - 2  # anchors 0..T-3: the draft sees x_{t+1} and proposes for t+2
        scores = {}
        for label, layer_ids in variants(configured, target_info.num_layers):
            features = states[:, :t, layer_ids].flatten(2)
            logits = draft.unrolled(features, sequence[:, 1:], steps=1)[0]
            proposed = draft.to_target_ids(logits.argmax(-1))
            scores[label] = (proposed == target_next[:, 1 : t + 1]).float().mean().item()
    results = [ProbeVariant(label=label, ids=ids, agreement=scores[label])
               for label, ids in variants(configured, target_info.num_layers)]
    positions = batch.shape[0] * t
    return ProbeResult(prompts=len(prompts), prompt_tokens=length, positions=positions, configured=configured,
                       variants=results, verdict=judge(results, positions))


def probe_table(result: ProbeResult):
    from rich.table import Table

    table = Table(title=f"Probe: draft step-0 agreement with the target's next token ({result.prompts} prompts of "
                        f"{result.prompt_tokens} tokens + {CONTINUATION_TOKENS} greedy, {result.positions} positions)")
    for column in ("aux ids", "layers", "agreement"):
        table.add_column(column)
    best = max(v.agreement for v in result.variants)
    for v in result.variants:
        style = "bold green" if v.agreement == best else ""
        table.add_row(v.label, json.dumps(v.ids), f"[{style}]{v.agreement:.1%}[/]" if style else f"{v.agreement:.1%}")
    style = "green" if result.verdict == "configured ids fit best" else "yellow"
    table.caption = f"[{style}]{result.verdict}[/]"
    return table
