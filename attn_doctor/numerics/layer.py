"""A transformer layer computed as TE's MultiheadAttention and TransformerLayer compute it, in plain torch ops:
the float64 replica of a module path and, in the module's dtype with Megatron's local core attention, the
same-dtype yardstick it is judged against (`attn_doctor.probes.module`).

What is replicated (read from TE 2.20's transformer_engine/pytorch/attention/multi_head_attention.py,
transformer.py and attention/rope.py; the module paths build TE's modules to match, `backends.te_module`):

- the fused QKV projection (`fuse_qkv_params=True`, TE's default `qkv_weight_interleaved=True`): its output
  features are [kv_heads, group + 2, head_dim], per kv group its `group` query heads, then its key, then its value
  head, split along that axis as TE splits it (query head g * group + j is group g's j-th): Megatron's order;
- rotary embedding on q and k after the split (TE's `apply_rotary_pos_emb`, not interleaved):
  t * cos(f) + rotate_half(t) * sin(f), f the angles TE's RotaryPositionEmbedding(head_dim) computes (position
  times 10000^(-2i/d), [s, 1, 1, d]): exact (float64) in the replica, in fp32 as TE computes them for the
  same-dtype yardstick, which applies them in fp32 and rounds once, as TE's fused kernel does;
- the core attention (softmax scale 1/sqrt(head_dim): MultiheadAttention gives DotProductAttention none);
- the output projection; for TransformerLayer, pre-LayerNorm before the QKV projection (LayerNormLinear), the
  projection's bias added in the residual's bias-dropout-add (dropout 0: residual + (out + bias)), then
  LayerNorm, fc1 + bias, ReLU, fc2, and its bias and the residual likewise (LayerNormMLP, `return_bias`).

Everything runs in the dtype of its inputs: float64 for the replica, the module's for the yardstick.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from attn_doctor.core.case import Case

# attention(q, k, v) in the layer's format ("sbhd" [s, b, h, d] or "bshd") -> out in it, [.., heads, head_dim]
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LAYERNORM_EPS = 1e-5
ROPE_BASE = 10000.0
ACTIVATION = "relu"  # exact in every dtype: no approximation of GELU's to tell apart from a fault
FFN_MULTIPLE = 2  # the MLP's hidden size, times the layer's (kept small: the layer is the attention's setting)
INIT_STD = 0.02
KINDS = ("mha", "layer")


@dataclass(frozen=True)
class Architecture:
    """The layer a module path builds for a case: `kind` "mha" (MultiheadAttention: fused QKV projection, RoPE,
    core attention, output projection) or "layer" (TransformerLayer: the same with pre-LayerNorm, residuals and
    an MLP). hidden = heads * head_dim."""

    kind: str
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    window: tuple[int, int] | None
    fmt: str  # "sbhd" or "bshd": the hidden states' order, [s, b, hidden] or [b, s, hidden]

    @classmethod
    def of(cls, case: Case, kind: str) -> Architecture:
        if kind not in KINDS:
            raise ValueError(f"unknown layer kind {kind!r}")
        return cls(kind, case.heads, case.kv_heads, case.head_dim, case.causal, case.window, case.qkv_format)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def ffn(self) -> int:
        return FFN_MULTIPLE * self.hidden

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def accumulation(self, seq: int) -> int:
        """The longest sum any tensor of the layer is built from, in terms (what float64's own rounding grows
        with): the attention's over the sequence and head dims, the projections' over hidden and ffn sizes."""
        return 2 * seq + 2 * self.head_dim + self.hidden + (self.ffn + self.hidden if self.kind == "layer" else 0)


@dataclass
class Weights:
    """A layer's weights by role, as torch.nn.functional takes them (Linear weights [out, in]). The QKV
    weight's rows are in TE's interleaved order (see the module docstring). None: not part of this kind."""

    qkv_weight: torch.Tensor
    qkv_bias: torch.Tensor
    proj_weight: torch.Tensor
    proj_bias: torch.Tensor
    ln1_weight: torch.Tensor | None = None
    ln1_bias: torch.Tensor | None = None
    ln2_weight: torch.Tensor | None = None
    ln2_bias: torch.Tensor | None = None
    fc1_weight: torch.Tensor | None = None
    fc1_bias: torch.Tensor | None = None
    fc2_weight: torch.Tensor | None = None
    fc2_bias: torch.Tensor | None = None

    def items(self) -> dict[str, torch.Tensor]:
        """The weights this layer has, by role."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, dtype: torch.dtype) -> Weights:
        return Weights(**{name: t.detach().to(dtype) for name, t in self.items().items()})


