"""What an attention call computes beyond q k^T: which (query, key) pairs each mask type lets through, the
bias added to the scores, and the softmax's sink, exactly as TE defines them. Every path that is not TE
(the float64 reference, the local baseline, PyTorch SDPA, a user's kernel) gets them from here: a case's
`Semantics`, and the dense masks and biases computed from them by `attn_doctor.numerics.standalone` (which
the standalone repro scripts hold too).

Visibility, per sequence of `len_q` queries and `len_kv` keys (TE 2.20.2, `utils.get_full_mask` and
`DotProductAttention.forward`): query i sees key j when

    i + diag - left <= j <= i + diag + right         (left / right = -1: unbounded on that side)

- causal masks fix right = 0; a window gives (left, right);
- diag = 0 (top-left) for `causal` and `padding_causal`; diag = len_kv - len_q (bottom-right) for the
  `*_bottom_right` masks and, for a sliding window, also for `no_mask`, `padding` and `arbitrary` (TE's
  `bottom_right_diagonal` defaults to True unless the mask is top-left causal);
- padding masks: only the first len_q queries and len_kv keys of a sequence exist (TE's cu_seqlens);
- `arbitrary`: an explicit boolean mask, [batch, 1, seq_q, seq_kv]. Here True means *visible* (PyTorch
  SDPA's convention); TE's `attention_mask` uses the opposite, True = masked out, and the TE backend
  converts it.

A query that sees no key ("fully masked row") outputs 0 and passes no gradient: TE's convention, what the
float64 reference computes, and what the verdict expects (`attn_doctor.verdict.rule`).

Bias (`core_attention_bias_type`): `post_scale_bias` adds a tensor of shape 1hss, 11ss, b1ss, bhss or
111s to the scaled scores; `alibi` adds -slope_h |i + diag - j| with TE's default slopes (`standalone.alibi_slopes`). The
bias carries no gradient here (attn-doctor does not judge dBias).

Softmax type (TE's `softmax_type`): `off-by-one` adds a logit of 0 to each row's denominator, `learnable`
a logit per head (TE's `softmax_offset` parameter, whose gradient is judged as `dsink`):

    P_ij = exp(s_ij) / (exp(o_h) + sum_j exp(s_ij)),    d o_h = - sum_{b, i} P_sink,i (dO_i . out_i)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from attn_doctor.core.case import Case
from attn_doctor.numerics import standalone
from attn_doctor.numerics.source import Slots
from attn_doctor.numerics.standalone import TOP_LEFT_MASKS, alibi_slopes


@dataclass(frozen=True)
class Visibility:
    """Which keys the queries of one sequence see: j in [i + diag - left, i + diag + right]."""

    left: int = -1  # -1: unbounded
    right: int = -1
    diag: int = 0

    @classmethod
    def top_left(cls, causal: bool, window: tuple[int, int] | None) -> Visibility:
        """The dense causal / window semantics attn-doctor's TP, depth and distributed probes use."""
        left, right = window if window is not None else (-1, -1)
        if causal:
            right = 0 if right < 0 else min(right, 0)
        return cls(left, right, 0)

    def sees_a_key(self, rows: torch.Tensor, seq_kv: int) -> torch.Tensor:
        """Boolean like `rows` (query positions): which of them see at least one of keys [0, seq_kv)."""
        return standalone.sees_a_key(self.left, self.right, self.diag, rows, seq_kv)

    def pairs(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor | None:
        """Boolean [len(rows), len(cols)]: which (query, key) pairs it lets through; None when all."""
        return standalone.visible_pairs(self.left, self.right, self.diag, rows, cols)


def visibility(case: Case, len_q: int, len_kv: int) -> Visibility:
    """The visibility of one sequence of the case (TE's rules, see the module docstring)."""
    return Visibility(*standalone.visibility(case.mask, case.window, len_q, len_kv))


@dataclass
class Semantics:
    """Everything beyond q, k, v that decides an attention's result, as tensors on the inputs' device.

    `allowed` [batch, 1, seq_q, seq_kv] is the explicit mask of `arbitrary` (True = visible); `bias`
    broadcasts to [batch, heads, seq_q, seq_kv]; `sink` [heads] holds the sink logits (zeros for off-by-one);
    `slots` a packed call's own slots (query side, key side) where its source has them (a replayed call's),
    else None: the case's (`attn_doctor.core.layouts.packing`)."""

    case: Case
    allowed: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None  # float64 [heads], or [batch, heads] (custom slopes per sequence)
    sink: torch.Tensor | None = None
    slots: Slots | None = None

    @property
    def learnable_sink(self) -> bool:
        """The sink logits are learnable: their gradient is computed and judged."""
        return self.sink is not None and self.case.softmax == "learnable"

    @property
    def per_sequence(self) -> bool:
        """Whether sequences differ (lengths, a per-batch mask or bias): the reference then takes them one
        at a time."""
        case = self.case
        return (case.padded or self.allowed is not None or self.bias is not None and self.bias.shape[0] > 1
                or self.alibi_slopes is not None)

    def visibility(self, b: int) -> Visibility:
        return visibility(self.case, self.case.lengths_q()[b], self.case.lengths_kv()[b])

    def bias_of(self, b: int, len_q: int, len_kv: int, device: torch.device) -> torch.Tensor | None:
        """The float64 bias of sequence b, broadcastable to [heads, len_q, len_kv] (ALiBi materialised)."""
        if self.alibi_slopes is not None:
            slopes = self.alibi_slopes[b] if self.alibi_slopes.dim() == 2 else self.alibi_slopes
            return standalone.alibi_bias(slopes, self.case.mask, self.case.lengths_q()[b],
                                         self.case.lengths_kv()[b], len_q, len_kv, device)
        if self.bias is None:
            return None
        bias = self.bias[min(b, self.bias.shape[0] - 1)]
        return bias[:, :len_q, :len_kv].to(device=device, dtype=torch.float64)


def with_sink_leaf(semantics: Semantics) -> Semantics:
    """The semantics of one call, its learnable sink logits a fresh leaf that requires grad (what `dsink` is
    the gradient of); the others unchanged."""
    if semantics.sink is None or semantics.case.softmax != "learnable":
        return semantics
    return dataclasses.replace(semantics, sink=semantics.sink.detach().clone().requires_grad_())


def dense_allowed(semantics: Semantics, device: torch.device) -> torch.Tensor | None:
    """Boolean [batch or 1, 1, seq_q, seq_kv] of the visible pairs of every sequence, padding included (a
    padded query sees nothing, a padded key is seen by nobody); None when every pair is visible. What the
    paths that take an explicit mask (SDPA, the local baseline, a user's kernel) are given."""
    return standalone.dense_allowed(semantics.case.plain(), semantics.allowed, device)


def dense_bias(semantics: Semantics, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The bias as a tensor broadcastable to [batch, heads, seq_q, seq_kv] in `dtype` (ALiBi materialised
    per sequence), for the paths that take an additive mask; None without a bias."""
    return standalone.dense_bias(semantics.case.plain(), semantics.bias, dtype, device)


def valid_tokens(case: Case, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [batch, seq_q] and [batch, seq_kv]: the tokens that exist (not padding)."""
    return standalone.valid_tokens(case.plain(), device)


def describe(case: Case) -> list[str]:
    """What the case's call computes beyond its shapes, in words, for the reports: dropout, how the mask is
    given to TE, the ALiBi slopes, the sink, the lengths."""
    lines = ["dropout 0: attn-doctor compares deterministic functions"]
    if case.mask == "arbitrary":
        source = ("the captured call's own attn_mask" if case.mask_source == "captured" else
                  f"each (query, key) pair hidden with probability {case.masked_fraction:g} (seeded)")
        lines.append(f"explicit mask: {source}; given to TE as attention_mask with True = masked out, to SDPA and "
                     "--kernel as True = visible")
    if case.window is not None and case.mask not in TOP_LEFT_MASKS:
        lines.append(f"window {case.window[0]},{case.window[1]} aligned to each sequence's bottom-right corner "
                     "(TE's bottom_right_diagonal for this mask type)")
    if case.bias == "alibi" and case.alibi_slopes is None:
        slopes = ", ".join(f"{s:.4g}" for s in alibi_slopes(case.heads).tolist())
        lines.append(f"ALiBi bias -slope_h |i + diag - j|, TE's default slopes per head: {slopes}")
    elif case.bias == "alibi":
        which = {"random": "|N(0, 1)| per head, seeded", "random-batch": "|N(0, 1)| per sequence and head, seeded"}
        slopes = (which[case.alibi_slopes] if isinstance(case.alibi_slopes, str)
                  else ", ".join(f"{s:g}" for s in case.alibi_slopes))
        lines.append(f"ALiBi bias -slope_h |i + diag - j| with custom slopes, given to TE as alibi_slopes (float32): "
                     f"{slopes}")
    elif case.bias != "no_bias":
        lines.append(f"post_scale_bias of shape {case.bias.partition(':')[2]}: standard normal, no gradient judged")
    if case.softmax == "off-by-one":
        lines.append("softmax off-by-one: a sink logit 0 in every row's denominator")
    elif case.softmax == "learnable":
        lines.append("softmax learnable: a sink logit per head (standard normal, seeded); its gradient is judged "
                     "as dSink")
    if case.padded:
        lines.append("lengths q " + ",".join(map(str, case.lengths_q())) + (
            "; kv " + ",".join(map(str, case.lengths_kv())) if case.lengths_kv() != case.lengths_q() else "")
            + "; padding is not compared (rows flagged where a kernel writes non-zeros into it)")
    if case.padding_mask:
        lines.append("TE's boolean padding mask (True = padding) passed as attention_mask alongside cu_seqlens")
    if case.fp8 != "none":
        backward = (" with an F16/BF16 backward (NVTE_FP8_DPA_BWD=0)" if case.fp8_backward == "f16"
                    else "")
        scaling = "MXFP8 block" if case.fp8 == "mxfp8" else case.fp8
        lines.append(f"FP8 attention ({scaling} scaling){backward}: judged against a simulated correct FP8 "
                     "computation (attn_doctor.numerics.fp8_simulation), not the bf16 baseline")
    if case.return_max_logit:
        lines.append("return_max_logit: each head's largest visible score is judged against float64 as 'logit' "
                     "(paths that return none are judged on the other tensors)")
    if case.num_splits != 1:
        lines.append(f"num_splits {case.num_splits}: FlashAttention 3's split control (TE's other paths refuse it)")
    if case.forward_only:
        lines.append("forward only: no backward runs (TE's module in eval mode); judged on out alone")
    return lines
