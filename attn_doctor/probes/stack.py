"""A deep Megatron-style GPT stack in which only the core attention changes between backends.

Each of the L blocks: pre-LayerNorm, fused qkv projection split the way Megatron splits `linear_qkv`
([s, b, kv_heads, (group + 2) * d] along the last dim), core attention, output projection, residual; a
final LayerNorm. Weights are seeded at GPT scale (std 0.02; output projections 0.02 / sqrt(2 L)) and rounded
to the model dtype once, so the float64 replica runs on exactly the weights the low-precision stack uses.
Backward starts from a seeded output gradient; each layer's dQ is handed on as its backward is done, and only
one layer's autograd graph exists at a time (`run_stack`).

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
from attn_doctor.core.errors import own_code
from attn_doctor.numerics.metrics import TensorMetrics, compare
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


# Called with each layer's dQ (sbhd, TP shards joined) as the backward reaches it, last layer first.
OnDq = Callable[[int, torch.Tensor], None]


def block(h: torch.Tensor, w: LayerWeights, case: Case, attention: Attention, tp: int = 1
          ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One block on its input h [s, b, hidden]: its output, and the q each of its `tp` attention calls took."""
    hidden = case.heads * case.head_dim
    group = case.heads // case.kv_heads
    normed = F.layer_norm(h, (hidden,), w.ln_weight, w.ln_bias, eps=1e-5)
    mixed = F.linear(normed, w.qkv_weight, w.qkv_bias)
    s, b = mixed.shape[:2]
    mixed = mixed.view(s, b, case.kv_heads, (group + 2) * case.head_dim)
    groups_per_shard = case.kv_heads // tp
    qs, outs = [], []
    for shard in range(tp):
        q, k, v = split_qkv(mixed[:, :, shard * groups_per_shard:(shard + 1) * groups_per_shard], case)
        qs.append(q)
        outs.append(attention(q, k, v))
    context = torch.cat(outs, dim=2) if tp > 1 else outs[0]
    return h + F.linear(context.reshape(s, b, hidden), w.proj_weight, w.proj_bias), qs


def run_stack(
    inputs: StackInputs,
    case: Case,
    attention: Attention,
    on_dq: OnDq,
    tp: int = 1,
    on_layer: OnLayer | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Forward and backward through the stack in `dtype` (default: the inputs'; weights are cast a layer at a
    time), handing each layer's dQ to `on_dq` as the backward reaches it.

    Only one layer's autograd graph exists at a time, as with Megatron's full activation recomputation: the
    forward keeps each layer's input alone, and the backward runs each layer's forward again from it, then
    its backward. A 128-layer float64 replica so holds 128 layer inputs, not 128 layers of activations (tens
    of GiB). Each layer's attention is still its own forward and backward on that layer's inputs: the same
    operations on the same values, so the dQ are those of one autograd graph over the whole stack (the
    tests hold them equal). What a layer's backward hands on is that graph's gradient too: the residual's and
    the layer's parts summed, as autograd sums them."""
    dtype = dtype or inputs.x.dtype
    hidden = case.heads * case.head_dim
    count = len(inputs.layers)
    boundaries: list[torch.Tensor] = []
    h = inputs.x.to(dtype)
    with torch.enable_grad():  # the kernel's forward sees inputs that require grad, as in training
        for index, weights in enumerate(inputs.layers):
            boundaries.append(h)
            h = block(h.detach().requires_grad_(), weights.to(dtype), case, attention, tp)[0].detach()
            if on_layer is not None:
                on_layer("forward", index)
        h.requires_grad_()
        y = F.layer_norm(h, (hidden,), *(t.to(dtype) for t in inputs.final_ln), eps=1e-5)
        (grad,) = torch.autograd.grad(y, h, inputs.dy.to(dtype))
        del y, h
        for index in reversed(range(count)):
            x = boundaries.pop().detach().requires_grad_()
            out, qs = block(x, inputs.layers[index].to(dtype), case, attention, tp)
            grad, *dqs = torch.autograd.grad(out, [x, *qs], grad)
            del out, qs, x
            on_dq(index, torch.cat(dqs, dim=2) if tp > 1 else dqs[0])
            del dqs
            if on_layer is not None:
                on_layer("backward", index)


def bshd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)


