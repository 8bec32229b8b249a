"""q, k, v laid out in memory as real frameworks hand them to attention kernels, as tensors: the views of each
layout `attn_doctor.core.layouts` names (built by `attn_doctor.numerics.standalone.lay_out`, which the
standalone repro scripts hold too), and tensors seen in another format ("bshd", "sbhd", or "thd": the
sequences' tokens where a `Packing` puts them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_doctor.core.layouts import Packing
from attn_doctor.numerics import standalone


def token_positions(packed: Packing, side: str, device) -> torch.Tensor:
    """Flat positions (b * seq + p) in the padded tensor of the packed tensor's tokens, in order."""
    return standalone.token_index(packed.cu_seqlens(side, padded=True),
                                  packed.seq_q if side == "q" else packed.seq_kv, device)


@dataclass
class QKV:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    leaves: tuple[torch.Tensor, ...]  # the storage tensors that require grad (kept alive for autograd)


def _index(fmt: str, packed: Packing | None, side: str, device) -> torch.Tensor | None:
    return token_positions(packed, side, device) if fmt == "thd" else None


def to_format(t_bshd: torch.Tensor, fmt: str, packed: Packing | None = None, side: str = "q") -> torch.Tensor:
    """A bshd tensor seen in `fmt` (a view; for thd, the sequences' tokens gathered by `packed`, a copy)."""
    return standalone.to_format(t_bshd, fmt, _index(fmt, packed, side, t_bshd.device))


def build(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str,
          packed: Packing | None = None) -> QKV:
    """q, k, v (bshd values) laid out as `layout`, presented in `fmt`, each requiring grad (thd: packed by
    `packed`); the views are `attn_doctor.numerics.standalone.lay_out`'s."""
    # No torch.no_grad() here: the views must be taken with grad tracking on, so that autograd
    # reaches them; q, k, v themselves do not require grad, so building the buffers records nothing.
    views, leaves = standalone.lay_out(layout, q.detach(), k.detach(), v.detach(), fmt,
                                       _index(fmt, packed, "q", q.device), _index(fmt, packed, "kv", q.device))
    return QKV(*views, leaves=leaves)


def to_bshd(t: torch.Tensor, fmt: str, packed: Packing | None = None, side: str = "q") -> torch.Tensor:
    """A tensor in `fmt` seen as bshd (a view; for thd, scattered into a zero-padded tensor, slot padding
    included at the positions past each sequence's length)."""
    if fmt != "thd":
        return standalone.to_bshd(t, fmt)
    padded = (len(packed.lengths_q), packed.seq_q if side == "q" else packed.seq_kv)
    return standalone.to_bshd(t, fmt, token_positions(packed, side, t.device), padded)
