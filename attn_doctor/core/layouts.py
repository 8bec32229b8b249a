"""The memory layouts real frameworks hand to attention kernels, built as views (views stay views).

Every layout holds the same values; only storage and strides differ, so whether a kernel honours strides
is part of what is tested. Tensors are produced in the format a backend asks for: "bshd"
[batch, seq, heads, dim], "sbhd" [seq, batch, heads, dim] (Megatron's and TE's default) or "thd"
[tokens, heads, dim] (sequences packed one after the other; see `Packing`).

- contiguous:   fresh contiguous q, k, v.
- sb3hd_packed: one buffer [s, b, 3, h, d], q/k/v are slices of it (a fused qkv GEMM output).
- sbh3d_packed: Megatron's mixed layer [s, b, kv_heads, (group + 2) * d], split along the last dim;
                as in Megatron, q is copied by its reshape under GQA, k and v stay views.
- head_slice:   the second half of a tensor with twice the heads (what a TP=2 rank sees before a copy).
- transposed:   the other storage order, seen through a transpose (bshd memory as sbhd and the reverse).

TE's packed layouts, in whatever format the backend takes (TE's qkv_layout names for sbhd / bshd / thd):
- qkv_3hd:      q, k, v slices of one [..., 3, heads, dim] buffer (sb3hd, bs3hd, t3hd).
- qkv_h3d:      q, k, v slices of one [..., heads, 3, dim] buffer (sbh3d, bsh3d, th3d).
- kv_2hd:       q alone, k and v slices of one [..., 2, heads, dim] buffer (sbhd_sb2hd, bshd_bs2hd, thd_t2hd).
- kv_h2d:       q alone, k and v slices of one [..., heads, 2, dim] buffer (sbhd_sbh2d, bshd_bsh2d, thd_th2d).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where views are built, so that the command line can list layouts fast
    import torch

LAYOUTS = ("contiguous", "sb3hd_packed", "sbh3d_packed", "head_slice", "transposed", "qkv_3hd", "qkv_h3d",
           "kv_2hd", "kv_h2d")
# A replayed call's own views (its source's, `attn_doctor.numerics.source.Source.views`): the capture's geometry.
CAPTURED = "captured"
# TE's qkv_layout names, by format, for the packed layouts (what a user knows them as).
TE_LAYOUT_NAMES = {
    "qkv_3hd": {"sbhd": "sb3hd", "bshd": "bs3hd", "thd": "t3hd"},
    "qkv_h3d": {"sbhd": "sbh3d", "bshd": "bsh3d", "thd": "th3d"},
    "kv_2hd": {"sbhd": "sbhd_sb2hd", "bshd": "bshd_bs2hd", "thd": "thd_t2hd"},
    "kv_h2d": {"sbhd": "sbhd_sbh2d", "bshd": "bshd_bsh2d", "thd": "thd_th2d"},
}
LAYOUT_ALIASES = {name: layout for layout, names in TE_LAYOUT_NAMES.items() for name in names.values()}
# What a run feeds when --layout is not given: the layouts frameworks hand to attention (dense formats; TE's
# packed layouts on request), or those a thd tensor can have.
DENSE_DEFAULT = ("contiguous", "sb3hd_packed", "sbh3d_packed", "head_slice", "transposed")
THD_DEFAULT = ("contiguous", "head_slice", "qkv_3hd", "kv_2hd")


def default_layouts(case) -> tuple[str, ...]:
    if case.replay is not None:  # the call's own views, and the same values contiguous
        return (CAPTURED, "contiguous")
    return THD_DEFAULT if case.qkv_format == "thd" else DENSE_DEFAULT


def canonical_layouts(names) -> list[str]:
    """--layout values with TE's names (sb3hd, thd_t2hd, ...) mapped to attn-doctor's, duplicates dropped."""
    return list(dict.fromkeys(LAYOUT_ALIASES.get(name, name) for name in names))
# pad_between_seqs: each sequence's slot in a thd tensor is its length rounded up past the next multiple of
# this (at least one token of padding, where the padded length leaves room).
PAD_ALIGN = 8


def slots(lengths: tuple[int, ...], longest: int, pad_between: bool) -> tuple[int, ...]:
    """Each sequence's slot in a packed tensor: its length, or with pad_between_seqs, rounded up."""
    if not pad_between:
        return tuple(lengths)
    return tuple(min(longest, (n // PAD_ALIGN + 1) * PAD_ALIGN) for n in lengths)


@dataclass(frozen=True)
class Packing:
    """Where each sequence's tokens sit in a thd tensor: one after the other, each in its slot (its length,
    plus padding with pad_between_seqs). The padded bshd tensors every comparison uses hold token p of
    sequence b at [b, p]; a slot's padding tokens are those of [b, length:slot]."""

    seq_q: int
    seq_kv: int
    lengths_q: tuple[int, ...]
    lengths_kv: tuple[int, ...]
    slots_q: tuple[int, ...]
    slots_kv: tuple[int, ...]

    def index(self, side: str, device) -> torch.Tensor:
        """Flat positions (b * seq + p) in the padded tensor of the packed tensor's tokens, in order."""
        import torch

        seq, slot_sizes = (self.seq_q, self.slots_q) if side == "q" else (self.seq_kv, self.slots_kv)
        parts = [torch.arange(n, device=device) + b * seq for b, n in enumerate(slot_sizes)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)

    def cu_seqlens(self, side: str, padded: bool = False) -> list[int]:
        """TE's cu_seqlens (or cu_seqlens_*_padded): the running sum of lengths (or slots), from 0."""
        sizes = {("q", False): self.lengths_q, ("q", True): self.slots_q, ("kv", False): self.lengths_kv,
                 ("kv", True): self.slots_kv}[(side, padded)]
        totals = [0]
        for n in sizes:
            totals.append(totals[-1] + n)
        return totals


def packing(case, own_slots: tuple[tuple[int, ...], tuple[int, ...]] | None = None) -> Packing:
    """The packing of a thd case (`attn_doctor.core.case.Case`): its sequences in `own_slots` (query side, key
    side: a replayed call's, `attn_doctor.numerics.source.Source.slots`) when given, else in the case's."""
    lengths_q, lengths_kv = case.lengths_q(), case.lengths_kv()
    if own_slots is not None:
        return Packing(case.seq, case.seq_kv, lengths_q, lengths_kv, *own_slots)
    return Packing(case.seq, case.seq_kv, lengths_q, lengths_kv,
                   slots(lengths_q, case.seq, case.pad_between_seqs),
                   slots(lengths_kv, case.seq_kv, case.pad_between_seqs))


@dataclass
class QKV:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    leaves: tuple[torch.Tensor, ...]  # the storage tensors that require grad (kept alive for autograd)


def to_format(t_bshd: torch.Tensor, fmt: str, packed: Packing | None = None, side: str = "q") -> torch.Tensor:
    """A bshd tensor seen in `fmt` (a view; for thd, the sequences' tokens gathered by `packed`, a copy)."""
    if fmt == "thd":
        flat = t_bshd.reshape(t_bshd.shape[0] * t_bshd.shape[1], *t_bshd.shape[2:])
        return flat.index_select(0, packed.index(side, t_bshd.device))
    return t_bshd if fmt == "bshd" else t_bshd.transpose(0, 1)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_()


def _contiguous(q, k, v, fmt, packed):
    leaves = tuple(_leaf(to_format(t, fmt, packed, side)) for t, side in ((q, "q"), (k, "kv"), (v, "kv")))
    return QKV(*leaves, leaves=leaves)


def _packed(dim: int, kv_only: bool):
    """A builder of TE's packed layouts: q, k, v (or k, v) stacked at `dim` (-3: [..., n, h, d]; -2:
    [..., h, n, d]) in one buffer, each a slice of it."""
    def build(q, k, v, fmt, packed):
        import torch

        tensors = [to_format(t, fmt, packed, side) for t, side in ((q, "q"), (k, "kv"), (v, "kv"))]
        if kv_only:
            q_leaf, buffer = _leaf(tensors[0]), _leaf(torch.stack(tensors[1:], dim=dim))
            return QKV(q_leaf, buffer.select(dim, 0), buffer.select(dim, 1), leaves=(q_leaf, buffer))
        buffer = _leaf(torch.stack(tensors, dim=dim))
        return QKV(*(buffer.select(dim, i) for i in range(3)), leaves=(buffer,))
    return build


def _sb3hd(q, k, v, fmt, packed):
    import torch

    buffer = torch.stack([t.transpose(0, 1) for t in (q, k, v)], dim=2)  # [s, b, 3, h, d]
    buffer = _leaf(buffer)
    views = [buffer[:, :, i] for i in range(3)]  # sbhd views
    if fmt == "bshd":
        views = [x.transpose(0, 1) for x in views]
    return QKV(*views, leaves=(buffer,))


def _sbh3d(q, k, v, fmt, packed):
    import torch

    b, s, h, d = q.shape
    kv_heads = k.shape[2]
    group = h // kv_heads
    qs = q.transpose(0, 1).reshape(s, b, kv_heads, group * d)
    buffer = _leaf(torch.cat([qs, k.transpose(0, 1).reshape(s, b, kv_heads, d), v.transpose(0, 1)
                              .reshape(s, b, kv_heads, d)], dim=-1))  # [s, b, kv_heads, (group + 2) d]
    q_part, k_view, v_view = torch.split(buffer, [group * d, d, d], dim=-1)
    q_view = q_part.reshape(s, b, h, d)  # a view without GQA; a copy under GQA, exactly as Megatron does
    views = [q_view, k_view, v_view]
    if fmt == "bshd":
        views = [x.transpose(0, 1) for x in views]
    return QKV(*views, leaves=(buffer,))


def _head_slice(q, k, v, fmt, packed):
    import torch

    views, leaves = [], []
    generator = torch.Generator(device=q.device).manual_seed(7)
    for t, side in ((q, "q"), (k, "kv"), (v, "kv")):
        other = torch.randn(t.shape, generator=generator, device=t.device, dtype=torch.float32).to(t.dtype)
        wide = _leaf(to_format(torch.cat([other, t], dim=2), fmt, packed, side))  # [.., 2 heads, d]
        heads = t.shape[2]
        views.append(wide[..., heads:, :])
        leaves.append(wide)
    return QKV(*views, leaves=tuple(leaves))


def _transposed(q, k, v, fmt, packed):
    other = "sbhd" if fmt == "bshd" else "bshd"
    leaves = tuple(_leaf(to_format(t, other)) for t in (q, k, v))
    return QKV(*(t.transpose(0, 1) for t in leaves), leaves=leaves)


_BUILDERS: dict[str, Callable] = {
    "contiguous": _contiguous,
    "sb3hd_packed": _sb3hd,
    "sbh3d_packed": _sbh3d,
    "head_slice": _head_slice,
    "transposed": _transposed,
    "qkv_3hd": _packed(-3, kv_only=False),
    "qkv_h3d": _packed(-2, kv_only=False),
    "kv_2hd": _packed(-3, kv_only=True),
    "kv_h2d": _packed(-2, kv_only=True),
}


def layout_unsupported(layout: str, case) -> str | None:
    """Why `layout` cannot hold this case (`attn_doctor.core.case.Case`), or None when it can."""
    if layout == CAPTURED:
        return None if case.replay is not None else "the captured layout is a replayed call's (attn-doctor replay)"
    seq_q, seq_kv, heads, kv_heads = case.seq, case.seq_kv, case.heads, case.kv_heads
    if layout in ("sb3hd_packed", "sbh3d_packed") and seq_q != seq_kv:
        return f"{layout} packs q, k, v in one buffer, so it needs seq_kv == seq"
    if layout == "sb3hd_packed" and heads != kv_heads:
        return "sb3hd_packed needs as many kv heads as heads (use sbh3d_packed for GQA)"
    if layout in ("sb3hd_packed", "sbh3d_packed", "transposed") and case.qkv_format == "thd":
        return f"{layout} is a layout of padded sbhd/bshd tensors; thd packs tokens (use qkv_3hd, kv_2hd, ...)"
    if (layout.startswith(("qkv_", "kv_")) or layout in ("sb3hd_packed", "sbh3d_packed")) and case.mla:
        return f"{layout} packs k and v in one buffer, so it needs head_dim_v == head_dim"
    if layout.startswith("qkv_"):
        if seq_q != seq_kv or case.lengths_q() != case.lengths_kv():
            return f"{layout} packs q, k, v in one buffer, so it needs the same lengths for queries and keys"
        if heads != kv_heads:
            return f"{layout} packs q, k, v in one buffer, so it needs as many kv heads as heads (use kv_2hd for GQA)"
    return None


def build(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str,
          packed: Packing | None = None) -> QKV:
    """q, k, v (bshd values) laid out as `layout`, presented in `fmt`, each requiring grad (thd: packed by
    `packed`)."""
    if layout not in _BUILDERS:
        raise ValueError(f"unknown layout {layout!r}")
    # No torch.no_grad() here: the views must be taken with grad tracking on, so that autograd
    # reaches them; q, k, v themselves do not require grad, so building the buffers records nothing.
    return _BUILDERS[layout](q.detach(), k.detach(), v.detach(), fmt, packed)


def to_bshd(t: torch.Tensor, fmt: str, packed: Packing | None = None, side: str = "q") -> torch.Tensor:
    """A tensor in `fmt` seen as bshd (a view; for thd, scattered into a zero-padded tensor, slot padding
    included at the positions past each sequence's length)."""
    if fmt == "thd":
        import torch

        seq = packed.seq_q if side == "q" else packed.seq_kv
        batch = len(packed.lengths_q)
        flat = torch.zeros(batch * seq, *t.shape[1:], dtype=t.dtype, device=t.device)
        flat.index_copy_(0, packed.index(side, t.device), t)
        return flat.view(batch, seq, *t.shape[1:])
    return t if fmt == "bshd" else t.transpose(0, 1)
