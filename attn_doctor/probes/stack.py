"""A deep Megatron-style GPT stack in which only the core attention changes between backends.

Each of the L blocks: pre-LayerNorm, fused qkv projection split the way Megatron splits `linear_qkv`
([s, b, kv_heads, (group + 2) * d] along the last dim), core attention, output projection, residual; a
final LayerNorm. Weights are seeded at GPT scale (std 0.02; output projections 0.02 / sqrt(2 L)) and rounded
to the model dtype once, so the float64 replica runs on exactly the weights the low-precision stack uses.
Backward starts from a seeded output gradient; dQ is captured at every layer by a hook on q.

Tensor parallelism inside the stack: with tp = t, each layer's core attention runs as t separate calls,
one per head shard, each on its slice of the mixed qkv tensor (the views a TP rank's attention sees),
and the shard outputs are joined along heads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from attn_doctor.core.case import Case
from attn_doctor.numerics.reference import Float64Attention

# attention(q, k, v) on sbhd tensors [s, b, heads, d] -> out [s, b, heads, d]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Called as each layer's forward ("forward", index) and backward ("backward", index) is done.
OnLayer = Callable[[str, int], None]
INIT_STD = 0.02


@dataclass
class LayerWeights:
    ln_weight: torch.Tensor
    ln_bias: torch.Tensor
    qkv_weight: torch.Tensor  # [(heads + 2 kv_heads) d, hidden], rows ordered per kv group as Megatron
    qkv_bias: torch.Tensor
    proj_weight: torch.Tensor  # [hidden, heads d]
    proj_bias: torch.Tensor

    def to(self, dtype: torch.dtype) -> LayerWeights:
        return LayerWeights(*(t.to(dtype) for t in vars(self).values()))


@dataclass
class StackInputs:
    layers: list[LayerWeights]
    final_ln: tuple[torch.Tensor, torch.Tensor]
    x: torch.Tensor  # [s, b, hidden]
    dy: torch.Tensor  # output gradient, [s, b, hidden]

    def to(self, dtype: torch.dtype) -> StackInputs:
        return StackInputs([w.to(dtype) for w in self.layers], tuple(t.to(dtype) for t in self.final_ln),
                           self.x.to(dtype), self.dy.to(dtype))


def make_stack(case: Case, layers: int, device: torch.device, dtype: torch.dtype) -> StackInputs:
    """Seeded weights, input and output gradient, rounded to `dtype` (the model's dtype)."""
    hidden = case.heads * case.head_dim
    qkv_out = (case.heads + 2 * case.kv_heads) * case.head_dim
    generator = torch.Generator(device=device).manual_seed(case.seed + 1)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(shape, generator=generator, device=device) * std).to(dtype)

    weights = []
    for _ in range(layers):
        weights.append(LayerWeights(
            ln_weight=torch.ones(hidden, device=device, dtype=dtype),
            ln_bias=torch.zeros(hidden, device=device, dtype=dtype),
            qkv_weight=normal(qkv_out, hidden, std=INIT_STD),
            qkv_bias=normal(qkv_out, std=INIT_STD),
            proj_weight=normal(hidden, hidden, std=INIT_STD / math.sqrt(2 * layers)),
            proj_bias=normal(hidden, std=INIT_STD),
        ))
    final_ln = (torch.ones(hidden, device=device, dtype=dtype), torch.zeros(hidden, device=device, dtype=dtype))
    x = normal(case.seq, case.batch, hidden, std=1.0)
    dy = normal(case.seq, case.batch, hidden, std=1.0)
    return StackInputs(weights, final_ln, x, dy)


