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
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from kimi_eagle.checks.checkpoint import (
    Checkpoint,
    CheckpointError,
    TensorInfo,
    iter_chunks,
    numel,
    torch_view,
)
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


# Values are measured a block at a time in float32, in a scratch buffer that stays in the CPU's cache through the passes
# over it: a Kimi draft's 2.3 GB embedding, or a matrix, is never copied whole into float32. On one thread: thousands
# of small operations split over threads spend their time waiting for each other, and on two cores shared with
# another busy process a 2.3 GB embedding took 63 s that way against 1.8 s on one.
BLOCK_ELEMENTS = 1 << 18


@contextmanager
def one_thread():
    import torch

    threads = torch.get_num_threads()
    if threads == 1:  # nothing to change (a process bound to one core, as each test worker is)
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@dataclass
class ValueStats:
    """One pass over a tensor's values: its health (non-finite count; min, max and mean |x| of the finite values)
    and, for a matrix, the moments and row norms its "trained or not" evidence needs."""

    count: int = 0
    nonfinite: int = 0
    lo: float = math.inf
    hi: float = -math.inf
    abs_sum: float = 0.0
    total: float = 0.0  # the moments: sums of x, x^2 and x^4 (of a tensor whose values are all finite)
    squares: float = 0.0
    fourth: float = 0.0
    row_squares: list = field(default_factory=list)  # per block of rows, each row's sum of squares

    def add(self, block, moments: bool) -> None:
        """`block`: float32, this object's to overwrite (a scratch copy)."""
        import torch

        self.count += block.numel()
        lo, hi = (float(v) for v in torch.aminmax(block))
        if not (math.isfinite(lo) and math.isfinite(hi)):  # a NaN or an Inf in the block: the slow path
            finite = torch.isfinite(block)
            self.nonfinite += int((~finite).sum())
            block, moments = block[finite], False
            if not block.numel():
                return
            lo, hi = (float(v) for v in torch.aminmax(block))
        self.lo, self.hi = min(self.lo, lo), max(self.hi, hi)
        if moments:
            self.total += float(block.sum())
        self.abs_sum += float(block.abs_().sum())
        if moments:
            squares = block.square_()
            self.squares += float(squares.sum())
            if squares.dim() == 2:
                self.row_squares.append(squares.sum(dim=1))
            self.fourth += float(squares.square_().sum())

    @property
    def finite_count(self) -> int:
        return self.count - self.nonfinite


def _scratch(elements: int):
    import torch

    return torch.empty(max(1, min(elements, BLOCK_ELEMENTS)), dtype=torch.float32)


