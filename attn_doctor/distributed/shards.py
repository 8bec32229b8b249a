"""How a rank computes its shard of a distributed probe.

* A library that does TP and CP itself (`Backend.own_parallelism`: TE) gets the rank's shards and its
  process groups (`Backend.run_parallel`) and communicates inside its own forward and backward.
* Otherwise attn-doctor splits the work. TP alone needs no communication inside attention: each rank runs
  the backend on its head shard. CP, done here for real:
  - all_gather: all_gather the k/v chunks over the CP group into the full k, v; attend the rank's queries
    at their global positions (`Backend.attend_at`); backward gives dk, dv contributions for the whole
    sequence, reduce_scattered (fp32) back to the chunks' owners.
  - p2p: the same attention, with k/v chunks passed around the CP ring by send/recv (batch_isend_irecv)
    and the dk/dv contributions summed back to their owners around the ring. (TE's p2p also overlaps
    per-step attention with online-softmax merging; that part is TE's, not reproduced here.)
  - a2a (Ulysses): all_to_all turns sequence shards into head shards (full sequence, h/cp heads), the
    backend runs unchanged with its own mask, and all_to_all turns out/dq/dk/dv back.

Every rank reaches the same agreement points whatever happens in the backend (`Context.agree`).
"""

from __future__ import annotations

import dataclasses

from attn_doctor.backends import Backend, ParallelGroups, Unsupported
from attn_doctor.core.case import Case
from attn_doctor.core.errors import kernel_code
from attn_doctor.distributed.collectives import (
    a2a_heads_to_seq,
    a2a_seq_to_heads,
    gather_seq,
    reduce_scatter_seq,
    ring_gather_seq,
    ring_reduce_seq,
)
from attn_doctor.distributed.context import Context, guarded
from attn_doctor.numerics import views

A2A_METHOD = "all_to_all sequence <-> heads (Ulysses), the backend unchanged on the full sequence"


def forward_backward(ctx: Context, backend: Backend, leaves, dout, call) -> tuple[list, str]:
    """The kernel's forward (`call()`) and its backward from `dout`, marked as the kernel's code."""
    with kernel_code(passthrough=(Unsupported,)):
        out = call()
        grads = ctx.torch.autograd.grad(out, leaves, dout)
        return [t.detach() for t in (out, *grads)], backend.ran(out)


def shard_inputs(ctx: Context, case: Case, inputs):
    """This rank's q, k, v, dout (bshd, contiguous copies): its TP heads and, under CP, its chunks."""
    hq, hkv = case.heads // ctx.tp, case.kv_heads // ctx.tp
    t = ctx.tp_rank

    def take(x, heads):
        x = x[:, :, t * heads:(t + 1) * heads]
        if ctx.cp > 1:
            x = x.index_select(1, ctx.positions(case.seq, ctx.cp_rank))
        return x.contiguous()

    return take(inputs.q, hq), take(inputs.k, hkv), take(inputs.v, hkv), take(inputs.dout, hq)