def seeded_weights(arch: Architecture, seed: int, device: torch.device, dtype: torch.dtype) -> Weights:
    """Seeded weights, drawn in float32 from the case's seed and rounded to the model's dtype once: the QKV
    projection's std 1/sqrt(hidden), so that q, k, v have unit scale like a single call's inputs (scores of unit
    size, a softmax far from uniform: at GPT's 0.02 the attention of a small layer is nearly uniform and a wrong
    softmax scale barely shows in its output); the rest at GPT scale (std 0.02, output projections 0.02 /
    sqrt(2)). LayerNorm weights are 1 + N(0, 0.1) and biases N(0, 0.1), not 1 and 0, so that a norm that drops or
    misplaces them shows."""
    generator = torch.Generator(device=device).manual_seed(seed + 2)

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return (mean + torch.randn(shape, generator=generator, device=device) * std).to(dtype)

    hidden, qkv_out = arch.hidden, (arch.heads + 2 * arch.kv_heads) * arch.head_dim
    out_std = INIT_STD / math.sqrt(2)
    weights = Weights(qkv_weight=normal(qkv_out, hidden, std=1 / math.sqrt(hidden)),
                      qkv_bias=normal(qkv_out, std=INIT_STD),
                      proj_weight=normal(hidden, hidden, std=out_std), proj_bias=normal(hidden, std=INIT_STD))
    if arch.kind == "layer":
        weights.ln1_weight, weights.ln1_bias = normal(hidden, std=0.1, mean=1.0), normal(hidden, std=0.1)
        weights.ln2_weight, weights.ln2_bias = normal(hidden, std=0.1, mean=1.0), normal(hidden, std=0.1)
        weights.fc1_weight, weights.fc1_bias = normal(arch.ffn, hidden, std=INIT_STD), normal(arch.ffn, std=INIT_STD)
        weights.fc2_weight, weights.fc2_bias = normal(hidden, arch.ffn, std=out_std), normal(hidden, std=INIT_STD)
    return weights


def seeded_activations(arch: Architecture, case: Case, device: torch.device, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's input x and output gradient dy, N(0, 1), in the layer's order ([s, b, hidden] for sbhd)."""
    generator = torch.Generator(device=device).manual_seed(case.seed + 3)
    shape = (case.seq, case.batch, arch.hidden) if arch.fmt == "sbhd" else (case.batch, case.seq, arch.hidden)
    x = torch.randn(shape, generator=generator, device=device).to(dtype)
    dy = torch.randn(shape, generator=generator, device=device).to(dtype)
    return x, dy


def rotary_frequencies(seq: int, head_dim: int, device: torch.device, dtype: torch.dtype = torch.float32,
                       base: float = ROPE_BASE) -> torch.Tensor:
    """What TE's RotaryPositionEmbedding(head_dim) (rotary_base 10000, not interleaved) returns for `seq`
    positions, computed as it computes them, in `dtype`: [seq, 1, 1, head_dim], each position's angles, the
    half-dim's frequencies twice. In fp32 (TE's) for the same-dtype yardstick, in float64 (exact angles) for the
    replica: both independent of the frequencies TE returned, which the module is given, so a fault in them shows."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim))
    freqs = torch.outer(torch.arange(seq, dtype=dtype, device=device), inv_freq)
    return torch.cat((freqs, freqs), dim=-1).reshape(seq, 1, 1, head_dim)


def apply_rope(t: torch.Tensor, freqs: torch.Tensor, fmt: str) -> torch.Tensor:
    """t * cos(f) + rotate_half(t) * sin(f) on t in `fmt` ([s, b, h, d] or [b, s, h, d]), f [s, 1, 1, d]. Computed in
    float64 for a float64 t, else in fp32 and rounded to t's dtype once (TE's fused RoPE kernel)."""
    compute = torch.float64 if t.dtype == torch.float64 else torch.float32
    angles = freqs[: t.shape[0] if fmt == "sbhd" else t.shape[1]].to(compute)
    if fmt == "bshd":
        angles = angles.transpose(0, 1)
    x = t.to(compute)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * torch.cos(angles) + rotated * torch.sin(angles)).to(t.dtype)