class LayerErrors:
    """A `run_stack` callback: each layer's dQ against the float64 replica's (`reference`, sbhd, per layer) as
    it arrives; the first and the last layer's dQ kept. The comparison is attn-doctor's code, called from
    inside the kernel's backward: its errors are attn-doctor's (`own_code`)."""

    def __init__(self, reference: list[torch.Tensor]):
        self.reference = reference
        self.metrics: list[TensorMetrics | None] = [None] * len(reference)
        self.kept: dict[int, torch.Tensor] = {}

    def __call__(self, index: int, dq: torch.Tensor) -> None:
        with own_code():
            self.metrics[index] = compare(bshd(dq), bshd(self.reference[index]))
            if index in (0, len(self.reference) - 1):
                self.kept[index] = dq

    @property
    def first(self) -> torch.Tensor:
        return self.kept[0]

    @property
    def last(self) -> torch.Tensor:
        return self.kept[len(self.reference) - 1]


def stack_dqs(inputs: StackInputs, case: Case, attention: Attention, tp: int = 1,
              on_layer: OnLayer | None = None, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """dQ of every layer (sbhd, first layer first): `run_stack`, every layer's kept."""
    dqs: list[torch.Tensor | None] = [None] * len(inputs.layers)

    def keep(index: int, dq: torch.Tensor) -> None:
        dqs[index] = dq

    run_stack(inputs, case, attention, keep, tp=tp, on_layer=on_layer, dtype=dtype)
    return dqs


def float64_replica_dqs(case: Case, layers: int, device: torch.device, model_dtype: torch.dtype,
                        progress: Callable[[str], None] | None = None) -> list[torch.Tensor]:
    """dQ at every layer of the stack's float64 replica (the model's weights, upcast): the depth reference."""
    stack = make_stack(case, layers, device, model_dtype)
    return stack_dqs(stack, case, float64_attention(case), on_layer=layer_progress("float64 replica", layers, progress),
                     dtype=torch.float64)


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


def stack_bytes(case: Case, layers: int, item: int, model_item: int, attention: int, all_dq: bool) -> int:
    """Bytes a `run_stack` in a dtype of `item` bytes holds at its peak, a layer's backward: the weights (in the
    model's dtype, `model_item`; one layer's cast), every layer's input, one layer's forward again and its
    backward (the layer norm's output, the mixed qkv and its gradient, q, k, v's gradients, the attention's output,
    its joined and projected copies, the gradients handed back) with `attention` (what that layer's attention
    calls hold, saved and transient), and the dQ handed on: every layer's (`all_dq`; a layer's input is dropped as
    its dQ arrives, so the two take turns) or the caller's two."""
    hidden = case.heads * case.head_dim
    qkv_out = (case.heads + 2 * case.kv_heads) * case.head_dim
    tokens = case.seq * case.batch
    # each layer's small tensors (norms, biases) take allocator blocks of their own: about 1 MiB a layer, measured
    weights = layers * ((qkv_out * hidden + hidden * hidden + 2 * qkv_out + 4 * hidden) * model_item + (1 << 20))
    cast = (qkv_out * hidden + hidden * hidden) * item if item != model_item else 0
    inputs = (layers + 1) * tokens * hidden * item  # with the last layer's output
    # 8 bytes an element whatever the dtype: a bf16 layer's backward makes fp32 temporaries (the layer norm's, the
    # matmuls'); measured on an H100, the 24- and 128-layer stacks' workers reserved 0.4 GiB more than at 2 bytes
    layer = tokens * (6 * hidden + 3 * qkv_out) * max(item, 8) + attention
    dq = 0 if all_dq else 2 * tokens * hidden * item
    return weights + cast + inputs + layer + dq
