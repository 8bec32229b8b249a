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
- deep-layer: standard normal q, k, v, plus one direction per head shared by every key and another by every
  value, each of norm 2 x sqrt(head dim) (twice a token's own part: `standalone.SHARED_DIRECTION`), as the
  keys and values of a deep layer of a transformer share a large common component. The shared key direction
  adds a constant to each row's scores, which the softmax removes, so the exact dQ does not see it, but a
  flash-style backward's D, taken from its rounded output, multiplies it into dQ: the case where a correct
  flash-style dQ is several times less accurate than an unfused one (`attn_doctor.numerics.rounded_output`).
  With it PyTorch's CPU flash kernel reproduces, at b4 s1024 h16 d64 bf16 causal, what the H200 showed on a
  Megatron GPT's 3rd and 4th layers (reports/h200/megatron/run-1): dQ's worst head at 0.79 eps of its terms'
  scale (the H200: 0.76-0.78), the baseline 0.09. The GPT's own captured keys and values share a direction of
  1.0 (largest 1.16) times their spread at its 4th layer (benchmarks/evidence/shared_direction.py, run-2); with
  Gaussian queries and output gradients it takes 2 to make the same flash-style error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_doctor.core.case import Case
from attn_doctor.numerics.masks import Semantics
from attn_doctor.numerics.source import SEEDED, Source
from attn_doctor.numerics.standalone import (
    case_alibi_slopes,
    draw_bias,
    draw_explicit_mask,
    draw_inputs,
    side_generator,
    sink_logits,
)


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    semantics: Semantics | None = None  # mask, bias and sink of the case (`make_semantics`)


def make_inputs(case: Case, device: torch.device, source: Source = SEEDED) -> Inputs:
    """The values `source` has (a replayed call's), else seeded q, k, v of the case's distribution and a
    standard-normal output gradient (bshd), drawn in fp32 on `device` from one generator and rounded to the
    dtype: cases with equal keys get bitwise-equal inputs, in every process. `normal` draws exactly what it
    always drew (q, k, v, dout, in that order). The drawing is `attn_doctor.numerics.standalone.draw_inputs`,
    which the standalone repro holds too."""
    given = source.values(case, device)
    if given is None:
        given = draw_inputs(case.plain(), device)
    return Inputs(*given, make_semantics(case, device, source))


def make_semantics(case: Case, device: torch.device, source: Source = SEEDED) -> Semantics:
    """The case's explicit mask, bias and sink logits (`attn_doctor.numerics.masks`), seeded, and a packed
    call's own slots when `source` has them:

    - arbitrary mask "random:P": each (query, key) pair of each sequence hidden with probability P; "captured":
      `source`'s (a replayed call's own mask);
    - post_scale_bias: `source`'s (a replayed call's own, when its values were captured), else standard normal
      in the inputs' dtype (TE takes the bias in the inputs' dtype);
    - alibi: TE's default slopes, or the case's custom ones (`standalone.case_alibi_slopes`);
    - off-by-one: sink logits 0; learnable: standard normal sink logits per head, float32 (TE's parameter)."""
    semantics = Semantics(case, slots=source.slots(case))
    if case.mask != "arbitrary" and case.bias == "no_bias" and case.softmax == "vanilla":
        return semantics
    plain = case.plain()
    generator = side_generator(plain, device)
    if case.mask == "arbitrary" and case.mask_source == "captured":
        semantics.allowed = source.allowed(case, device)
    elif case.mask == "arbitrary":
        semantics.allowed = draw_explicit_mask(generator, plain, device)
    if case.bias == "alibi":
        semantics.alibi_slopes = case_alibi_slopes(plain).to(device)
    elif case.bias != "no_bias":
        semantics.bias = source.bias(case, device)
        if semantics.bias is None:
            semantics.bias = draw_bias(generator, plain, device)
    semantics.sink = sink_logits(generator, plain, device)
    return semantics


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the GPU, for the other processes."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
