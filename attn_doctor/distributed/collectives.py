"""Sequence and head reshuffles over a rank's CP group, for context parallelism done by attn-doctor.

Tensors are bshd [batch, seq, heads, dim]; a rank holds its CP chunks in TE's load-balanced order
(`grid.cp_positions`). all_gather and reduce_scatter, the p2p ring of send/recv steps, and all_to_all
(Ulysses: sequence shards <-> head shards).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from attn_doctor.distributed.context import Context


def gather_seq(ctx: Context, x_local, seq: int):
    """all_gather the CP group's chunks of x into the full sequence (global order)."""
    torch = ctx.torch
    parts = [torch.empty_like(x_local) for _ in range(ctx.cp)]
    ctx.dist.all_gather(parts, x_local.contiguous(), group=ctx.cp_group)
    full = x_local.new_empty(x_local.shape[0], seq, *x_local.shape[2:])
    for c, part in enumerate(parts):
        full[:, ctx.positions(seq, c)] = part
    return full


def reduce_scatter_seq(ctx: Context, x_full, seq: int):
    """Sum every CP rank's contribution to the whole sequence (fp32) and keep this rank's chunks."""
    torch = ctx.torch
    inputs = [x_full[:, ctx.positions(seq, c)].float().contiguous() for c in range(ctx.cp)]
    out = torch.empty_like(inputs[0])
    ctx.dist.reduce_scatter(out, inputs, group=ctx.cp_group)
    return out.to(x_full.dtype)


def _ring_step(ctx: Context, send, recv) -> None:
    c, n = ctx.cp_rank, ctx.cp
    ops = [ctx.dist.P2POp(ctx.dist.isend, send, ctx.cp_ranks[(c + 1) % n], group=ctx.cp_group),
           ctx.dist.P2POp(ctx.dist.irecv, recv, ctx.cp_ranks[(c - 1) % n], group=ctx.cp_group)]
    for request in ctx.dist.batch_isend_irecv(ops):
        request.wait()


def ring_gather_seq(ctx: Context, x_local, seq: int):
    """The full sequence of x from chunks passed around the CP ring (cp - 1 send/recv steps)."""
    c, n = ctx.cp_rank, ctx.cp
    full = x_local.new_empty(x_local.shape[0], seq, *x_local.shape[2:])
    full[:, ctx.positions(seq, c)] = x_local
    send = x_local.contiguous()
    for step in range(n - 1):
        recv = ctx.torch.empty_like(send)
        _ring_step(ctx, send, recv)
        full[:, ctx.positions(seq, (c - step - 1) % n)] = recv  # it started at rank c - step - 1
        send = recv
    return full


def ring_reduce_seq(ctx: Context, x_full, seq: int):
    """Ring reduce-scatter: after cp - 1 steps this rank holds the sum over ranks of its chunks (fp32)."""
    c, n = ctx.cp_rank, ctx.cp
    acc = x_full[:, ctx.positions(seq, (c - 1) % n)].float().contiguous()
    for step in range(n - 1):
        recv = ctx.torch.empty_like(acc)
        _ring_step(ctx, acc, recv)
        owner = (c - step - 2) % n
        acc = recv + x_full[:, ctx.positions(seq, owner)].float()
    return acc.to(x_full.dtype)


def a2a_seq_to_heads(ctx: Context, x_local, seq: int):
    """[b, 2L, h, d] sequence shard -> [b, S, h/cp, d] head group cp_rank over the full sequence."""
    torch = ctx.torch
    group = x_local.shape[2] // ctx.cp
    inputs = [x_local[:, :, j * group:(j + 1) * group].contiguous() for j in range(ctx.cp)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(ctx.cp)]
    ctx.dist.all_to_all(outputs, inputs, group=ctx.cp_group)
    full = x_local.new_empty(x_local.shape[0], seq, group, x_local.shape[3])
    for c, part in enumerate(outputs):
        full[:, ctx.positions(seq, c)] = part
    return full


def a2a_heads_to_seq(ctx: Context, y_full, seq: int):
    """Inverse of a2a_seq_to_heads: [b, S, h/cp, d] -> [b, 2L, h, d] (this rank's chunks, all heads)."""
    torch = ctx.torch
    inputs = [y_full[:, ctx.positions(seq, c)].contiguous() for c in range(ctx.cp)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(ctx.cp)]
    ctx.dist.all_to_all(outputs, inputs, group=ctx.cp_group)
    return torch.cat(outputs, dim=2)
