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
implementation in this dtype gets" must not be below it. Given the output the kernel returned, this is the
error it makes by taking D from it. tests/test_numerics.py holds it to PyTorch's own CPU FlashAttention kernel
in bf16 on keys sharing a large direction: the kernel's dQ is 5.6x the math kernel's error from float64, this
part is 0.8 of the kernel's error, and it points where the excess does (cosine 0.8). Round-to-nearest of the exact
output stands for a correct kernel's output where none was returned (a kernel's own is that plus its
accumulation error, somewhat larger).
"""

from __future__ import annotations

import torch

from attn_doctor.numerics.masks import Semantics
from attn_doctor.numerics.reference import attention_reference


def output_rounding_gradients(q: torch.Tensor, k: torch.Tensor, dout: torch.Tensor, exact_out: torch.Tensor,
                              returned_out: torch.Tensor, *, softmax_scale: float, semantics: Semantics | None = None,
                              causal: bool = False) -> dict[str, torch.Tensor]:
    """How far a backward that takes D from `returned_out` (the output a kernel returned, or the exact one
    rounded to a dtype) moves dQ and dK from the exact ones (float64, bshd like q and k; see the module
    docstring). `exact_out` is the exact output on these inputs; the attention is `semantics`' (or a dense one,
    top-left causal when `causal`), as `attention_reference` takes them."""
    exact_out = exact_out.to(torch.float64)
    moved = (dout.to(torch.float64) * (returned_out.to(torch.float64) - exact_out)).sum(-1, keepdim=True)  # dD
    # One more exact attention on the same probabilities: P K as its output (k as the values), and
    # P^T (dD * Q) as its dV (dD * Q as the output gradient).
    keys_as_values = attention_reference(q, k, k, moved * q.to(torch.float64), softmax_scale=softmax_scale,
                                         semantics=semantics, causal=causal, with_terms=False)
    return {"dq": -softmax_scale * moved * keys_as_values.out, "dk": -softmax_scale * keys_as_values.dv}
