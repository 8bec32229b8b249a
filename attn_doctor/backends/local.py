"""Megatron-LM's `--transformer-impl local` core attention, the baseline every verdict is measured against.

A faithful copy of megatron/core/transformer/dot_product_attention.py with the torch path of
megatron/core/fusions/fused_softmax.py (FusedScaleMaskSoftmax.forward_torch_softmax), as the reports
ran it (`--attention-softmax-in-fp32`, no query-key layer scaling, no dropout):
scores by baddbmm in the input dtype, softmax in fp32 after `masked_fill(mask, -10000.0)`, probabilities
rounded back to the input dtype, then bmm with v. GQA by repeat_interleave, as Megatron does.

Departures, each needed to cover every case attn-doctor checks:
- every mask (TE's mask types, lengths, windows, explicit masks: `attn_doctor.numerics.masks`) is one
  seq_q x seq_kv boolean mask applied with the same masked_fill; Megatron's fused CUDA softmax kernels are
  not used (for causal masks they also give masked entries probability exactly 0, like the fill in fp32);
- a bias is added to the fp32 scores before the fill (TE's post_scale_bias; ALiBi materialised);
- a softmax sink is one more logit column in the fp32 softmax, dropped after it (as Megatron-core's own
  softmax_type support does), so its probability is in the denominator only;
- rows that see no key get probability 0 everywhere (TE's convention: out 0, no gradient) instead of the
  fill's uniform row, which would make the baseline differ from exact by design on those rows;
- FP8 (`--fp8`): the baseline is a simulation of a correct FP8 attention (`fp8_simulation`), since the
  yardstick of an FP8 kernel is what correct FP8 arithmetic gets, never the bf16 baseline's error;
- the max logit (`--max-logit`, TE's return_max_logit) is the largest of these scores over the visible pairs.

The computation is `attn_doctor.numerics.standalone.megatron_core_attention`, which the standalone repro
scripts hold too.
"""

from __future__ import annotations

import torch

from attn_doctor.backends.base import Backend, BackendSpec, PathMemory, ShortCall
from attn_doctor.core.case import DTYPE_BYTES, Case
from attn_doctor.numerics.masks import Semantics, dense_allowed, dense_bias
from attn_doctor.numerics.reference import allowed_mask
from attn_doctor.numerics.standalone import fp8_mode, megatron_core_attention, megatron_max_logit

# The repro script has megatron_local (the baseline every verdict needs) whatever path it reproduces.
REPRO_SOURCE = '''

FORMAT = "sbhd"


def kernel(q, k, v, case):
    return megatron_local(q, k, v, case["sink"])
'''


class LocalAttention(Backend):
    family = "local"
    qkv_format = "sbhd"
    cp_method = "explicit global causal mask (Megatron masked_fill)"
    probe_seconds = {"local": 0.1}  # H100, from a cold start: 0.09 s (te-tests) to 0.11 s (te-coverage) a probe
    fixed_paths = (("local", {}),)

    @classmethod
    def memory(cls, spec: BackendSpec, case: Case) -> PathMemory:
        # Input-dtype scores, an fp32 copy, the masked fill and the fp32 softmax, whose output is kept with the
        # input-dtype probabilities for the backward, and the backward's fp32 gradients of the softmax and the fill:
        # measured on an H100, 24 bytes a score in bf16 all told (seq 32768, one head: 24.1 GiB reserved).
        scores, item = case.score_elements, DTYPE_BYTES[case.dtype]
        return PathMemory(saved=scores * (4 + item), transient=scores * (16 + item))

    @classmethod
    def repro_source(cls, spec: BackendSpec) -> str:
        return REPRO_SOURCE

    @classmethod
    def short_call(cls, spec: BackendSpec, case: Case) -> ShortCall:
        return ShortCall("sbhd", "", "\ndef kernel(q, k, v):  # the path under test is the baseline itself\n"
                                     "    return local(q, k, v)\n")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case,
                semantics: Semantics | None = None) -> torch.Tensor:
        if semantics is None:
            visible = allowed_mask(torch.arange(q.shape[0], device=q.device), torch.arange(k.shape[0], device=q.device),
                                   case.causal, case.window)
            return megatron_core_attention(q, k, v, case.softmax_scale, visible)
        visible, bias = dense_allowed(semantics, q.device), dense_bias(semantics, torch.float32, q.device)
        self._max_logit = megatron_max_logit(q, k, case.softmax_scale, visible, bias) if case.return_max_logit else None
        return megatron_core_attention(q, k, v, case.softmax_scale, visible, bias, semantics.sink,
                                       fp8=fp8_mode(case.plain()))

    def max_logit(self) -> torch.Tensor | None:
        """The largest score per head as this baseline computes its scores (input-dtype baddbmm, fp32 bias)."""
        return getattr(self, "_max_logit", None)

    def attend_at(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  case: Case) -> torch.Tensor:
        visible = allowed_mask(positions, torch.arange(k.shape[1], device=q.device), case.causal, case.window)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # sbhd views
        return megatron_core_attention(q, k, v, case.softmax_scale, visible).transpose(0, 1)

    def ran(self, out: torch.Tensor) -> str:
        return "Megatron local: baddbmm + fp32 softmax"
