"""A kernel whose backward error is tiny in one call but compounds through a deep stack.

`compounding_backward` has a correct forward; its backward multiplies dq, dk and dv by (1 + DELTA) ** n,
where n counts the backward calls since the current forward pass began. A forward pass is two or more forward
calls in a row (a stack's layers); the one forward between two backward calls is the recomputation of the layer
about to be differentiated (attn-doctor's stacks recompute each layer, as Megatron's activation recomputation
does), which continues the backward pass. In an L-layer stack the last layer's backward is call 1 and the first
layer's is call L, so layer 1's dQ is off by (1 + DELTA) ** L times whatever the layers above passed down:
0.25% at one layer, about 4% at sixteen and 37% at 128.

Self-contained (the worker loads it by file path), fp32 compute, returns the input dtype.
"""

from __future__ import annotations

import torch

DELTA = 0.0025

_state = {"calls": 0, "last": "backward"}


def _attention_fp32(q, k, v, causal: bool, scale: float) -> torch.Tensor:
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


class _Compounding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        if _state["last"] == "forward":  # a forward after a forward: a forward pass, start counting again
            _state["calls"] = 0
        _state["last"] = "forward"
        ctx.save_for_backward(q, k, v)
        ctx.causal, ctx.scale = causal, scale
        return _attention_fp32(q, k, v, causal, scale).to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors
        _state["calls"] += 1
        _state["last"] = "backward"
        factor = (1.0 + DELTA) ** _state["calls"]
        with torch.enable_grad():
            leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
            out = _attention_fp32(*leaves, ctx.causal, ctx.scale)
            dq, dk, dv = torch.autograd.grad(out, leaves, dout.float())
        return (dq * factor).to(q.dtype), (dk * factor).to(k.dtype), (dv * factor).to(v.dtype), None, None


def compounding_backward(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct forward; backward call n of a pass scales dq, dk, dv by (1 + DELTA) ** n."""
    return _Compounding.apply(q, k, v, causal, softmax_scale)


def reset() -> None:
    """Forget the count (for tests that call the kernel in-process)."""
    _state.update(calls=0, last="backward")


SLOW_S = 0.3


def slow_correct(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct attention that takes SLOW_S seconds per call: keeps a sweep in flight long enough to kill it."""
    import time

    time.sleep(SLOW_S)
    return _attention_fp32(q, k, v, causal, softmax_scale).to(q.dtype)
