"""Kernels with the `--kernel` signature that run out of memory the way torch's allocator says so on a GPU, so that
the CPU tests see what a GPU would show."""

from __future__ import annotations

import torch
import torch.nn.functional as F

OUT_OF_MEMORY = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
                 "1.50 GiB is free.")
_calls = [0]


def never_fits(q, k, v, *, causal: bool, softmax_scale: float):
    """Runs out of memory whenever it is called, alone or not."""
    raise torch.OutOfMemoryError(OUT_OF_MEMORY)


def fits_alone(q, k, v, *, causal: bool, softmax_scale: float):
    """Runs out of memory on its first call in a process (beside the other workers, as it were), then is correct
    attention in fp32 (PyTorch's math kernel)."""
    _calls[0] += 1
    if _calls[0] == 1:
        raise torch.OutOfMemoryError(OUT_OF_MEMORY)
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=softmax_scale)
    return out.transpose(1, 2).to(torch.bfloat16)
