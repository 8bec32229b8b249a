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

from attn_doctor.numerics.standalone import error_figures, error_sums, safe_ratio

CHUNK_ELEMENTS = 1 << 24  # on a GPU: few launches per tensor
# On the CPU, stretches of 8 MiB float64 stay below glibc's mmap threshold, so each temporary reuses heap pages
# instead of faulting fresh ones in: 3.5x faster per comparison, the system time gone (b4 s1024 h16 d64, 2 cores).
CPU_CHUNK_ELEMENTS = 1 << 20


def chunk_elements(device: torch.device) -> int:
    return CPU_CHUNK_ELEMENTS if device.type == "cpu" else CHUNK_ELEMENTS


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
    worst_row_scaled_err: float = math.nan  # the worst (batch, position, head) row over its own terms' scale
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

    def figures(self) -> dict[str, float | int]:
        """The fields by the names `standalone.error_figures` gives them (what `standalone.judge_figures` reads)."""
        return {figure: getattr(self, field) for field, figure in FIGURES.items()}


# TensorMetrics' fields by the names of `standalone.error_figures` (the standalone repro scripts' names).
FIGURES = {"rel_err": "rel", "max_abs_err": "max_abs", "cosine": "cosine", "worst_head_rel_err": "worst_rel",
           "nan": "nan", "inf": "inf", "ref_nonfinite": "ref_nonfinite", "scaled_err": "scaled",
           "worst_head_scaled_err": "worst", "worst_row_scaled_err": "worst_row", "cancellation": "cancellation",
           "noise_ratio": "noise", "worst_head_noise_ratio": "head_noise", "bias": "bias", "bias_z": "bias_z",
           "head_bias": "head_bias", "head_bias_z": "head_bias_z", "empty_rows": "empty_rows",
           "empty_rows_max": "empty_max", "empty_rows_nonfinite": "empty_nonfinite"}


def compare(candidate: torch.Tensor, reference: torch.Tensor, terms: torch.Tensor | None = None,
            rows: torch.Tensor | None = None, empty_rows: torch.Tensor | None = None) -> TensorMetrics:
    """Compare bshd-shaped tensors [batch, seq, heads, dim] (any dtype/strides) against float64 `reference`.

    `terms` [batch, seq, heads, 2] are the reference's squared term magnitudes per row, as they are and with
    the fp32 scores' rounding (`Reference.terms`); without them the scale is the exact norm alone.
    `rows` (bool, [batch, seq] or [batch, seq, heads]) are the rows compared; the others (padding, rows that
    see no key) neither dilute nor inflate any figure. `empty_rows` (same shapes) are measured on their own:
    how large and how finite the candidate is there. The sums and figures are `standalone.error_sums` and
    `standalone.error_figures`, taken here a stretch of the sequence at a time."""
    if candidate.shape != reference.shape:
        raise ValueError(f"shape {tuple(candidate.shape)} differs from the reference's {tuple(reference.shape)}")
    step = max(1, chunk_elements(reference.device) // max(1, candidate[:, :1].numel()))
    sums = None
    for start in range(0, max(1, candidate.shape[1]), step):  # once at least: an empty tensor has figures too
        stretch = slice(start, start + step)
        sums = error_sums(candidate[:, stretch], reference[:, stretch], None if terms is None else terms[:, stretch],
                          None if rows is None else rows[:, stretch],
                          None if empty_rows is None else empty_rows[:, stretch], into=sums)
    figures = error_figures(sums)
    return TensorMetrics(**{field: figures[figure] for field, figure in FIGURES.items()})


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| of bshd tensors in float64 over the entries finite in both (the quantity the bug
    reports measured between two implementations; a call's spread over repeats), chunk by chunk along the
    sequence: no full-size float64 copy. 0 when they are equal; inf when `b` is all zero and `a` is not."""
    step = max(1, chunk_elements(b.device) // max(1, b[:, :1].numel()))
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
