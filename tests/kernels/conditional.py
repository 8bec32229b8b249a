"""Kernels that are wrong only under one known condition: what `attn-doctor bisect` must find exactly.

Same signature as faulty.py: fn(q, k, v, *, causal, softmax_scale) -> out on bshd tensors (q
[batch, seq, heads, dim], k and v [batch, seq_kv, kv_heads, dim], GQA by repeat_interleave), fp32 math,
the input dtype out. Each kernel is correct except when its trigger holds; the trigger is decided from
the tensors the kernel receives (as a real kernel's dispatch would), and the fault is one line of
`_Attention`. This file imports only torch: the standalone repro scripts load it by path.

Faults in dq cannot show at seq 1 (one key: softmax is constant, dq is exactly 0), so a dq fault's
minimal case keeps seq >= 2; the kernels whose condition is not about seq perturb out instead, so that
their bisect finds exactly their one condition.
"""

from __future__ import annotations

import torch

DQ_SCALE = 1.05  # dq 5% too large: far beyond 3x the baseline's error in every dtype
OUT_SCALE = 1.05  # out 5% too large


def attention_fp32(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v in fp32 (bshd in and out)."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(scores.shape[-2], device=q.device)[:, None]
        cols = torch.arange(scores.shape[-1], device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2)


class _Attention(torch.autograd.Function):
    """fp32 forward and backward (autograd on a recompute); `fault` is "dq" (dq scaled), "out" (out
    scaled in the forward, gradients of the correct attention) or None (correct)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, fault):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale = causal, scale
        ctx.fault = fault
        out = attention_fp32(q, k, v, causal, scale)
        if fault == "out":
            out = out * OUT_SCALE
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out = attention_fp32(*leaves, ctx.causal, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, leaves, dout.float())
        if ctx.fault == "dq":
            dq = dq * DQ_SCALE
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def _attend(q, k, v, causal, softmax_scale, fault):
    return _Attention.apply(q, k, v, causal, softmax_scale, fault)


def correct(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct everywhere (the same autograd.Function with no fault)."""
    return _attend(q, k, v, causal, softmax_scale, None)


def seq_ge_300_noncontig(q, k, v, *, causal: bool, softmax_scale: float):
    """dq wrong only when seq >= 300 and q is not contiguous (e.g. a head-sliced view)."""
    trigger = q.shape[1] >= 300 and not q.is_contiguous()
    return _attend(q, k, v, causal, softmax_scale, "dq" if trigger else None)


def gqa_only(q, k, v, *, causal: bool, softmax_scale: float):
    """out wrong only with GQA (fewer key/value heads than query heads)."""
    trigger = k.shape[2] < q.shape[2]
    return _attend(q, k, v, causal, softmax_scale, "out" if trigger else None)


def fp16_only(q, k, v, *, causal: bool, softmax_scale: float):
    """out wrong only in fp16."""
    trigger = q.dtype == torch.float16
    return _attend(q, k, v, causal, softmax_scale, "out" if trigger else None)


def head_dim_gt_40(q, k, v, *, causal: bool, softmax_scale: float):
    """out wrong only when head_dim > 40 (bisected in steps of 8: fails at 48, passes at 40)."""
    trigger = q.shape[-1] > 40
    return _attend(q, k, v, causal, softmax_scale, "out" if trigger else None)


class _ScaledGradient(torch.autograd.Function):
    """Identity forward; the gradient scaled by `factor` (a number, or a tensor that broadcasts) in the backward."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def flash_dq_seq_ge_256(q, k, v, *, causal: bool, softmax_scale: float):
    """PyTorch's flash SDPA kernel in the input dtype (correct, with the rounding noise of a flash-style
    kernel where the exact dq cancels: one key, a window of 0), but dq 5% too large once seq >= 256: the
    kernel "wrong only on long sequences" whose bisect must find seq 256, not a degenerate case."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if q.shape[1] >= 256:
        q = _ScaledGradient.apply(q, DQ_SCALE)
    group = q.shape[2] // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2)


# --- faults confined to some tokens or heads (issue 33): how much of the tensor they touch changes with the
# case, what they do to a row they touch does not ---------------------------------------------------------

LATE_TOKENS = 512  # query positions from here on are wrong
LATE_HEADS = 2  # heads from this index on are wrong


def _late(q) -> torch.Tensor:
    return torch.arange(q.shape[1], device=q.device) >= LATE_TOKENS


def _late_heads(q) -> torch.Tensor:
    return torch.arange(q.shape[2], device=q.device) >= LATE_HEADS


def late_tokens_dq_zero(q, k, v, *, causal: bool, softmax_scale: float):
    """dq is zero for query positions from 512 on (a pure sequence-length fault: fails from seq 513)."""
    q = _ScaledGradient.apply(q, (~_late(q)).to(q.dtype)[None, :, None, None])
    return correct(q, k, v, causal=causal, softmax_scale=softmax_scale)


def late_heads_out_zero(q, k, v, *, causal: bool, softmax_scale: float):
    """out is zero for heads from index 2 on (a pure head-count fault: fails from 3 heads)."""
    out = correct(q, k, v, causal=causal, softmax_scale=softmax_scale)
    return out.masked_fill(_late_heads(q)[None, None, :, None], 0.0)


def late_tokens_and_heads_out_zero(q, k, v, *, causal: bool, softmax_scale: float):
    """out is zero at query positions from 512 on of heads from index 2 on: both conditions needed."""
    out = correct(q, k, v, causal=causal, softmax_scale=softmax_scale)
    rows = _late(q)[:, None] & _late_heads(q)[None, :]
    return out.masked_fill(rows[None, :, :, None], 0.0)


def fewer_keys_than_queries(q, k, v, *, causal: bool, softmax_scale: float):
    """out 5% too large whenever seq_kv < seq (as TE's unfused path was for cross-attention with fewer keys):
    a relation between two lengths, not a threshold on either."""
    trigger = k.shape[1] < q.shape[1]
    return _attend(q, k, v, causal, softmax_scale, "out" if trigger else None)
