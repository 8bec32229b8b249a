"""How far one tensor is from its float64 reference, computed on the tensors' device in float64.

Besides the relative error, each comparison measures the error against the scale of the terms the tensor
is summed from (`scale`, see `attn_doctor.numerics.reference`: the exact norm and the terms' root-sum-
square, so it never vanishes where the exact result cancels), and the error's systematic part: its
projection on the exact tensor, `bias` = <e, r> / <r, r> (x ~ (1 + bias) r + noise), with `bias_z`, the
projection over its own spread, computed row by row: sum_rows s / sqrt(sum_rows s^2), s = <e_row, r_row>.
Rounding errors of different rows are (nearly) independent and zero-mean, so bias_z is a self-normalised
sum: for symmetric errors P(|bias_z| >= t) <= 2 exp(-t^2 / 2) (Hoeffding, conditionally on |s|), whatever
the rows' sizes. Rows that are near copies of each other (equal keys make every output row alike) round
alike, and there bias_z grows without any fault (68 measured on the H200): the verdict never rests on it
alone (`attn_doctor.verdict.rule`); summing each row first keeps the errors a row's elements share (one rounded dS entry
feeds a whole row of dQ) from inflating it. A wrong scale, a missing term or a biased conversion moves
every row the same way, so bias_z grows like the square root of the number of rows.

Work goes chunk by chunk along the sequence, so no full-size float64 copy of the candidate is made and
nothing but a handful of scalars ever reaches the host.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class TensorMetrics:
    rel_err: float  # ||x - ref||_2 / ||ref||_2 over entries where both are finite
    max_abs_err: float
    cosine: float
    worst_head_rel_err: float  # the same relative error, for the worst (batch, head) slice
    nan: int
    inf: int
    ref_nonfinite: int  # NaN/Inf in the reference itself (then NaN in the candidate is not its fault)
    # Defaults: what results written before these were measured read as (no cancellation, no bias seen).
    scaled_err: float = math.nan  # ||x - ref|| / scale
    worst_head_scaled_err: float = math.nan  # the same, for the worst (batch, head) slice
    cancellation: float = 1.0  # ||ref|| / scale: near 0 where the exact tensor cancels
    noise_ratio: float = 1.0  # the scale of the rounding noise over `scale` (>= 1: fp32 scores, see reference)
    worst_head_noise_ratio: float = 1.0  # its largest value over the (batch, head) slices
    bias: float = 0.0  # <x - ref, ref> / <ref, ref>
    bias_z: float = 0.0  # the bias over its spread (see the module docstring)
    head_bias: float = 0.0  # the bias of the (batch, head) slice with the largest |bias_z|
    head_bias_z: float = 0.0
    # Rows that see no key (left out of everything above; their own rule: `attn_doctor.verdict.rule`):
    empty_rows: int = 0  # how many (batch, position, head) rows
    empty_rows_max: float = 0.0  # max |x| over them, relative to the RMS norm of the rows compared above
    empty_rows_nonfinite: int = 0
    # Padding (positions beyond a sequence's length; set by the probe, which knows the format):
    padding_values: int = 0  # how many values the tensor holds in padding
    padding_nonzero: int = 0  # how many of them are not 0 (TE writes zeros there)

    def to_dict(self) -> dict:
        return asdict(self)


def compare(candidate: torch.Tensor, reference: torch.Tensor, terms: torch.Tensor | None = None,
            rows: torch.Tensor | None = None, empty_rows: torch.Tensor | None = None) -> TensorMetrics:
    """Compare bshd-shaped tensors [batch, seq, heads, dim] (any dtype/strides) against float64 `reference`.

    `terms` [batch, seq, heads, 2] are the reference's squared term magnitudes per row, as they are and with
    the fp32 scores' rounding (`Reference.terms`); without them the scale is the exact norm alone.
    `rows` (bool, [batch, seq] or [batch, seq, heads]) are the rows compared; the others (padding, rows that
    see no key) neither dilute nor inflate any figure. `empty_rows` (same shapes) are measured on their own:
    how large and how finite the candidate is there."""
    if terms is not None and terms.dim() == 3:  # one set of magnitudes: the noise's scale too
        terms = terms[..., None].expand(*terms.shape, 2)
    if candidate.shape != reference.shape:
        raise ValueError(f"shape {tuple(candidate.shape)} differs from the reference's {tuple(reference.shape)}")
    batch, seq, heads = candidate.shape[:3]
    per_position = max(1, candidate[:, :1].numel())
    step = max(1, CHUNK_ELEMENTS // per_position)
    f64 = torch.float64
    zero = torch.zeros((), dtype=f64, device=reference.device)
    sq_diff, sq_ref, sq_cand, dot, max_abs = zero.clone(), zero.clone(), zero.clone(), zero.clone(), zero.clone()
    head_sq_diff = torch.zeros(batch, heads, dtype=f64, device=reference.device)
    head_sq_ref = torch.zeros_like(head_sq_diff)
    head_terms = torch.zeros(batch, heads, 2, dtype=f64, device=reference.device)
    head_proj, head_proj_sq = torch.zeros_like(head_sq_diff), torch.zeros_like(head_sq_diff)
    nan = inf = ref_nonfinite = 0
    empty_max, empty_nonfinite, empty_count = zero.clone(), 0, 0

    def row_mask(mask: torch.Tensor | None, start: int) -> torch.Tensor | None:
        if mask is None:
            return None
        part = mask[:, start : start + step].to(reference.device)
        return (part[..., None] if part.dim() == 2 else part)[..., None]  # [b, s, 1 or h, 1]

    for start in range(0, seq, step):
        x = candidate[:, start : start + step].to(device=reference.device, dtype=f64)
        r = reference[:, start : start + step]
        empty = row_mask(empty_rows, start)
        if empty is not None and bool(empty.any()):
            on_empty = torch.where(empty, x, 0.0)
            empty_nonfinite += int((~torch.isfinite(on_empty)).sum())
            empty_max = torch.maximum(empty_max, torch.nan_to_num(on_empty, nan=0.0, posinf=0.0, neginf=0.0).abs().max())
            empty_count += int(empty.expand(*x.shape[:3], 1).sum())
        counted = row_mask(rows, start)
        if counted is not None:
            x, r = torch.where(counted, x, 0.0), torch.where(counted, r, 0.0)
        x_finite, r_finite = torch.isfinite(x), torch.isfinite(r)
        nan += int(torch.isnan(x).sum())
        inf += int(torch.isinf(x).sum())
        ref_nonfinite += int((~r_finite).sum())
        both = x_finite & r_finite
        x = torch.where(both, x, 0.0)
        r = torch.where(both, r, 0.0)
        diff = x - r
        sq_diff += diff.square().sum()
        sq_ref += r.square().sum()
        sq_cand += x.square().sum()
        dot += (x * r).sum()
        if diff.numel():
            max_abs = torch.maximum(max_abs, diff.abs().max())
        head_sq_diff += diff.square().sum(dim=(1, 3))
        head_sq_ref += r.square().sum(dim=(1, 3))
        row_proj = (diff * r).sum(dim=3)  # [batch, seq, heads]
        head_proj += row_proj.sum(dim=1)
        head_proj_sq += row_proj.square().sum(dim=1)
        if terms is not None:
            part = terms[:, start : start + step].to(device=reference.device, dtype=f64)
            if counted is not None:
                part = torch.where(counted, part, 0.0)
            head_terms += part.sum(dim=1)
    ref_norm = math.sqrt(float(sq_ref))
    cand_norm = math.sqrt(float(sq_cand))
    diff_norm = math.sqrt(float(sq_diff))
    rel = safe_ratio(diff_norm, ref_norm)
    cosine = float(dot) / (ref_norm * cand_norm) if ref_norm > 0 and cand_norm > 0 else (1.0 if rel == 0 else 0.0)
    head_rel = _ratios(head_sq_diff, head_sq_ref)
    worst = math.sqrt(float(head_rel.max())) if head_rel.numel() else 0.0
    head_scale_sq = head_sq_ref + head_terms[..., 0]
    head_noise_sq = head_sq_ref + head_terms[..., 1]
    scale = math.sqrt(float(head_scale_sq.sum()))
    noise_ratio = math.sqrt(safe_ratio(float(head_noise_sq.sum()), float(head_scale_sq.sum()))) if scale > 0 else 1.0
    head_noise = torch.where(head_scale_sq > 0, head_noise_sq / head_scale_sq.clamp_min(1e-300), 1.0)
    head_scaled = _ratios(head_sq_diff, head_scale_sq)
    bias, bias_z = _bias(float(head_proj.sum()), float(head_proj_sq.sum()), float(sq_ref))
    head_bias = head_bias_z = 0.0
    if head_proj.numel():
        head_z = torch.where(head_proj_sq > 0, head_proj / head_proj_sq.clamp_min(1e-300).sqrt(), 0.0)
        at = int(head_z.abs().argmax())
        head_bias, head_bias_z = _bias(*(float(t.flatten()[at]) for t in (head_proj, head_proj_sq, head_sq_ref)))
    return TensorMetrics(
        rel, float(max_abs), cosine, worst, nan, inf, ref_nonfinite,
        scaled_err=safe_ratio(diff_norm, scale),
        worst_head_scaled_err=math.sqrt(float(head_scaled.max())) if head_scaled.numel() else 0.0,
        cancellation=ref_norm / scale if scale > 0 else 1.0,
        noise_ratio=noise_ratio,
        worst_head_noise_ratio=math.sqrt(float(head_noise.max())) if head_noise.numel() else 1.0,
        bias=bias, bias_z=bias_z, head_bias=head_bias, head_bias_z=head_bias_z,
        empty_rows=empty_count,
        empty_rows_max=safe_ratio(float(empty_max), _rms_row(float(sq_ref), rows, candidate.shape)),
        empty_rows_nonfinite=empty_nonfinite,
    )


def _rms_row(sq_ref: float, rows: torch.Tensor | None, shape: torch.Size) -> float:
    """The root-mean-square norm of the compared rows of the exact tensor: the size a row has."""
    batch, seq, heads = shape[:3]
    if rows is None:
        count = batch * seq * heads
    else:
        count = int(rows.sum()) * (heads if rows.dim() == 2 else 1)
    return math.sqrt(sq_ref / count) if count else 0.0


def safe_ratio(err: float, scale: float) -> float:
    """err / scale, where a zero scale (nothing to compute: the exact result and all its terms are 0)
    makes any error infinitely large and no error 0."""
    if scale > 0:
        return err / scale
    return 0.0 if err == 0 else math.inf


def _ratios(sq_err: torch.Tensor, sq_scale: torch.Tensor) -> torch.Tensor:
    """Elementwise squared `safe_ratio`."""
    out = torch.where(sq_scale > 0, sq_err / sq_scale.clamp_min(1e-300), sq_err * math.inf)
    return torch.nan_to_num(out, nan=0.0, posinf=math.inf)


def _bias(projection: float, projection_sq: float, ref_sq: float) -> tuple[float, float]:
    """(bias, bias_z) from sum_rows <e, r>, sum_rows <e, r>^2 and ||r||^2; (0, 0) where r is 0."""
    if ref_sq <= 0 or projection_sq <= 0:
        return 0.0, 0.0
    return projection / ref_sq, projection / math.sqrt(projection_sq)


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| of bshd tensors in float64 over the entries finite in both (the quantity the bug
    reports measured between two implementations; a call's spread over repeats), chunk by chunk along the
    sequence: no full-size float64 copy. 0 when they are equal; inf when `b` is all zero and `a` is not."""
    step = max(1, CHUNK_ELEMENTS // max(1, b[:, :1].numel()))
    diff_sq = torch.zeros((), dtype=torch.float64, device=b.device)
    ref_sq = torch.zeros((), dtype=torch.float64, device=b.device)
    for start in range(0, b.shape[1], step):
        x = a[:, start : start + step].to(device=b.device, dtype=torch.float64)
        r = b[:, start : start + step].to(torch.float64)
        both = torch.isfinite(x) & torch.isfinite(r)
        x, r = torch.where(both, x, 0.0), torch.where(both, r, 0.0)
        diff_sq += (x - r).square().sum()
        ref_sq += r.square().sum()
    return safe_ratio(math.sqrt(float(diff_sq)), math.sqrt(float(ref_sq)))
