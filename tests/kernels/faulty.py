"""Kernels with the `--kernel` signature fn(q, k, v, *, causal, softmax_scale) -> out, on bshd tensors.

q is [batch, seq, heads, dim], k and v [batch, seq_kv, kv_heads, dim] (GQA by repeat_interleave).
All compute in fp32 and return the input dtype. Each fault is one line of `_Attention.backward` or of
the kernel function, so what makes a kernel wrong is easy to see.
"""

from __future__ import annotations

import torch


def attention_fp32(q, k, v, causal: bool, scale: float, shift: int = 0) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v in fp32; with causal, query i sees keys j <= i + shift."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(scores.shape[-2], device=q.device)[:, None]
        cols = torch.arange(scores.shape[-1], device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + shift, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2)


class _Attention(torch.autograd.Function):
    """Correct fp32 forward; the backward recomputes it with autograd, then applies `fault`."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, fault):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale, ctx.fault = causal, scale, fault
        return attention_fp32(q, k, v, causal, scale).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        shift = 1 if ctx.fault == "causal_shift" else 0
        with torch.enable_grad():
            leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out = attention_fp32(*leaves, ctx.causal, ctx.scale, shift=shift)
            dq, dk, dv = torch.autograd.grad(out, leaves, dout.float())
        if ctx.fault == "dq_two_percent":
            dq = dq * 1.02
        if ctx.fault == "dq_one_percent":
            dq = dq * 1.01
        if ctx.fault == "nan_dk":
            dk[:, :, 0] = float("nan")  # every entry of kv head 0
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def correct_fp32(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct attention (autograd backward): must PASS everywhere."""
    return attention_fp32(q, k, v, causal, softmax_scale).to(q.dtype)


def dq_two_percent(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct forward; dq 2% too large."""
    return _Attention.apply(q, k, v, causal, softmax_scale, "dq_two_percent")


def dq_one_percent(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct forward; dq 1% too large: in bf16 under 3x the baseline's error, a systematic error."""
    return _Attention.apply(q, k, v, causal, softmax_scale, "dq_one_percent")


def causal_shift_backward(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct forward; the backward's causal mask lets query i also see key i + 1."""
    return _Attention.apply(q, k, v, causal, softmax_scale, "causal_shift")


def nan_one_head_dk(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct forward, dq and dv; dk of kv head 0 is NaN."""
    return _Attention.apply(q, k, v, causal, softmax_scale, "nan_dk")


def _as_if_contiguous(t: torch.Tensor) -> torch.Tensor:
    """`t`'s storage read from its offset with contiguous strides: what a kernel that ignores strides sees."""
    strides, step = [], 1
    for size in reversed(t.shape):
        strides.insert(0, step)
        step *= size
    return torch.as_strided(t, t.shape, strides, t.storage_offset())


def ignores_strides(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct on contiguous inputs; on views it reads the wrong elements."""
    q, k, v = (_as_if_contiguous(t) for t in (q, k, v))
    return attention_fp32(q, k, v, causal, softmax_scale).to(q.dtype)


def scale_blind(q, k, v, *, causal: bool, softmax_scale: float):
    """Right at 1/sqrt(head_dim), wrong at any other softmax scale: it never reads the one it is given."""
    return attention_fp32(q, k, v, causal, q.shape[-1] ** -0.5).to(q.dtype)
