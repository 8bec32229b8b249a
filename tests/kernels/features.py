"""Kernels that take attn-doctor's whole --kernel keyword set (allowed, bias, softmax_offset, seqlens): one
correct, and faults that only a feature of TE's API exposes (each correct on a dense causal call)."""

from __future__ import annotations

import torch


def _attention(q, k, v, softmax_scale, allowed, bias, softmax_offset):
    """fp32 attention on bshd tensors: `allowed` [b|1, 1, sq, skv] (True = visible), an additive bias, sink
    logits [heads]; rows that see no key output 0."""
    heads, kv_heads = q.shape[2], k.shape[2]
    qh = q.float().transpose(1, 2)
    kh, vh = (t.float().transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = qh @ kh.transpose(-1, -2) * softmax_scale
    if bias is not None:
        scores = scores + bias.float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    seq_kv = scores.shape[-1]
    if softmax_offset is not None:
        sink = softmax_offset.float().view(1, heads, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)[..., :seq_kv]
    return (probs @ vh).transpose(1, 2)


def _causal(q, k, causal):
    """Top-left causal, for a call that gave no `allowed`."""
    if not causal:
        return None
    rows, cols = torch.arange(q.shape[1], device=q.device), torch.arange(k.shape[1], device=q.device)
    return (cols[None, :] <= rows[:, None])[None, None]


def correct(q, k, v, *, causal, softmax_scale, allowed=None, bias=None, softmax_offset=None):
    """Every feature, right: must PASS everywhere."""
    mask = allowed if allowed is not None else _causal(q, k, causal)
    return _attention(q, k, v, softmax_scale, mask, bias, softmax_offset).to(q.dtype)


def _value_of_first_gradient_of_second(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """A tensor equal to `first` whose gradient is that of `second`: a correct forward with a wrong backward."""
    return first.detach() + (second - second.detach())


def backward_ignores_padding(q, k, v, *, causal, softmax_scale, allowed=None, bias=None, softmax_offset=None,
                             seqlens_kv=None):
    """Correct forward; the backward lets every query see the padded keys (as if the lengths were not given)."""
    mask = allowed if allowed is not None else _causal(q, k, causal)
    right = _attention(q, k, v, softmax_scale, mask, bias, softmax_offset)
    if seqlens_kv is not None and mask is not None:
        padded = torch.arange(k.shape[1], device=k.device)[None, :] >= seqlens_kv[:, None].to(k.device)
        mask = mask | padded[:, None, None, :]
    wrong = _attention(q, k, v, softmax_scale, mask, bias, softmax_offset)
    return _value_of_first_gradient_of_second(right, wrong).to(q.dtype)


def sink_in_forward_only(q, k, v, *, causal, softmax_scale, allowed=None, bias=None, softmax_offset=None):
    """Correct forward; the backward is that of attention without the sink (and no gradient for it)."""
    mask = allowed if allowed is not None else _causal(q, k, causal)
    right = _attention(q, k, v, softmax_scale, mask, bias, softmax_offset)
    wrong = _attention(q, k, v, softmax_scale, mask, bias, None)
    return _value_of_first_gradient_of_second(right, wrong).to(q.dtype)


def top_left_always(q, k, v, *, causal, softmax_scale, allowed=None, bias=None, softmax_offset=None):
    """Ignores the mask it is given and applies a top-left causal diagonal whenever the mask is causal:
    wrong where bottom-right was asked with seq_q != seq_kv."""
    mask = _causal(q, k, causal)
    if allowed is not None and mask is not None:
        mask = mask & allowed.any(dim=-1, keepdim=True)  # keep padded queries empty
    return _attention(q, k, v, softmax_scale, mask, bias, softmax_offset).to(q.dtype)


def writes_into_padding(q, k, v, *, causal, softmax_scale, allowed=None, bias=None, softmax_offset=None,
                        seqlens_q=None):
    """Correct on every valid token; the padded query rows hold ones instead of zeros."""
    out = correct(q, k, v, causal=causal, softmax_scale=softmax_scale, allowed=allowed, bias=bias,
                  softmax_offset=softmax_offset)
    if seqlens_q is None:
        return out
    padded = torch.arange(q.shape[1], device=q.device)[None, :] >= seqlens_q[:, None].to(q.device)
    return out + padded[:, :, None, None].to(out.dtype)


def empty_rows_mean_of_v(q, k, v, *, causal, softmax_scale, allowed=None, bias=None, softmax_offset=None):
    """Megatron's -10000 fill without the clean-up: a query that sees no key gets the mean of v."""
    mask = allowed if allowed is not None else _causal(q, k, causal)
    heads, kv_heads = q.shape[2], k.shape[2]
    qh = q.float().transpose(1, 2)
    kh, vh = (t.float().transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = qh @ kh.transpose(-1, -2) * softmax_scale
    if mask is not None:
        scores = scores.masked_fill(~mask, -10000.0)
    return (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2).to(q.dtype)


def ignores_queries_and_keys(q, k, v, *, causal, softmax_scale):
    """The mean of v for every query: out does not depend on q or k at all (their gradients are None)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    mean = v.float().mean(dim=1, keepdim=True).repeat_interleave(heads // kv_heads, dim=2)
    return mean.expand(q.shape[0], q.shape[1], heads, v.shape[-1]).to(q.dtype)


def _max_logit(q, k, softmax_scale, allowed, bias):
    """Each head's largest visible score, fp32 from the inputs (what TE's fused path returns)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    qh = q.float().transpose(1, 2)
    kh = k.float().transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    scores = qh @ kh.transpose(-1, -2) * softmax_scale
    if bias is not None:
        scores = scores + bias.float()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


def with_max_logit(q, k, v, *, causal, softmax_scale, allowed=None, bias=None, return_max_logit=False):
    """Correct, and returns the max logit when asked: must PASS."""
    mask = allowed if allowed is not None else _causal(q, k, causal)
    out = _attention(q, k, v, softmax_scale, mask, bias, None).to(q.dtype)
    return (out, _max_logit(q, k, softmax_scale, mask, bias)) if return_max_logit else out


def max_logit_unscaled(q, k, v, *, causal, softmax_scale, allowed=None, bias=None, return_max_logit=False):
    """Correct output; the max logit of the scores before the softmax scale."""
    mask = allowed if allowed is not None else _causal(q, k, causal)
    out = _attention(q, k, v, softmax_scale, mask, bias, None).to(q.dtype)
    return (out, _max_logit(q, k, 1.0, mask, bias)) if return_max_logit else out


def one_alibi_slope(q, k, v, *, causal, softmax_scale, allowed=None, bias=None):
    """ALiBi with the first head's slope for every head (a per-head slope vector broadcast wrong)."""
    mask = allowed if allowed is not None else _causal(q, k, causal)
    if bias is not None:
        bias = bias[:, :1].expand_as(bias)
    return _attention(q, k, v, softmax_scale, mask, bias, None).to(q.dtype)


def wrong_in_backward(q, k, v, *, causal, softmax_scale, allowed=None, bias=None):
    """Correct forward; the backward of attention at twice the softmax scale: only a backward can tell."""
    mask = allowed if allowed is not None else _causal(q, k, causal)
    right = _attention(q, k, v, softmax_scale, mask, bias, None)
    wrong = _attention(q, k, v, 2 * softmax_scale, mask, bias, None)
    return _value_of_first_gradient_of_second(right, wrong).to(q.dtype)
