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
  yardstick of an FP8 kernel is what correct FP8 arithmetic gets, never the bf16 baseline's error.
"""

from __future__ import annotations

import torch

from attn_doctor.backends.base import Backend, BackendSpec, PathMemory
from attn_doctor.core.case import DTYPE_BYTES, Case
from attn_doctor.numerics import fp8_simulation
from attn_doctor.numerics.masks import Semantics, dense_allowed, dense_bias
from attn_doctor.numerics.reference import allowed_mask

MEGATRON_MASK_FILL = -10000.0
# The repro script defines megatron_local itself (it is the baseline every verdict needs).
REPRO_SOURCE = '''

FORMAT = "sbhd"


def kernel(q, k, v, case):
    return megatron_local(q, k, v, case["sink"])
'''


def megatron_core_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, visible: torch.Tensor | None,
    bias: torch.Tensor | None = None, sink: torch.Tensor | None = None, fp8: bool = False,
) -> torch.Tensor:
    """Megatron's core attention on sbhd tensors; `visible` is the boolean mask, broadcastable to
    [batch, heads, seq_q, seq_kv] (None: all visible); `bias` is added to the scores, `sink` [heads] holds
    the sink logits; `fp8` simulates a correct FP8 attention (`fp8_simulation`)."""
    seq_q, batch, heads, head_dim = q.shape
    seq_kv, _, kv_heads, _ = k.shape
    head_dim_v = v.shape[-1]
    if fp8:
        q, k, v = (fp8_simulation.quantize(t, "e4m3", "e5m2") for t in (q, k, v))
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    q2 = q.reshape(seq_q, batch * heads, head_dim)
    k2 = k.reshape(seq_kv, batch * heads, head_dim)
    buffer = torch.empty(batch * heads, seq_q, seq_kv, dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(
        buffer, q2.transpose(0, 1), k2.transpose(0, 1).transpose(1, 2), beta=0.0, alpha=softmax_scale
    ).view(batch, heads, seq_q, seq_kv)

    in_float16 = q.dtype in (torch.float16, torch.bfloat16)
    x = scores.float() if in_float16 else scores
    if fp8:
        x = fp8_simulation.quantize(x, None, "e5m2")  # dS is quantised in the backward
    if bias is not None:
        x = x + bias.to(x.dtype)
    if visible is not None:
        x = x.masked_fill(~visible, MEGATRON_MASK_FILL)
    if sink is not None:
        column = sink.to(x.dtype).view(1, heads, 1, 1).expand(batch, heads, seq_q, 1)
        probs = torch.softmax(torch.cat([x, column], dim=-1), dim=-1)[..., :seq_kv]
    else:
        probs = torch.softmax(x, dim=-1)
    if visible is not None:
        probs = probs * visible.any(dim=-1, keepdim=True)  # rows that see no key: 0 (TE's convention)
    if fp8:
        probs = fp8_simulation.quantize(probs, "e4m3", "e5m2")
    if in_float16:
        probs = probs.to(q.dtype)

    v2 = v.reshape(seq_kv, batch * heads, head_dim_v)
    context = torch.bmm(probs.reshape(batch * heads, seq_q, seq_kv), v2.transpose(0, 1))
    out = context.view(batch, heads, seq_q, head_dim_v).permute(2, 0, 1, 3)
    return fp8_simulation.quantize(out, "e4m3", "e5m2") if fp8 else out


class LocalAttention(Backend):
    family = "local"
    qkv_format = "sbhd"
    cp_method = "explicit global causal mask (Megatron masked_fill)"

    @classmethod
    def paths(cls) -> list[BackendSpec]:
        return [BackendSpec("local", cls.family)]

    @classmethod
    def memory(cls, spec: BackendSpec, case: Case) -> PathMemory:
        # Input-dtype scores, an fp32 copy, the masked fill and the fp32 softmax, whose output is kept with
        # the input-dtype probabilities for the backward.
        scores, item = case.score_elements, DTYPE_BYTES[case.dtype]
        return PathMemory(saved=scores * (4 + item), transient=scores * (item + 4 + 4))

    @classmethod
    def repro_source(cls, spec: BackendSpec) -> str:
        return REPRO_SOURCE

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case,
                semantics: Semantics | None = None) -> torch.Tensor:
        if semantics is None:
            visible = allowed_mask(torch.arange(q.shape[0], device=q.device), torch.arange(k.shape[0], device=q.device),
                                   case.causal, case.window)
            return megatron_core_attention(q, k, v, case.softmax_scale, visible)
        return megatron_core_attention(q, k, v, case.softmax_scale, dense_allowed(semantics, q.device),
                                       dense_bias(semantics, torch.float32, q.device), semantics.sink,
                                       fp8=case.fp8 != "none")

    def attend_at(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  case: Case) -> torch.Tensor:
        visible = allowed_mask(positions, torch.arange(k.shape[1], device=q.device), case.causal, case.window)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # sbhd views
        return megatron_core_attention(q, k, v, case.softmax_scale, visible).transpose(0, 1)

    def ran(self, out: torch.Tensor) -> str:
        return "Megatron local: baddbmm + fp32 softmax"
