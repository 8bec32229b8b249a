"""The memory layouts real frameworks hand to attention kernels, by name: which a case can hold, which a run
feeds, and where a packed tensor's sequences sit (`Packing`). Their views are built in
`attn_doctor.numerics.views` (views stay views).

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

from dataclasses import dataclass

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

    def cu_seqlens_arguments(self) -> dict[str, list[int]]:
        """TE's cu_seqlens_q / _kv and their _padded offsets, by argument name."""
        return {f"cu_seqlens_{side}{'_padded' if padded else ''}": self.cu_seqlens(side, padded)
                for padded in (False, True) for side in ("q", "kv")}

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