def run_shard(ctx: Context, backend: Backend, case: Case, q, k, v, dout) -> tuple[list, str, str | None]:
    """([out, dq, dk, dv] of this rank's shard, bshd; what ran; how CP was done, None without CP)."""
    shard_case = dataclasses.replace(case, heads=case.heads // ctx.tp, kv_heads=case.kv_heads // ctx.tp,
                                     seq=case.seq // ctx.cp)
    if backend.own_parallelism:
        tensors, ran = run_native(ctx, backend, case, q, k, v, dout)
        return tensors, ran, f"{backend.cp_method} ({ctx.comm})" if ctx.cp > 1 else None
    if ctx.cp == 1:
        return (*run_tp_only(ctx, backend, shard_case, q, k, v, dout), None)
    if ctx.comm == "a2a":
        return (*run_cp_a2a(ctx, backend, case, shard_case, q, k, v, dout), A2A_METHOD)
    return (*run_cp_gather(ctx, backend, case, shard_case, q, k, v, dout, ring=ctx.comm == "p2p"), backend.cp_method)


def _agreed(ctx: Context, what: str, work):
    """Run this rank's part of the work, then agree with every rank on how it went (Stop if any failed)."""
    result, status = guarded(work)
    status["ran"] = result[1] if result else ""
    ctx.agree(what, status)
    return result


def run_native(ctx: Context, backend: Backend, case: Case, q, k, v, dout):
    groups = ParallelGroups(ctx.tp, ctx.tp_group, ctx.cp, ctx.cp_group, ctx.cp_ranks, ctx.comm)

    def work():
        with kernel_code(passthrough=(Unsupported,)):
            return backend.run_parallel(groups, case, q, k, v, dout)

    # The library communicates inside forward and backward: a rank failing there leaves the others in its
    # collectives until the parent's timeout (the progress files still name it).
    ctx.compute(f"{backend.name}'s forward/backward (with its own TP/CP communication)")
    return _agreed(ctx, "the backend", work)


def run_tp_only(ctx: Context, backend: Backend, shard_case: Case, q, k, v, dout):
    """cp == 1: the backend on this rank's head shard, no communication."""
    fmt = backend.format_for(shard_case)

    def work():
        leaves = [views.to_format(t, fmt).contiguous().requires_grad_() for t in (q, k, v)]
        tensors, ran = forward_backward(ctx, backend, leaves, views.to_format(dout, fmt).contiguous(),
                                        lambda: backend.forward(*leaves, shard_case))
        return [views.to_bshd(t, fmt).contiguous() for t in tensors], ran

    ctx.compute("the backend's forward/backward")
    return _agreed(ctx, "the backend", work)


def run_cp_gather(ctx: Context, backend: Backend, case: Case, shard_case: Case, q, k, v, dout, ring: bool):
    """CP all_gather (or p2p ring): full k, v from the CP group, attend at global positions, return the
    dk, dv contributions to their owners."""
    seq = case.seq
    ctx.collective("ring exchange of k, v (p2p)" if ring else "all_gather of k, v")
    gather = ring_gather_seq if ring else gather_seq
    k_full, v_full = gather(ctx, k, seq), gather(ctx, v, seq)
    positions = ctx.positions(seq, ctx.cp_rank)

    def work():
        leaves = [t.clone().requires_grad_() for t in (q, k_full, v_full)]
        return forward_backward(ctx, backend, leaves, dout, lambda: backend.attend_at(*leaves, positions, shard_case))

    ctx.compute("the backend's forward/backward")
    (out, dq, dk_part, dv_part), ran = _agreed(ctx, "the backend", work)
    ctx.collective("ring reduction of dk, dv (p2p)" if ring else "reduce_scatter of dk, dv")
    reduce = ring_reduce_seq if ring else reduce_scatter_seq
    return [out.contiguous(), dq.contiguous(), reduce(ctx, dk_part, seq), reduce(ctx, dv_part, seq)], ran


def run_cp_a2a(ctx: Context, backend: Backend, case: Case, shard_case: Case, q, k, v, dout):
    """CP a2a (Ulysses): sequence shards -> head shards over the full sequence, the backend unchanged,
    and back."""
    seq, fmt = case.seq, backend.format_for(case)
    ctx.collective("all_to_all of q, k, v, dout")
    q_a, k_a, v_a, dout_a = (a2a_seq_to_heads(ctx, t, seq) for t in (q, k, v, dout))
    a2a_case = dataclasses.replace(shard_case, heads=q_a.shape[2], kv_heads=k_a.shape[2], seq=seq, seq_kv=seq)

    def work():
        leaves = [views.to_format(t, fmt).contiguous().requires_grad_() for t in (q_a, k_a, v_a)]
        tensors, ran = forward_backward(ctx, backend, leaves, views.to_format(dout_a, fmt).contiguous(),
                                        lambda: backend.forward(*leaves, a2a_case))
        return [views.to_bshd(t, fmt) for t in tensors], ran

    ctx.compute("the backend's forward/backward")
    tensors, ran = _agreed(ctx, "the backend", work)
    ctx.collective("all_to_all of out, dq, dk, dv")
    return [a2a_heads_to_seq(ctx, t.contiguous(), seq).contiguous() for t in tensors], ran
