"""The inputs every probe of a case shares: seeded q, k, v and output gradient, and the device helpers
that go with measuring on them.

q, k, v follow the case's input distribution (`--inputs`, `Case.inputs`); Gaussian inputs hide faults that
real activations trigger. The output gradient is standard normal for every distribution.

- normal: standard normal, the plain case every result before `--inputs` was measured on.
- uniform: U(-√3, √3), unit variance like normal but without tails: errors of the bulk alone.
- outliers: standard normal, then a few fixed head-dim channels (1 in 32, at least 1, chosen from the seed)
  ×20 in q, k and v, as LLM activations' outlier channels are: they stress low-precision accumulation.
- large-logits: standard normal with q and k ×4, so scores have a standard deviation near 16 and most
  softmax rows are close to one-hot: the softmax's saturation, where max-subtraction and exp's precision count.
- structured: rank-min(4, head dim) q, k, v (per-head basis, about unit variance) plus a per-head mean vector
  (entries ×4) added to every key, as real activations are structured: the keys are nearly equal, so dQ
  (a sum over keys whose softmax weights sum to zero) nearly cancels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_doctor.core.case import Case
from attn_doctor.numerics.masks import Semantics, alibi_slopes
from attn_doctor.numerics.source import SEEDED, Source

OUTLIER_SCALE = 20.0  # outliers: the outlier channels' factor
OUTLIER_EVERY = 32  # outliers: one outlier channel per this many head-dim channels (at least one)
LOGIT_SCALE = 4.0  # large-logits: q and k's factor (scores' std = 4 * 4 = 16)
RANK = 4  # structured: the rank of q, k, v (at most the head dim)
KEY_MEAN_SCALE = 4.0  # structured: the std of the entries of each head's shared key mean vector

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The side inputs (explicit mask, bias, sink logits) come from a generator of their own, seeded from the
# case's seed plus this, so that q, k, v and dout are drawn exactly as in a case without them.
SIDE_SEED_OFFSET = 1_000_003


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    semantics: Semantics | None = None  # mask, bias and sink of the case (`make_semantics`)


def outlier_channels(head_dim: int, seed: int) -> list[int]:
    """The head-dim channels `outliers` scales: 1 in 32 (at least one), drawn from the seed on the CPU, so
    they are the same on every device."""
    count = max(1, head_dim // OUTLIER_EVERY)
    return sorted(torch.randperm(head_dim, generator=torch.Generator().manual_seed(seed))[:count].tolist())


def make_inputs(case: Case, device: torch.device, source: Source = SEEDED) -> Inputs:
    """The values `source` has (a replayed call's), else seeded q, k, v of the case's distribution and a
    standard-normal output gradient (bshd), drawn in fp32 on `device` from one generator and rounded to the
    dtype: cases with equal keys get bitwise-equal inputs, in every process. `normal` draws exactly what it
    always drew (q, k, v, dout, in that order); the standalone repro (`attn_doctor.bisect.repro`) draws the
    same, step for step."""
    given = source.values(case, device)
    if given is not None:
        return Inputs(*given, make_semantics(case, device, source))
    generator = torch.Generator(device=device).manual_seed(case.seed)
    dtype = TORCH_DTYPES[case.dtype]
    b, s, skv, h, hkv, d = case.batch, case.seq, case.seq_kv, case.heads, case.kv_heads, case.head_dim
    dv = case.head_dim_v

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)

    if case.inputs == "uniform":
        def uniform(*shape: int) -> torch.Tensor:
            u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
            return u.mul_(2.0).sub_(1.0).mul_(3 ** 0.5).to(dtype)

        q, k, v = uniform(b, s, h, d), uniform(b, skv, hkv, d), uniform(b, skv, hkv, dv)
    elif case.inputs == "structured":
        rank = min(RANK, d)

        def low_rank(n: int, heads: int, width: int = d) -> torch.Tensor:
            """Per token `rank` coefficients of a per-head basis, summed elementwise (a matmul could take
            TF32 in one process and not in another)."""
            coefficients, basis = randn(b, n, heads, rank), randn(heads, rank, width)
            x = coefficients[..., 0, None] * basis[:, 0]
            for i in range(1, rank):
                x.addcmul_(coefficients[..., i, None], basis[:, i])
            return x.div_(rank ** 0.5)

        q = low_rank(s, h).to(dtype)
        k = low_rank(skv, hkv)
        k = k.add_(randn(hkv, d).mul_(KEY_MEAN_SCALE)).to(dtype)  # every key of a head shares its mean vector
        v = low_rank(skv, hkv, dv).to(dtype)
    else:  # normal, outliers, large-logits: standard normal, then scaled
        q_scale = k_scale = v_scale = None  # a factor, or one per head-dim channel
        if case.inputs == "outliers":
            channels = torch.ones(d, device=device, dtype=torch.float32)
            channels[outlier_channels(d, case.seed)] = OUTLIER_SCALE
            q_scale = k_scale = v_scale = channels
            if dv != d:
                v_scale = torch.ones(dv, device=device, dtype=torch.float32)
                v_scale[outlier_channels(dv, case.seed)] = OUTLIER_SCALE
        elif case.inputs == "large-logits":
            q_scale = k_scale = LOGIT_SCALE

        def draw(scale: torch.Tensor | float | None, *shape: int) -> torch.Tensor:
            x = randn(*shape)
            return (x if scale is None else x.mul_(scale)).to(dtype)

        q, k, v = draw(q_scale, b, s, h, d), draw(k_scale, b, skv, hkv, d), draw(v_scale, b, skv, hkv, dv)
    dout = randn(b, s, h, dv).to(dtype)
    return Inputs(q, k, v, dout, make_semantics(case, device, source))


def make_semantics(case: Case, device: torch.device, source: Source = SEEDED) -> Semantics:
    """The case's explicit mask, bias and sink logits (`attn_doctor.numerics.masks`), seeded, and a packed
    call's own slots when `source` has them:

    - arbitrary mask "random:P": each (query, key) pair of each sequence hidden with probability P; "captured":
      `source`'s (a replayed call's own mask);
    - post_scale_bias: `source`'s (a replayed call's own, when its values were captured), else standard normal
      in the inputs' dtype (TE takes the bias in the inputs' dtype);
    - alibi: TE's default slopes;
    - off-by-one: sink logits 0; learnable: standard normal sink logits per head, float32 (TE's parameter)."""
    semantics = Semantics(case, slots=source.slots(case))
    if case.mask != "arbitrary" and case.bias == "no_bias" and case.softmax == "vanilla":
        return semantics
    generator = torch.Generator(device=device).manual_seed(case.seed + SIDE_SEED_OFFSET)
    if case.mask == "arbitrary" and case.mask_source == "captured":
        semantics.allowed = source.allowed(case, device)
    elif case.mask == "arbitrary":
        draws = torch.rand(case.batch, 1, case.seq, case.seq_kv, generator=generator, device=device)
        semantics.allowed = draws >= case.masked_fraction
    if case.bias == "alibi":
        semantics.alibi_slopes = alibi_slopes(case.heads).to(device)
    elif case.bias != "no_bias":
        semantics.bias = source.bias(case, device)
        if semantics.bias is None:
            semantics.bias = torch.randn(case.bias_shape, generator=generator, device=device).to(
                TORCH_DTYPES[case.dtype])
    if case.softmax == "off-by-one":
        semantics.sink = torch.zeros(case.heads, device=device)
    elif case.softmax == "learnable":
        semantics.sink = torch.randn(case.heads, generator=generator, device=device)
    return semantics


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the GPU, for the other processes."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