def split_qkv(mixed: torch.Tensor, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's split of linear_qkv's output: views, except q under GQA (Megatron's reshape copies)."""
    s, b = mixed.shape[:2]
    kv_heads, d = mixed.shape[2], case.head_dim
    group = mixed.shape[3] // d - 2
    q, k, v = torch.split(mixed, [group * d, d, d], dim=-1)
    return q.reshape(s, b, kv_heads * group, d), k, v


def run_stack(
    inputs: StackInputs,
    case: Case,
    attention: Attention,
    tp: int = 1,
    on_layer: OnLayer | None = None,
) -> list[torch.Tensor]:
    """Forward and backward through the stack; returns dQ of every layer (sbhd, first layer first)."""
    hidden = case.heads * case.head_dim
    group = case.heads // case.kv_heads
    dqs: list[torch.Tensor | None] = [None] * len(inputs.layers)
    x = inputs.x.detach().requires_grad_()
    h = x
    for index, w in enumerate(inputs.layers):
        normed = F.layer_norm(h, (hidden,), w.ln_weight, w.ln_bias, eps=1e-5)
        mixed = F.linear(normed, w.qkv_weight, w.qkv_bias)
        s, b = mixed.shape[:2]
        mixed = mixed.view(s, b, case.kv_heads, (group + 2) * case.head_dim)
        groups_per_shard = case.kv_heads // tp
        outs = []
        for shard in range(tp):
            part = mixed[:, :, shard * groups_per_shard:(shard + 1) * groups_per_shard]
            q, k, v = split_qkv(part, case)
            q.register_hook(_store(dqs, index, shard, tp, on_layer))
            outs.append(attention(q, k, v))
        context = torch.cat(outs, dim=2) if tp > 1 else outs[0]
        h = h + F.linear(context.reshape(s, b, hidden), w.proj_weight, w.proj_bias)
        if on_layer is not None:
            on_layer("forward", index)
    y = F.layer_norm(h, (hidden,), *inputs.final_ln, eps=1e-5)
    y.backward(inputs.dy)
    return [dq.detach() for dq in dqs]


def _store(dqs: list, index: int, shard: int, tp: int, on_layer: OnLayer | None):
    def hook(grad: torch.Tensor) -> None:
        if tp == 1:
            dqs[index] = grad.detach()
        else:
            if dqs[index] is None:
                dqs[index] = [None] * tp
            dqs[index][shard] = grad.detach()
            if not all(part is not None for part in dqs[index]):
                return
            dqs[index] = torch.cat(dqs[index], dim=2)
        if on_layer is not None:
            on_layer("backward", index)

    return hook


def float64_replica_dqs(case: Case, layers: int, device: torch.device, model_dtype: torch.dtype,
                        progress: Callable[[str], None] | None = None) -> list[torch.Tensor]:
    """dQ at every layer of the stack's float64 replica (the model's weights, upcast): the depth reference."""
    stack = make_stack(case, layers, device, model_dtype)
    return run_stack(stack.to(torch.float64), case, float64_attention(case),
                     on_layer=layer_progress("float64 replica", layers, progress))


def layer_progress(what: str, layers: int, progress: Callable[[str], None] | None) -> OnLayer | None:
    """A run_stack callback that reports "WHAT: forward layer 3/24" through `progress`."""
    if progress is None:
        return None
    return lambda phase, index: progress(f"{what}: {phase} layer {index + 1}/{layers}")


def float64_attention(case: Case) -> Attention:
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = Float64Attention.apply(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), case.causal,
                                     case.softmax_scale, case.window)
        return out.transpose(0, 1)

    return attention


class BackendAttention:
    """A backend as the core attention of a stack: sbhd in, sbhd out, whatever format it wants."""

    def __init__(self, backend, case: Case):
        self.backend, self.case = backend, case
        self.last_out: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend.format_for(self.case) == "bshd":
            out = self.backend.forward(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.case)
            self.last_out = out
            return out.transpose(0, 1)
        self.last_out = self.backend.forward(q, k, v, self.case)
        return self.last_out


def stack_bytes(case: Case, layers: int, itemsize: int, attention_saved: int) -> int:
    """Bytes a stack run holds at its peak (the end of the forward): the weights, and per layer what autograd
    keeps for the backward (the layer norm's input and output, the mixed qkv, the attention output and its
    projection, and `attention_saved`, what one layer's attention keeps), plus the per-layer dQ it returns."""
    hidden = case.heads * case.head_dim
    qkv_out = (case.heads + 2 * case.kv_heads) * case.head_dim
    tokens = case.seq * case.batch
    weights = (qkv_out * hidden + hidden * hidden + 2 * qkv_out + 4 * hidden) * itemsize
    activations = tokens * (4 * hidden + qkv_out) * itemsize + attention_saved
    dq = tokens * hidden * itemsize
    return layers * (weights + activations + dq) + 2 * tokens * hidden * itemsize