def row_blocks(matrix, scratch=None):
    """A 2-D tensor (any dtype, any strides) as float32 blocks of whole rows, each copied into `scratch` (which the
    next block overwrites) when given."""
    rows = max(1, BLOCK_ELEMENTS // max(1, matrix.shape[1]))
    for first in range(0, matrix.shape[0], rows):
        block = matrix[first : first + rows]
        yield block.float() if scratch is None else scratch[: block.numel()].view(block.shape).copy_(block)


def _flat_blocks(flat, scratch):
    for first in range(0, flat.numel(), BLOCK_ELEMENTS):
        block = flat[first : first + BLOCK_ELEMENTS]
        yield scratch[: block.numel()].copy_(block)


def measure(tensor, moments: bool = False) -> ValueStats:
    """The stats of a tensor in memory; a matrix's blocks are whole rows (its row norms need them)."""
    stats = ValueStats()
    scratch = _scratch(tensor.numel()) if tensor.dim() != 2 else \
        _scratch(max(tensor.shape[1], BLOCK_ELEMENTS // max(1, tensor.shape[1]) * tensor.shape[1]))
    blocks = row_blocks(tensor, scratch) if tensor.dim() == 2 else _flat_blocks(tensor.reshape(-1), scratch)
    with one_thread():
        for block in blocks:
            stats.add(block, moments)
    return stats


def load_float32(info: TensorInfo):
    """A tensor, whole, in float32, converted piece by piece as it is read: memory holds the float32 tensor and one
    piece of the file, never a second copy of the whole."""
    import torch

    out = torch.empty(numel(info.shape), dtype=torch.float32)
    done = 0
    for raw in iter_chunks(info):
        piece = torch_view(info, raw)
        out[done : done + piece.numel()].copy_(piece)
        done += piece.numel()
    return out.view(info.shape)


def measure_on_disk(info: TensorInfo) -> ValueStats:
    """The health stats of a tensor read from its file piece by piece: memory holds one piece, whatever its size."""
    stats = ValueStats()
    scratch = _scratch(numel(info.shape))
    with one_thread():
        for raw in iter_chunks(info):
            for block in _flat_blocks(torch_view(info, raw), scratch):
                stats.add(block, moments=False)
    return stats


def _top_singular_exact(matrix) -> float:
    """The largest singular value as the square root of the top eigenvalue of the smaller Gram matrix (A A^T or
    A^T A), built from float32 blocks: exact, and for a 1024 x 14336 matrix a second where a full SVD takes tens."""
    import torch

    wide = matrix if matrix.shape[0] <= matrix.shape[1] else matrix.T
    k, n = wide.shape
    gram = torch.zeros(k, k, dtype=torch.float64)
    step = max(1, BLOCK_ELEMENTS // k)
    for first in range(0, n, step):
        block = wide[:, first : first + step].float()
        gram += (block @ block.T).double()
    return math.sqrt(max(float(torch.linalg.eigvalsh(gram)[-1]), 0.0))


def _top_singular_lowrank(matrix, q: int = 8, niter: int = 6) -> float:
    """The top singular value `torch.svd_lowrank(matrix, q, niter)` gives, computed over blocks of rows: the same
    probe vectors and the same subspace (A (A^T A)^niter R), reached by power steps M^T (M Y) that use each block of
    rows twice while it is in the CPU's cache, so 8 passes over the matrix where torch makes 14."""
    import torch

    rows, cols = matrix.shape
    blocks = [(first, matrix[first : first + max(1, BLOCK_ELEMENTS // cols)])
              for first in range(0, rows, max(1, BLOCK_ELEMENTS // cols))]

    def times(y):  # M y, by blocks of rows
        return torch.cat([block @ y for _, block in blocks])

    def transposed_times(x):  # M^T x
        out = torch.zeros(cols, x.shape[1], dtype=torch.float32)
        for first, block in blocks:
            out.addmm_(block.T, x[first : first + block.shape[0]])
        return out

    torch.manual_seed(0)  # the randomised SVD's probe vectors: reproducible evidence
    tall = rows >= cols  # torch works on the taller of M and M^T, its probe vectors as long as that one is wide
    # explicit dtypes: inside vLLM's model loading the default dtype is the model's (bfloat16)
    probes = torch.randn(min(rows, cols), q, dtype=torch.float32)
    y = probes if tall else torch.linalg.qr(transposed_times(probes)).Q  # in the space of M's rows, width cols
    for _ in range(niter):
        z = torch.zeros(cols, q, dtype=torch.float32)
        for _, block in blocks:
            z.addmm_(block.T, block @ y)
        y = torch.linalg.qr(z).Q
    if tall:  # torch's basis Q = orth(M y); its B = Q^T M
        return float(torch.linalg.svdvals(transposed_times(torch.linalg.qr(times(y)).Q))[0])
    return float(torch.linalg.svdvals(times(torch.linalg.qr(y).Q))[0])  # Q = orth(y); B = Q^T M^T


def top_singular_value(matrix) -> float:
    """Exact for a matrix with a side of at most EXACT_SVD_MAX, else the randomised estimate (float32 matrix)."""
    with one_thread():
        if min(matrix.shape) <= EXACT_SVD_MAX:
            return _top_singular_exact(matrix)
        return _top_singular_lowrank(matrix.float())


def matrix_evidence(name: str, matrix, stats: ValueStats | None = None) -> MatrixEvidence:
    """`stats`: the matrix's `measure(matrix, moments=True)`, when the caller has it already."""
    import torch

    stats = stats or measure(matrix, moments=True)
    rows, cols = matrix.shape
    n = rows * cols
    mean = stats.total / n
    std = math.sqrt(max(stats.squares - n * mean * mean, 0.0) / max(n - 1, 1))
    second = stats.squares / n
    kurtosis = stats.fourth / n / second**2 if second > 0 else 0.0
    row_norms = torch.cat(stats.row_squares).sqrt()
    row_cv = float(row_norms.std() / row_norms.mean()) if float(row_norms.mean()) > 0 else 0.0
    # for i.i.d. entries: Var(|row|^2)/E(|row|^2)^2 = (kurtosis-1)/cols, and the norm's CV is half that's sqrt
    iid_cv = 0.5 * math.sqrt(max(kurtosis - 1.0, 1e-12) / cols)
    top = top_singular_value(matrix)
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
    width = cols // count
    blocks = [fc[:, i * width:(i + 1) * width] for i in range(count)]
    stats = [measure(b, moments=True) for b in blocks]
    norms = [math.sqrt(st.squares) for st in stats]
    looks = [matrix_evidence(f"fc.weight[:, {i * width}:{(i + 1) * width}]", b, st)
             for i, (b, st) in enumerate(zip(blocks, stats))]
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


def _health(info: TensorInfo, stats: ValueStats) -> tuple[HealthRow, list[Finding]]:
    findings: list[Finding] = []
    row = HealthRow(name=info.name, dtype=info.dtype, shape=info.shape, status="ok")
    if not stats.count:
        return row, findings
    bad = stats.nonfinite
    if stats.finite_count:
        row.min, row.max, row.mean_abs = stats.lo, stats.hi, stats.abs_sum / stats.finite_count
    else:
        row.mean_abs = 0.0
    if bad:
        row.status = f"{bad} NaN/Inf"
        findings.append(Finding(
            code="weight-nonfinite", severity=Severity.REFUSAL, title=f"{info.name} holds NaN or Inf",
            found=f"{bad} of {stats.count} values are NaN or Inf", expected="finite values",
            fix="re-export the draft from a healthy training checkpoint (NaNs usually mean the run diverged)"))
    if row.status != "ok":
        return row, findings
    if row.min == row.max:
        value = row.min
        if value == 0.0 and not info.name.endswith(".bias"):
            row.status = "all zero"
            findings.append(Finding(
                code="weight-zero", severity=Severity.REFUSAL, title=f"{info.name} is all zeros",
                found=f"every one of its {stats.count} values is 0", expected="trained values",
                fix="the tensor was never filled (a failed save or a zero-initialised layer): re-export the draft"))
        elif len(info.shape) >= 2:
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
    """Read the draft's values one tensor at a time: a matrix the "trained or not" check reads is held whole, in
    float32 (a Kimi draft's largest, fc, is 300 MB in BF16, 600 MB so), everything else (its 2.3 GB embedding)
    streams through in pieces."""
    findings = _dtype_findings(checkpoint)
    health: list[HealthRow] = []
    evidence: list[MatrixEvidence] = []
    for name, info in sorted(checkpoint.tensors.items()):
        if info.dtype not in FLOAT_DTYPES:
            health.append(HealthRow(name=name, dtype=info.dtype, shape=info.shape, status="ok (integer/bool)"))
            continue
        is_fc = name.removeprefix("model.") == "fc.weight"
        whole = len(info.shape) == 2 and numel(info.shape) > 0 and (is_fc or TRAINABLE_MATRIX.match(name))
        try:
            matrix = load_float32(info) if whole else None
            stats = measure(matrix, moments=True) if whole else measure_on_disk(info)
        except (CheckpointError, OSError) as exc:
            health.append(HealthRow(name=name, dtype=info.dtype, shape=info.shape, status="unreadable"))
            findings.append(Finding(
                code="weights-unreadable", severity=Severity.REFUSAL, title=f"{name} cannot be read",
                found=f"{info.file.name}: {exc}", expected="a complete safetensors file",
                fix="the file is truncated or corrupt: download or export it again"))
            continue
        row, row_findings = _health(info, stats)
        health.append(row)
        findings.extend(row_findings)
        if whole and TRAINABLE_MATRIX.match(name) and row.status == "ok":
            evidence.append(matrix_evidence(name, matrix, stats))
        if whole and is_fc and row.status == "ok":
            findings += unused_aux_inputs(checkpoint, matrix)
        del matrix
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
