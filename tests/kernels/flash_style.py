"""A flash-style attention with the `--kernel` signature, and faults of it.

The backward is FlashAttention's: it recomputes the probabilities P in fp32 from q and k and takes the softmax
backward's row term D_i = dO_i . O_i from the output O it returned, rounded to the inputs' dtype. Everything else
is fp32, and the gradients are rounded to the inputs' dtype. So a correct one makes exactly the error of a
flash-style backward's output rounding (`attn_doctor.numerics.rounded_output`) on top of rounding its results;
each fault is one line of `_FlashStyle.backward`. Each kernel says it is flash-style (`NAME.flash_style = True`,
read by `attn_doctor.backends.kernel`). q, k, v bshd, one key/value head per query head, causal or no mask.
"""

from __future__ import annotations

import torch


def _probabilities(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) in fp32, [b, h, s, s_kv]; causal: query i sees keys j <= i."""
    scores = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) * scale
    if causal:
        rows = torch.arange(scores.shape[-2])[:, None]
        scores = scores.masked_fill(torch.arange(scores.shape[-1])[None, :] > rows, float("-inf"))
    return torch.softmax(scores, dim=-1)


class _FlashStyle(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, fault):
        out = torch.einsum("bhst,bthd->bshd", _probabilities(q, k, causal, scale), v.float()).to(q.dtype)
        ctx.save_for_backward(q, k, v, out)
        ctx.causal, ctx.scale, ctx.fault = causal, scale, fault
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out = ctx.saved_tensors
        fault, scale = ctx.fault, ctx.scale
        probs = _probabilities(q, k, ctx.causal, scale)
        dp = torch.einsum("bshd,bthd->bhst", dout.float(), v.float())
        products = dout.float() * out.float()
        if fault == "d_from_half_the_channels":
            products = products[..., : products.shape[-1] // 2]
        rows = products.sum(-1).transpose(1, 2)[..., None]  # D, from the output it returned
        if fault == "d_one_percent":
            rows = rows * 1.01
        ds = probs * (dp - rows)
        dq = torch.einsum("bhst,bthd->bshd", ds, k.float()) * scale
        dk = torch.einsum("bhst,bshd->bthd", ds, q.float()) * scale
        dv = torch.einsum("bhst,bshd->bthd", probs, dout.float())
        factors = {"dq_one_percent": (1.01, 1, 1), "dq_five_percent": (1.05, 1, 1),
                   "dk_five_percent": (1, 1.05, 1), "dv_five_percent": (1, 1, 1.05)}.get(fault, (1, 1, 1))
        dq, dk, dv = (g * f for g, f in zip((dq, dk, dv), factors))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def flash_style(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct: must PASS everywhere it runs, deep-layer inputs included."""
    return _FlashStyle.apply(q, k, v, causal, softmax_scale, None)


def d_one_percent(q, k, v, *, causal: bool, softmax_scale: float):
    """D taken 1% too large."""
    return _FlashStyle.apply(q, k, v, causal, softmax_scale, "d_one_percent")


def d_from_half_the_channels(q, k, v, *, causal: bool, softmax_scale: float):
    """D summed over the first half of the head dim only (a tile that misses the rest)."""
    return _FlashStyle.apply(q, k, v, causal, softmax_scale, "d_from_half_the_channels")


def dq_one_percent(q, k, v, *, causal: bool, softmax_scale: float):
    return _FlashStyle.apply(q, k, v, causal, softmax_scale, "dq_one_percent")


def dq_five_percent(q, k, v, *, causal: bool, softmax_scale: float):
    return _FlashStyle.apply(q, k, v, causal, softmax_scale, "dq_five_percent")


def dk_five_percent(q, k, v, *, causal: bool, softmax_scale: float):
    return _FlashStyle.apply(q, k, v, causal, softmax_scale, "dk_five_percent")


def dv_five_percent(q, k, v, *, causal: bool, softmax_scale: float):
    return _FlashStyle.apply(q, k, v, causal, softmax_scale, "dv_five_percent")


flash_style.flash_style = True
d_one_percent.flash_style = True
d_from_half_the_channels.flash_style = True
dq_one_percent.flash_style = True
dq_five_percent.flash_style = True
dk_five_percent.flash_style = True
dv_five_percent.flash_style = True
