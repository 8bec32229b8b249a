"""The inputs every probe of a case shares: seeded q, k, v and output gradient, and the device helpers
that go with measuring on them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_doctor.core.case import Case

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor


def make_inputs(case: Case, device: torch.device) -> Inputs:
    """Seeded standard-normal q, k, v and output gradient (bshd), drawn in fp32 on `device` and rounded to
    the dtype: cases with equal keys get bitwise-equal inputs, in every process."""
    generator = torch.Generator(device=device).manual_seed(case.seed)
    dtype = TORCH_DTYPES[case.dtype]

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    q = draw(case.batch, case.seq, case.heads, case.head_dim)
    k = draw(case.batch, case.seq_k, case.num_kv_heads, case.head_dim)
    v = draw(case.batch, case.seq_k, case.num_kv_heads, case.head_dim)
    dout = draw(case.batch, case.seq, case.heads, case.head_dim)
    return Inputs(q, k, v, dout)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the GPU, for the other processes."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
