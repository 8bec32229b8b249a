"""Kernels that do not give the same answer on every call: what `--repeats N` must report.

Same signature as faulty.py: fn(q, k, v, *, causal, softmax_scale) -> out on bshd tensors (q
[batch, seq, heads, dim], k and v [batch, seq_kv, kv_heads, dim], GQA by repeat_interleave), fp32 math,
the input dtype out; gradients by autograd. This file imports only torch.
"""

from __future__ import annotations

import torch

NOISE = 3e-4  # relative noise on q: far below bf16's rounding error, but enough to change some roundings
OUT_SCALE = 1.05  # out 5% too large (so dq, dk, dv too): far beyond 3x the baseline's error

_calls = 0  # calls of `wrong_on_second_call` in this process


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


def noisy(q, k, v, *, causal: bool, softmax_scale: float) -> torch.Tensor:
    """Accurate, but not reproducible: q is perturbed by tiny relative noise drawn from torch's global
    generator, a new draw on every call (as a kernel with a nondeterministic reduction order would differ
    in its last bits). out, dq, dk and dv all differ between calls."""
    noise = 1 + NOISE * torch.randn(q.shape, device=q.device)
    return attention_fp32(q.float() * noise, k, v, causal, softmax_scale).to(q.dtype)


def wrong_on_second_call(q, k, v, *, causal: bool, softmax_scale: float) -> torch.Tensor:
    """Correct on the first of every three calls in a process and on the third, 5% wrong on the second: a
    single call passes, the worst of three fails."""
    global _calls
    call, _calls = _calls, _calls + 1
    out = attention_fp32(q, k, v, causal, softmax_scale)
    if call % 3 == 1:
        out = out * OUT_SCALE
    return out.to(q.dtype)
