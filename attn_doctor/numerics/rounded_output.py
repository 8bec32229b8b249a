"""The part of dQ's and dK's error that every flash-style backward makes on given inputs, in float64.

A flash-style backward (FlashAttention 2/3, cuDNN's fused attention, PyTorch's memory-efficient kernel, TE's
fused and flash paths) keeps only the output O it returned, rounded to the input dtype, and takes the softmax
backward's row term from it: D_i = dO_i . O_i. The exact D_i is dO_i . out_i with the exact output. So

    dS_ij = P_ij (dP_ij - D_i - dD_i),   dD_i = dO_i . (O_i - out_i)

and the exact gradients move by

    ddQ_i = -c dD_i sum_j P_ij k_j   = -c dD_i (P K)_i
    ddK_j = -c sum_i P_ij dD_i q_i   = -c (P^T (dD * Q))_j

An unfused backward (Megatron's `local`, TE's unfused path, autograd of a softmax) takes D from the same
probabilities it differentiates, so its dS rows sum to zero and a component that all keys of a row share
cancels out of dQ exactly. A flash-style dS row sums to -P_i. dD_i: that shared component is multiplied
into dQ, and where the exact dQ is small against it (keys with a large common direction, as deep layers of a
trained transformer have) the flash-style error in dQ is several times the unfused one, in every correct
flash-style kernel alike. Seen on the H200 on a Megatron GPT's 4th layer (reports/h200/megatron/run-1): dQ
1.2e-2 from float64 for TE's cuDNN path and for PyTorch's flash, efficient and cuDNN kernels, 2.1e-3 for the
unfused paths, on the same inputs.

So the error a correct flash-style kernel makes is at least this one, and a yardstick for "what a correct
implementation in this dtype gets" must not be below it: the verdict adds it to a flash-style path's yardstick
for dQ and dK (`attn_doctor.verdict.rule`, "Flash-style paths"), computed once per case from the exact output
rounded to the inputs' dtype (`case_figures`), and `compare` adds it, from the output each run returned, to what
a correct kernel gets on that run's inputs. Given the output the kernel returned, this is the
error it makes by taking D from it. tests/test_numerics.py holds it to PyTorch's own CPU FlashAttention kernel
in bf16 on keys sharing a large direction: the kernel's dQ is 5.6x the math kernel's error from float64, this
part is 0.8 of the kernel's error, and it points where the excess does (cosine 0.8). Round-to-nearest of the exact
output stands for a correct kernel's output where none was returned: the same size of part, measured on keys and
values sharing a direction twice their own size (b2 s512 h4 d64 bf16 causal: 0.54 eps of the terms' scale
against the CPU kernel's whole dQ error of 0.55), though not the same values (a kernel's output also holds its
own accumulation error, so its D rounds differently: 0.31 eps apart), which is why it serves as a size, in the
yardstick, and is not subtracted.
The formula is `attn_doctor.numerics.standalone.output_rounding_moves`, which the standalone repro holds too.
"""

from __future__ import annotations

import torch

from attn_doctor.core.case import Case
from attn_doctor.numerics.masks import Semantics
from attn_doctor.numerics.metrics import TensorMetrics, compare
from attn_doctor.numerics.reference import Reference, attention_reference
from attn_doctor.numerics.standalone import TORCH_DTYPES, output_rounding_moves

TENSORS = ("dq", "dk")  # the gradients D reaches (out and dV do not use it)


def output_rounding_gradients(q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor, exact_out: torch.Tensor,
                              returned_out: torch.Tensor, *, softmax_scale: float, semantics: Semantics | None = None,
                              causal: bool = False) -> dict[str, torch.Tensor]:
    """How far a backward that takes D from `returned_out` (the output a kernel returned, or the exact one
    rounded to a dtype) moves dQ and dK from the exact ones (float64, bshd like q and k; see the module
    docstring). `exact_out` is the exact output on these inputs; the attention is `semantics`' (or a dense one,
    top-left causal when `causal`), as `attention_reference` takes them."""

    def attend_keys(gradient: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One more exact attention on the same probabilities: the keys as its values, dD * Q as its output gradient.
        keys = attention_reference(q, k, k, gradient, softmax_scale=softmax_scale, semantics=semantics,
                                   causal=causal, with_terms=False, value_gradient_only=True)
        return keys.out, keys.dv

    return output_rounding_moves(q, dout, exact_out, returned_out, softmax_scale, attend_keys)


def applies(case: Case) -> bool:
    """Whether a flash-style backward's output rounding is part of what a correct kernel gets on the case: not
    with FP8, whose yardstick is a simulated FP8 attention (`attn_doctor.numerics.fp8_simulation`)."""
    return case.fp8 == "none"


def case_figures(case: Case, q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor, reference: Reference,
                 semantics: Semantics | None, masks: dict[str, dict[str, torch.Tensor | None]]
                 ) -> dict[str, TensorMetrics]:
    """The error a correct flash-style backward's output rounding alone makes in dQ and dK on the case's inputs,
    measured as any kernel's error is (against the reference, with its terms and compared rows `masks`): the
    exact output rounded to the inputs' dtype stands for the kernel's. {} where it does not apply."""
    if not applies(case) or reference.dq is None:
        return {}
    rounded = reference.out.to(TORCH_DTYPES[case.dtype])
    moved = output_rounding_gradients(q, k, dout, reference.out, rounded, softmax_scale=case.softmax_scale,
                                      semantics=semantics)
    figures = {}
    for name in TENSORS:
        exact = getattr(reference, name)
        figures[name] = compare(exact + moved[name], exact, reference.terms(name), **masks.get(name, {}))
    return figures
