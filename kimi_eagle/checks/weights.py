"""Value checks on the draft's own tensors: health (NaN/Inf, all-zero, constant, dtypes) and "trained or not?".

"Trained or not?" compares each matrix of `fc` and the draft layer with what an i.i.d. random matrix of the
same shape and spread looks like (the fresh `nn.Linear` init speculators starts from is one): for such a matrix
the top singular value sits at the Marchenko-Pastur bulk edge std*(sqrt(m)+sqrt(n)) and the per-row norms
barely vary. Training adds structure: singular values above the edge and rows of clearly different norms.
Embeddings and lm_head are left out: drafts copy them from the target, so they look trained either way.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field
from safetensors import SafetensorError

from kimi_eagle.checks.checkpoint import Checkpoint, TensorInfo, load_torch
from kimi_eagle.checks.findings import Finding, Severity

FLOAT_DTYPES = {"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
TRAINABLE_MATRIX = re.compile(
    r"^(?:model\.)?(?:fc|(?:layers\.\d+|midlayer)\.(?:self_attn|mlp)\.\w+_proj(?:_with_mqa)?)\.weight$")
EXACT_SVD_MAX = 2048  # above this, a randomised SVD (torch.svd_lowrank) for the top singular value
SPIKE_STRUCTURED = 1.5  # top singular value / bulk edge at or above which a matrix has clearly learnt something
SPIKE_RANDOM = 1.15  # below this (with flat row norms) a matrix is indistinguishable from a random init
ROWS_STRUCTURED = 2.0  # row-norm spread / the spread of an i.i.d. matrix
ROWS_RANDOM = 1.5


class MatrixEvidence(BaseModel):
    name: str
    shape: tuple[int, int]
    std: float = Field(description="Standard deviation of the entries.")
    init_std: float = Field(description="std of PyTorch's default nn.Linear init for this fan-in: 1/sqrt(3*fan_in).")
    top_singular: float
    bulk_edge: float = Field(description="std*(sqrt(rows)+sqrt(cols)): the largest singular value of an i.i.d. "
                                         "matrix of this shape and spread (Marchenko-Pastur).")
    spike_ratio: float = Field(description="top_singular / bulk_edge: about 1.0 for a random matrix.")
    row_spread_ratio: float = Field(description="Coefficient of variation of the row norms over that of an i.i.d. "
                                                "matrix with the same entry distribution: about 1.0 for a random one.")
    looks: Literal["random", "structured", "unclear"]


class TrainedVerdict(BaseModel):
    verdict: Literal["trained", "looks untrained", "unclear", "not checked"]
    reason: str
    matrices: list[MatrixEvidence] = Field(default_factory=list)


class HealthRow(BaseModel):
    name: str
    dtype: str
    shape: tuple[int, ...]
    status: str = Field(description="'ok' or what is wrong.")
    min: float | None = None
    max: float | None = None
    mean_abs: float | None = None


@dataclass
class WeightReport:
    findings: list[Finding]
    health: list[HealthRow]
    trained: TrainedVerdict


def top_singular_value(matrix) -> float:
    import torch

    if min(matrix.shape) <= EXACT_SVD_MAX:
        return float(torch.linalg.matrix_norm(matrix, ord=2))
    torch.manual_seed(0)  # the randomised SVD's probe vectors: reproducible evidence
    _, s, _ = torch.svd_lowrank(matrix, q=8, niter=6)
    return float(s[0])


def matrix_evidence(name: str, matrix) -> MatrixEvidence:
    import torch

    w = matrix.to(torch.float32)
    rows, cols = w.shape
    std = float(w.std())
    second = float(w.pow(2).mean())
    kurtosis = float(w.pow(4).mean()) / second**2 if second > 0 else 0.0
    row_norms = w.norm(dim=1)
    row_cv = float(row_norms.std() / row_norms.mean()) if float(row_norms.mean()) > 0 else 0.0
    # for i.i.d. entries: Var(|row|^2)/E(|row|^2)^2 = (kurtosis-1)/cols, and the norm's CV is half that's sqrt
    iid_cv = 0.5 * math.sqrt(max(kurtosis - 1.0, 1e-12) / cols)
    top = top_singular_value(w)
    edge = std * (math.sqrt(rows) + math.sqrt(cols))
    spike = top / edge if edge > 0 else 0.0
    spread = row_cv / iid_cv if iid_cv > 0 else 0.0
    if spike >= SPIKE_STRUCTURED or spread >= ROWS_STRUCTURED:
        looks = "structured"
    elif spike < SPIKE_RANDOM and spread < ROWS_RANDOM:
        looks = "random"
    else:
        looks = "unclear"
    return MatrixEvidence(name=name, shape=(rows, cols), std=std, init_std=1 / math.sqrt(3 * cols),
                          top_singular=top, bulk_edge=edge, spike_ratio=spike, row_spread_ratio=spread, looks=looks)


def trained_verdict(evidence: list[MatrixEvidence]) -> TrainedVerdict:
    if not evidence:
        return TrainedVerdict(verdict="not checked", reason="no fc or layer matrices found")
    structured = [e for e in evidence if e.looks == "structured"]
    random_like = [e for e in evidence if e.looks == "random"]
    if len(random_like) == len(evidence):
        return TrainedVerdict(
            verdict="looks untrained", matrices=evidence,
            reason=f"all {len(evidence)} matrices look like i.i.d. random ones: top singular value within "
                   f"{SPIKE_RANDOM:.2f}x of the bulk edge and row norms as even as chance gives")
    if 2 * len(structured) >= len(evidence):
        return TrainedVerdict(
            verdict="trained", matrices=evidence,
            reason=f"{len(structured)} of {len(evidence)} matrices have structure a random init does not "
                   f"(top singular value >= {SPIKE_STRUCTURED}x the bulk edge or row norms >= "
                   f"{ROWS_STRUCTURED}x as uneven)")
    return TrainedVerdict(verdict="unclear", matrices=evidence,
                          reason=f"{len(structured)} structured, {len(random_like)} random-like of {len(evidence)}")


def _shape_of(e: MatrixEvidence) -> str:
    return (f"top singular value {e.spike_ratio:.2f}x the bulk edge, row norms {e.row_spread_ratio:.2f}x as uneven "
            "as chance gives (about 1.0 for a random init)")


def untrained_matrices(verdict: TrainedVerdict) -> list[Finding]:
    """Each matrix still at a random init in a draft whose other matrices are trained: the draft as a whole passes
    the "trained or not" vote, and this one matrix turns its outputs into noise."""
    if verdict.verdict not in ("trained", "unclear"):
        return []
    structured = [e for e in verdict.matrices if e.looks == "structured"]
    return [Finding(
        code="matrix-untrained", severity=Severity.WARNING, title=f"{e.name} looks untrained",
        found=f"{_shape_of(e)}, while {len(structured)} of the draft's {len(verdict.matrices)} matrices are trained",
        expected="the structure training leaves, in every trainable matrix",
        fix=f"{e.name} was not trained or not saved (frozen by the training config, or exported from the initial "
            "checkpoint): re-export it from the trained run; `kimi-eagle doctor DRAFT --target T --probe` "
            "measures the acceptance it costs") for e in verdict.matrices if e.looks == "random" and structured]


def unused_aux_inputs(checkpoint: Checkpoint, fc) -> list[Finding]:
    """fc takes the aux layers side by side (columns [i*H, (i+1)*H) for aux layer i). A block still at its random
    init, or near zero, next to trained ones is an aux input the draft never learnt from: the seed's fault (one
    layer fed where three belong) frozen into the weights. `fc` is the healthy tensor check_weights has loaded."""
    from kimi_eagle.checks.layout import DraftConfigError, draft_spec

    if fc.dim() != 2:
        return []
    try:
        ids = draft_spec(checkpoint.config).declared_ids
    except DraftConfigError:
        ids = None
    rows, cols = fc.shape
    count = len(ids) if ids and cols % len(ids) == 0 else (cols // rows if cols % rows == 0 else 0)
    if count < 2:
        return []
    fc = fc.float()
    width = cols // count
    blocks = [fc[:, i * width:(i + 1) * width] for i in range(count)]
    norms = [float(b.norm()) for b in blocks]
    looks = [matrix_evidence(f"fc.weight[:, {i * width}:{(i + 1) * width}]", b) for i, b in enumerate(blocks)]
    findings = []
    for i, (norm, e) in enumerate(zip(norms, looks)):
        others = [(n, o) for j, (n, o) in enumerate(zip(norms, looks)) if j != i]
        faint = norm < 0.1 * max(n for n, _ in others)
        random_among_trained = e.looks == "random" and any(o.looks == "structured" for _, o in others)
        if not (faint or random_among_trained):
            continue
        layer = f"target layer {ids[i]}" if ids and len(ids) == count else f"aux input {i + 1} of {count}"
        found = (f"its norm is {norm:.3g} against {max(n for n, _ in others):.3g} for the largest other block"
                 if faint else f"{_shape_of(e)}, while other blocks are trained")
        findings.append(Finding(
            code="fc-aux-input-unused", severity=Severity.WARNING,
            title=f"fc ignores its input from {layer} (columns {i * width}-{(i + 1) * width - 1})",
            found=found, expected=f"all {count} aux inputs learnt from, as the engines feed all {count}",
            fix="the draft was trained without this layer's hidden state (e.g. an engine that captured one layer "
                "where three belong): retrain with the target capturing every aux layer in the config"))
    return findings


CHUNK_ELEMENTS = 1 << 24  # stats in float32 chunks: a Kimi draft's 2.3 GB embedding never doubles in memory


def _stats(tensor) -> tuple[int, float | None, float | None, float]:
    """(non-finite count, min, max, mean |x|) over the finite values, chunk by chunk."""
    import torch

    flat = tensor.reshape(-1)
    bad, lo, hi, total = 0, float("inf"), float("-inf"), 0.0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        chunk = flat[start : start + CHUNK_ELEMENTS].to(torch.float32)
        finite = torch.isfinite(chunk)
        bad += int((~finite).sum())
        values = chunk[finite]
        if values.numel():
            lo, hi = min(lo, float(values.min())), max(hi, float(values.max()))
            total += float(values.abs().sum())
    if lo > hi:  # nothing finite
        return bad, None, None, 0.0
    return bad, lo, hi, total / max(flat.numel() - bad, 1)


def _health(info: TensorInfo, tensor) -> tuple[HealthRow, list[Finding]]:
    findings: list[Finding] = []
    row = HealthRow(name=info.name, dtype=info.dtype, shape=info.shape, status="ok")
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return row, findings
    bad, row.min, row.max, row.mean_abs = _stats(tensor)
    if bad:
        row.status = f"{bad} NaN/Inf"
        findings.append(Finding(
            code="weight-nonfinite", severity=Severity.REFUSAL, title=f"{info.name} holds NaN or Inf",
            found=f"{bad} of {tensor.numel()} values are NaN or Inf", expected="finite values",
            fix="re-export the draft from a healthy training checkpoint (NaNs usually mean the run diverged)"))
    if row.status != "ok":
        return row, findings
    if row.min == row.max:
        value = row.min
        if value == 0.0 and not info.name.endswith(".bias"):
            row.status = "all zero"
            findings.append(Finding(
                code="weight-zero", severity=Severity.REFUSAL, title=f"{info.name} is all zeros",
                found=f"every one of its {tensor.numel()} values is 0", expected="trained values",
                fix="the tensor was never filled (a failed save or a zero-initialised layer): re-export the draft"))
        elif tensor.dim() >= 2:
            row.status = f"constant {value:g}"
            findings.append(Finding(
                code="weight-constant", severity=Severity.REFUSAL, title=f"{info.name} is constant",
                found=f"every value is {value:g}", expected="a trained matrix (values that differ)",
                fix="re-export the draft from its trained checkpoint"))
        else:
            row.status = f"constant {value:g}"  # a norm at its initial value: reported together, below
    return row, findings


def _dtype_findings(checkpoint: Checkpoint) -> list[Finding]:
    findings = []
    floats = {i.dtype for n, i in checkpoint.tensors.items() if i.dtype in FLOAT_DTYPES}
    if len(floats) > 1:
        by_dtype = {dt: sorted(n for n, i in checkpoint.tensors.items() if i.dtype == dt) for dt in floats}
        detail = "; ".join(f"{dt}: {len(names)} ({names[0]}...)" for dt, names in sorted(by_dtype.items()))
        findings.append(Finding(
            code="weight-dtype-mixed", severity=Severity.WARNING, title="the draft's weights mix float dtypes",
            found=detail, expected="one dtype for all weights (speculators saves one)",
            fix="re-save the draft in one dtype; the engine casts everything to its own dtype anyway"))
    if "F64" in floats:
        findings.append(Finding(
            code="weight-dtype-f64", severity=Severity.WARNING, title="float64 weights",
            found="tensors stored as F64", expected="BF16/F16/F32",
            fix="re-save in bfloat16: engines compute in 16/32 bits, F64 only doubles the download"))
    for name, info in checkpoint.tensors.items():
        base = name.rsplit(".", 1)[-1]
        if base == "d2t" and info.dtype not in ("I64", "I32"):
            findings.append(Finding(
                code="d2t-dtype", severity=Severity.REFUSAL, title="d2t is not an integer tensor",
                found=f"d2t stored as {info.dtype}", expected="I64 offsets (target id = draft id + d2t[id])",
                fix="re-export d2t as int64"))
        elif base == "t2d" and info.dtype != "BOOL":
            findings.append(Finding(
                code="t2d-dtype", severity=Severity.WARNING, title="t2d is not a boolean mask",
                found=f"t2d stored as {info.dtype}", expected="BOOL [target vocab]", fix="re-export t2d as bool"))
        elif name.endswith(".weight") and info.dtype not in FLOAT_DTYPES and len(info.shape) >= 1:
            findings.append(Finding(
                code="weight-dtype-int", severity=Severity.REFUSAL, title=f"{name} is stored as {info.dtype}",
                found=f"{info.dtype} weight without a quantization config the checks understand",
                expected="a float dtype", fix="dequantise the draft, or serve the unquantised export"))
    return findings


def check_weights(checkpoint: Checkpoint) -> WeightReport:
    """Load the draft's tensors one at a time (a Kimi draft's embedding alone is 2.3 GB) and check them."""
    findings = _dtype_findings(checkpoint)
    health: list[HealthRow] = []
    evidence: list[MatrixEvidence] = []
    for name, info in sorted(checkpoint.tensors.items()):
        if info.dtype not in FLOAT_DTYPES:
            health.append(HealthRow(name=name, dtype=info.dtype, shape=info.shape, status="ok (integer/bool)"))
            continue
        try:
            tensor = load_torch(info)
        except (SafetensorError, OSError) as exc:
            health.append(HealthRow(name=name, dtype=info.dtype, shape=info.shape, status="unreadable"))
            findings.append(Finding(
                code="weights-unreadable", severity=Severity.REFUSAL, title=f"{name} cannot be read",
                found=f"{info.file.name}: {exc}", expected="a complete safetensors file",
                fix="the file is truncated or corrupt: download or export it again"))
            continue
        row, row_findings = _health(info, tensor)
        health.append(row)
        findings.extend(row_findings)
        if TRAINABLE_MATRIX.match(name) and tensor.dim() == 2 and row.status == "ok":
            evidence.append(matrix_evidence(name, tensor))
        if name.removeprefix("model.") == "fc.weight" and row.status == "ok":
            findings += unused_aux_inputs(checkpoint, tensor)
        del tensor
    constant = [row.name for row in health if row.status.startswith("constant") and len(row.shape) == 1]
    if constant:
        findings.append(Finding(
            code="weight-constant", severity=Severity.INFO, title=f"{len(constant)} vector(s) hold one value each",
            found=", ".join(f"{n} = {row.min:g}" for row in health for n in constant if row.name == n),
            expected="trained values", fix="nothing if these norms were frozen on purpose; otherwise the draft "
                                           "may be untrained"))
    verdict = trained_verdict(evidence)
    findings += untrained_matrices(verdict)
    if verdict.verdict == "looks untrained":
        findings.append(Finding(
            code="looks-untrained", severity=Severity.WARNING, title="the draft looks untrained",
            found=verdict.reason, expected="matrices with the structure training leaves (see doctor's evidence)",
            fix="check that the export took the trained checkpoint, not the initial one; "
                "`kimi-eagle doctor DRAFT --target T --probe` measures what it predicts"))
    return WeightReport(findings=findings, health=health, trained=verdict)
