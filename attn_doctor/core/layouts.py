"""The memory layouts real frameworks hand to attention kernels, built as views (views stay views).

Every layout holds the same values; only storage and strides differ, so whether a kernel honours strides
is part of what is tested. Tensors are produced in the format a backend asks for: "bshd"
[batch, seq, heads, dim] or "sbhd" [seq, batch, heads, dim] (Megatron's and TE's default).

- contiguous:   fresh contiguous q, k, v.
- sb3hd_packed: one buffer [s, b, 3, h, d], q/k/v are slices of it (a fused qkv GEMM output).
- sbh3d_packed: Megatron's mixed layer [s, b, kv_heads, (group + 2) * d], split along the last dim;
                as in Megatron, q is copied by its reshape under GQA, k and v stay views.
- head_slice:   the second half of a tensor with twice the heads (what a TP=2 rank sees before a copy).
- transposed:   the other storage order, seen through a transpose (bshd memory as sbhd and the reverse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where views are built, so that the command line can list layouts fast
    import torch

LAYOUTS = ("contiguous", "sb3hd_packed", "sbh3d_packed", "head_slice", "transposed")


@dataclass
class QKV:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    leaves: tuple[torch.Tensor, ...]  # the storage tensors that require grad (kept alive for autograd)


def to_format(t_bshd: torch.Tensor, fmt: str) -> torch.Tensor:
    """A bshd tensor seen in `fmt` (a view)."""
    return t_bshd if fmt == "bshd" else t_bshd.transpose(0, 1)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_()


def _contiguous(q, k, v, fmt):
    leaves = tuple(_leaf(to_format(t, fmt)) for t in (q, k, v))
    return QKV(*leaves, leaves=leaves)


def _sb3hd(q, k, v, fmt):
    import torch

    buffer = torch.stack([t.transpose(0, 1) for t in (q, k, v)], dim=2)  # [s, b, 3, h, d]
    buffer = _leaf(buffer)
    views = [buffer[:, :, i] for i in range(3)]  # sbhd views
    if fmt == "bshd":
        views = [x.transpose(0, 1) for x in views]
    return QKV(*views, leaves=(buffer,))


def _sbh3d(q, k, v, fmt):
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


def _head_slice(q, k, v, fmt):
    import torch

    views, leaves = [], []
    generator = torch.Generator(device=q.device).manual_seed(7)
    for t in (q, k, v):
        other = torch.randn(t.shape, generator=generator, device=t.device, dtype=torch.float32).to(t.dtype)
        wide = _leaf(to_format(torch.cat([other, t], dim=2), fmt))  # [.., .., 2 heads, d]
        heads = t.shape[2]
        views.append(wide[:, :, heads:])
        leaves.append(wide)
    return QKV(*views, leaves=tuple(leaves))


def _transposed(q, k, v, fmt):
    other = "sbhd" if fmt == "bshd" else "bshd"
    leaves = tuple(_leaf(to_format(t, other)) for t in (q, k, v))
    return QKV(*(t.transpose(0, 1) for t in leaves), leaves=leaves)


_BUILDERS: dict[str, Callable] = {
    "contiguous": _contiguous,
    "sb3hd_packed": _sb3hd,
    "sbh3d_packed": _sbh3d,
    "head_slice": _head_slice,
    "transposed": _transposed,
}


def layout_unsupported(layout: str, seq_q: int, seq_kv: int, heads: int, kv_heads: int) -> str | None:
    """Why `layout` cannot hold this case, or None when it can."""
    if layout in ("sb3hd_packed", "sbh3d_packed") and seq_q != seq_kv:
        return f"{layout} packs q, k, v in one buffer, so it needs seq_kv == seq"
    if layout == "sb3hd_packed" and heads != kv_heads:
        return "sb3hd_packed needs as many kv heads as heads (use sbh3d_packed for GQA)"
    return None


def build(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str) -> QKV:
    """q, k, v (bshd values) laid out as `layout`, presented in `fmt`, each requiring grad."""
    if layout not in _BUILDERS:
        raise ValueError(f"unknown layout {layout!r}")
    # No torch.no_grad() here: the views must be taken with grad tracking on, so that autograd
    # reaches them; q, k, v themselves do not require grad, so building the buffers records nothing.
    return _BUILDERS[layout](q.detach(), k.detach(), v.detach(), fmt)


def to_bshd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """A tensor in `fmt` seen as bshd (a view)."""
    return t if fmt == "bshd" else t.transpose(0, 1)
