"""Kernels that misbehave only on one rank of a distributed launch (torch.distributed rank 1).

The --kernel signature fn(q, k, v, *, causal, softmax_scale) -> out on bshd tensors (q [batch, seq,
heads, dim], k and v [batch, seq_kv, kv_heads, dim], GQA by repeat_interleave), fp32 math, the input
dtype out. Outside a process group (or on any other rank) each one is correct attention, so the
single-process run on rank 0 is correct and only rank 1's shard can be wrong. Self-contained: the ranks
load it by file path.
"""

from __future__ import annotations

import os
import time

import torch

DQ_SCALE = 1.05  # dq 5% too large on rank 1: far beyond 3x the baseline's error


def on_rank(rank: int) -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_rank() == rank


def attention_fp32(q, k, v, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + top-left causal mask) v in fp32 (bshd in and out)."""
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


class _DqScaledOnRank1(torch.autograd.Function):
    """Correct forward; the backward's dq is DQ_SCALE too large, on rank 1 only."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale = causal, scale
        return attention_fp32(q, k, v, causal, scale).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out = attention_fp32(*leaves, ctx.causal, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, leaves, dout.float())
        if on_rank(1):
            dq = dq * DQ_SCALE
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def correct(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct on every rank."""
    return attention_fp32(q, k, v, causal, softmax_scale).to(q.dtype)


def dq_wrong_on_rank1(q, k, v, *, causal: bool, softmax_scale: float):
    """dq 5% too large on rank 1; correct elsewhere."""
    return _DqScaledOnRank1.apply(q, k, v, causal, softmax_scale)


def exits_on_rank1(q, k, v, *, causal: bool, softmax_scale: float):
    """Rank 1's process vanishes (os._exit(9), no traceback); correct elsewhere."""
    if on_rank(1):
        os._exit(9)
    return correct(q, k, v, causal=causal, softmax_scale=softmax_scale)


def raises_on_rank1(q, k, v, *, causal: bool, softmax_scale: float):
    """A Python exception on rank 1 only."""
    if on_rank(1):
        raise RuntimeError("injected failure on rank 1")
    return correct(q, k, v, causal=causal, softmax_scale=softmax_scale)


def hangs_on_rank1(q, k, v, *, causal: bool, softmax_scale: float):
    """Rank 1 never returns (sleeps far past any timeout the tests give); correct elsewhere."""
    if on_rank(1):
        time.sleep(120)
    return correct(q, k, v, causal=causal, softmax_scale=softmax_scale)
