"""How far one tensor is from its float64 reference, computed on the tensors' device in float64.

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

    def to_dict(self) -> dict:
        return asdict(self)


def compare(candidate: torch.Tensor, reference: torch.Tensor) -> TensorMetrics:
    """Compare bshd-shaped tensors [batch, seq, heads, dim] (any dtype/strides) against float64 `reference`."""
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
    nan = inf = ref_nonfinite = 0
    for start in range(0, seq, step):
        x = candidate[:, start : start + step].to(device=reference.device, dtype=f64)
        r = reference[:, start : start + step]
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
    ref_norm = math.sqrt(float(sq_ref))
    cand_norm = math.sqrt(float(sq_cand))
    diff_norm = math.sqrt(float(sq_diff))
    rel = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    cosine = float(dot) / (ref_norm * cand_norm) if ref_norm > 0 and cand_norm > 0 else (1.0 if rel == 0 else 0.0)
    head_rel = torch.where(head_sq_ref > 0, head_sq_diff / head_sq_ref.clamp_min(1e-300), head_sq_diff * math.inf)
    head_rel = torch.nan_to_num(head_rel, nan=0.0)
    worst = math.sqrt(float(head_rel.max())) if head_rel.numel() else 0.0
    return TensorMetrics(rel, float(max_abs), cosine, worst, nan, inf, ref_nonfinite)


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the quantity the bug reports measured between two implementations)."""
    return compare(a, b.to(torch.float64)).rel_err