def split_qkv(mixed: torch.Tensor, arch: Architecture) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output [.., (heads + 2 kv_heads) head_dim] split as TE splits it (interleaved)."""
    lead = mixed.shape[:-1]
    grouped = mixed.view(*lead, arch.kv_heads, arch.group + 2, arch.head_dim)
    q, k, v = torch.split(grouped, [arch.group, 1, 1], dim=-2)
    return (q.reshape(*lead, arch.heads, arch.head_dim), k.reshape(*lead, arch.kv_heads, arch.head_dim),
            v.reshape(*lead, arch.kv_heads, arch.head_dim))


@dataclass
class Trace:
    """A layer's forward: what its core attention received (q, k, v after RoPE, in the layer's format) and
    returned (`context`, [.., hidden]), and its output."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    context: torch.Tensor
    out: torch.Tensor


def forward(x: torch.Tensor, w: Weights, arch: Architecture, freqs: torch.Tensor, attention: Attention) -> Trace:
    """The layer on x ([s, b, hidden] or [b, s, hidden], in the weights' dtype), as TE computes it."""
    hidden = arch.hidden
    normed = (F.layer_norm(x, (hidden,), w.ln1_weight, w.ln1_bias, eps=LAYERNORM_EPS) if arch.kind == "layer"
              else x)
    q, k, v = split_qkv(F.linear(normed, w.qkv_weight, w.qkv_bias), arch)
    q, k = apply_rope(q, freqs, arch.fmt), apply_rope(k, freqs, arch.fmt)
    context = attention(q, k, v).reshape(*x.shape[:-1], hidden)
    if arch.kind == "mha":
        return Trace(q, k, v, context, F.linear(context, w.proj_weight, w.proj_bias))
    h = x + (F.linear(context, w.proj_weight) + w.proj_bias)  # TE's bias-dropout-add, dropout 0
    normed = F.layer_norm(h, (hidden,), w.ln2_weight, w.ln2_bias, eps=LAYERNORM_EPS)
    inner = torch.relu(F.linear(normed, w.fc1_weight, w.fc1_bias))
    return Trace(q, k, v, context, h + (F.linear(inner, w.fc2_weight) + w.fc2_bias))


@dataclass
class Run:
    """A layer's forward and backward: the trace, dx, and the gradients that reached the core attention's inputs
    (dq, dk, dv) and output (`dcontext`)."""

    trace: Trace
    dx: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dcontext: torch.Tensor


def forward_backward(x: torch.Tensor, w: Weights, arch: Architecture, freqs: torch.Tensor, attention: Attention,
                     dy: torch.Tensor) -> Run:
    """`forward` and its backward from the output gradient dy (all detached)."""
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        trace = forward(leaf, w, arch, freqs, attention)
        dx, dq, dk, dv, dcontext = torch.autograd.grad(trace.out, (leaf, trace.q, trace.k, trace.v, trace.context),
                                                       dy)
    detached = Trace(*(t.detach() for t in (trace.q, trace.k, trace.v, trace.context, trace.out)))
    return Run(detached, dx, dq, dk, dv, dcontext)


def to_bshd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """A layer tensor in bshd order (attn_doctor's comparisons take [batch, seq, heads, dim]): heads of q, k, v
    stay; hidden states [.., hidden] become one head of `hidden` dims."""
    if t.dim() == 3:
        t = t.unsqueeze(2)
    return t.transpose(0, 1) if fmt == "sbhd" else t


def float64_attention(arch: Architecture) -> Attention:
    """The exact core attention (`Float64Attention`: blockwise, float64, autograd) in the layer's format."""
    from attn_doctor.numerics.reference import Float64Attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if arch.fmt == "sbhd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        out = Float64Attention.apply(q, k, v, arch.causal, arch.softmax_scale, arch.window)
        return out.transpose(0, 1) if arch.fmt == "sbhd" else out

    return attention


def local_attention(arch: Architecture) -> Attention:
    """Megatron's local core attention (the baseline every verdict is relative to,
    `attn_doctor.numerics.standalone.megatron_core_attention`) in the layer's format."""
    from attn_doctor.numerics.reference import allowed_mask
    from attn_doctor.numerics.standalone import megatron_core_attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if arch.fmt == "bshd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        positions = torch.arange(q.shape[0], device=q.device)
        visible = allowed_mask(positions, torch.arange(k.shape[0], device=q.device), arch.causal, arch.window)
        out = megatron_core_attention(q, k, v, arch.softmax_scale, visible)
        return out.transpose(0, 1) if arch.fmt == "bshd" else out

    return attention
