"""A correct kernel that takes its time: what a long run looks like to the heartbeat (`render/progress.py`)."""

from __future__ import annotations

import time

import torch

SECONDS_PER_CALL = 1.0


def sleeps(q, k, v, *, causal: bool, softmax_scale: float):
    """Correct attention (SDPA's math on bshd tensors, autograd backward) after a second's sleep."""
    time.sleep(SECONDS_PER_CALL)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2)
