"""A stand-in for flash-attn's `flash_attn_func` that is wrong on purpose (it drops the last key of every
sequence), so that a capture records a faulty library call whose inputs are right (tests/models/tiny_gpt.py)."""

import torch.nn.functional as F


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)):
    """bshd in, bshd out, like flash-attn's."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k[:, :, :-1], v[:, :, :-1], scale=softmax_scale).transpose(1, 2)
