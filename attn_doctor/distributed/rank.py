"""One rank of a distributed probe: `python -m attn_doctor.distributed.rank JOB.json`, started by torchrun.

The job (written by distributed.launch) lists probes (backend, case) for one rank grid: nproc = tp * cp
ranks, TP fastest (rank = cp_rank * tp + tp_rank), real process groups from new_group for every TP and
every CP group; gloo on the CPU, NCCL on CUDA (rank r on cuda:LOCAL_RANK). For each probe every rank
builds the FULL inputs from the case's seed (probe.make_inputs) and takes its shard:

* TP: query heads [t*h/tp, (t+1)*h/tp) and kv heads likewise.
* CP: the load-balanced split TE expects, 2*cp chunks, CP rank c holding chunks c and 2*cp-1-c.

How the shard is computed:

* TE (CUDA only; not runnable on this CPU-only project machine): TE's DotProductAttention with
  tp_size/tp_group and cp_group/cp_global_ranks/cp_stream/cp_comm_type, fed the local chunks. TE does
  the CP communication itself.
* PyTorch kernels (sdpa, local, --kernel), CP done here for real:
  - all_gather: all_gather the k/v chunks over the CP group into the full k, v; attend the rank's
    queries with the global causal mask (an explicit boolean mask from the queries' global positions:
    SDPA with attn_mask under the forced kernel, or Megatron local's masked_fill); backward gives dk, dv
    contributions for the whole sequence, reduce_scattered (fp32) back to the chunks' owners.
  - p2p: the same attention, with k/v chunks passed around the CP ring by send/recv (batch_isend_irecv)
    and the dk/dv contributions summed back to their owners around the ring. (TE's p2p also overlaps
    per-step attention with online-softmax merging; that part is TE's, not reproduced here.)
  - a2a (Ulysses): all_to_all turns sequence shards into head shards (full sequence, h/cp heads), the
    backend runs unchanged with its own causal mask, and all_to_all turns out/dq/dk/dv back.
  - A --kernel function takes no mask, so for all_gather/p2p its queries are placed at their global
    positions in an otherwise zero query sequence and the kernel runs causally on the full length; the
    padded rows get zero output gradient, so they add nothing to dk, dv.
  TP alone needs no communication inside attention: each rank runs the backend on its head shard.

Failures stay attributable: every rank writes progress.RANK.json (stage, probe, whether it is waiting
in a collective, its error) to the job folder, and its own output to rankRANK.log. Backend work that
raises is caught and shared with all ranks at an agreement point (all_gather_object), so every rank
leaves the probe together and the outcome names the failing rank.

Rank 0 gathers every rank's out/dq/dk/dv shards, reassembles the full tensors, measures them and each
rank's shard against float64 (attention_reference of the full inputs), against a single-process run of
the same backend on the full tensors and against the local baseline's, and writes the results JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from attn_doctor.distributed import launch as grid
from attn_doctor.core.case import tp_shard
from attn_doctor.core.errors import first_line
from attn_doctor.results.document import write_atomic

TENSORS = grid.TENSORS


class Progress:
    """This rank's progress file, replaced atomically at every stage."""

    def __init__(self, folder: str, rank: int):
        self.path = Path(folder) / f"{grid.PROGRESS_PREFIX}{rank}.json"
        self.state = {"rank": rank, "pid": os.getpid(), "stage": "starting", "probe": -1, "probe_t0": None,
                      "collective": False, "error": None, "finished": False, "t": time.time()}
        self.write()

    def write(self) -> None:
        self.state["t"] = time.time()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)

    def stage(self, stage: str, collective: bool = False) -> None:
        self.state.update(stage=stage, collective=collective)
        self.write()

    def probe(self, index: int) -> None:
        self.state.update(probe=index, probe_t0=time.time(), stage="starting the probe", collective=False)
        self.write()


def _redirect_output(folder: str, rank: int) -> None:
    """This rank's stdout and stderr go to rankRANK.log (torchrun would interleave them)."""
    log = open(Path(folder) / f"rank{rank}.log", "ab", buffering=0)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)


def _watch_parent() -> None:
    """Exit when torchrun goes away (killed): a rank must never outlive its launch."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(70)

    threading.Thread(target=watch, daemon=True).start()


class Stop(Exception):
    """Some rank could not do its part of a probe; every rank leaves the probe (statuses of all ranks)."""

    def __init__(self, statuses: list[dict]):
        super().__init__("; ".join(f"rank {r}: {s['reason']}" for r, s in enumerate(statuses) if s["status"] != "ok"))
        self.statuses = statuses


class Context:
    """The rank grid, its process groups and device, as this rank sees them."""

    def __init__(self, job: dict, progress: Progress):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.job, self.progress = job, progress
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.tp, self.cp = job["tp"], job["cp"]
        self.comm = job["cp_comm_type"]
        if self.world != self.tp * self.cp:
            raise RuntimeError(f"WORLD_SIZE {self.world} != tp {self.tp} x cp {self.cp}")
        self.tp_rank, self.cp_rank = grid.grid_position(self.rank, self.tp)
        device_name = job["device"]
        if device_name.startswith("cuda"):
            if self.local_rank >= torch.cuda.device_count():
                raise RuntimeError(f"rank {self.rank}: LOCAL_RANK {self.local_rank} but torch sees "
                                   f"{torch.cuda.device_count()} CUDA device(s)")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        import datetime

        progress.stage(f"init_process_group ({backend})", collective=True)
        # The parent enforces --timeout; the process group's own timeout only backs it up.
        timeout = datetime.timedelta(seconds=max(600.0, 4 * float(job["timeout_s"])))
        dist.init_process_group(backend=backend, timeout=timeout)
        progress.stage("creating the TP and CP groups", collective=True)
        self.tp_group = self.cp_group = None
        self.tp_ranks = self.cp_ranks = [self.rank]
        for ranks in grid.tp_group_ranks(self.tp, self.cp):  # every rank creates every group, in one order
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.tp_group, self.tp_ranks = group, ranks
        for ranks in grid.cp_group_ranks(self.tp, self.cp):
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.cp_group, self.cp_ranks = group, ranks
        self._positions: dict[tuple[int, int], object] = {}

    # -- agreement and collectives ---------------------------------------------------------------

    def agree(self, what: str, status: dict) -> list[dict]:
        """Share every rank's status; raise Stop on every rank if any rank's is not ok."""
        self.progress.stage(f"the agreement after {what}", collective=True)
        statuses: list = [None] * self.world
        self.dist.all_gather_object(statuses, status)
        if any(s["status"] != "ok" for s in statuses):
            raise Stop(statuses)
        return statuses

    def positions(self, seq: int, cp_rank: int):
        key = (seq, cp_rank)
        if key not in self._positions:
            self._positions[key] = self.torch.tensor(grid.cp_positions(seq, self.cp, cp_rank), device=self.device)
        return self._positions[key]

    def collective(self, what: str) -> None:
        self.progress.stage(what, collective=True)

    def compute(self, what: str) -> None:
        self.progress.stage(what, collective=False)


def guarded(fn):
    """(result, status): backend work may raise; the status says how, for the agreement."""
    from attn_doctor.backends import Unsupported

    try:
        return fn(), {"status": "ok", "reason": ""}
    except Unsupported as exc:
        return None, {"status": "skip", "reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - a kernel's failure on one rank becomes that rank's error
        return None, {"status": "error", "reason": first_line(exc), "detail": traceback.format_exc(limit=8)}


# -- sequence and head reshuffles over the CP group (bshd tensors: [batch, seq, heads, dim]) ---------


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


# -- attention with queries at given global positions ------------------------------------------------


def _sdpa_masked(backend, q, k, v, visible, case):
    """backend's SDPA kernel (forced alone, as in SdpaKernel) with an explicit boolean mask; bshd."""
    import warnings

    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    from attn_doctor.backends import Unsupported
    from attn_doctor.backends.sdpa import KERNELS, _skip_reasons

    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    kwargs = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel([KERNELS[backend.kernel]]):
        warnings.simplefilter("always")
        try:
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=visible, is_causal=False,
                                                 scale=case.softmax_scale, **kwargs)
        except RuntimeError as exc:
            if "No available kernel" not in str(exc):
                raise
            raise Unsupported("; ".join(_skip_reasons(caught)) or str(exc).splitlines()[0]) from None
    return out.transpose(1, 2)


def _local_masked(q, k, v, visible, case):
    """Megatron local core attention (backends/local.py) with an explicit visibility mask; bshd in/out.
    The rows of `visible` are the queries' global positions."""
    from attn_doctor.backends.local import megatron_core_attention

    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # sbhd views
    return megatron_core_attention(q, k, v, case.softmax_scale, visible).transpose(0, 1)


def _padded(backend, q, k, v, positions, case):
    """A kernel without a mask argument: queries at their global positions in a zero query sequence, the
    kernel causal over the full length, the rows of this rank's queries kept."""
    from attn_doctor.core import layouts

    fmt = backend.qkv_format
    full = q.new_zeros(q.shape[0], k.shape[1], *q.shape[2:]).index_copy(1, positions, q)
    out = backend.forward(layouts.to_format(full, fmt), layouts.to_format(k, fmt), layouts.to_format(v, fmt), case)
    return layouts.to_bshd(out, fmt).index_select(1, positions)


CP_METHODS = {
    "sdpa": "explicit global causal mask (SDPA attn_mask)",
    "local": "explicit global causal mask (Megatron masked_fill)",
    "kernel": "queries at their global positions in a zero-padded sequence (the --kernel signature has no mask)",
}


def attend_at(backend, q, k, v, positions, case):
    """out for queries q at global `positions` against the full k, v (bshd), with the case's mask."""
    import torch

    from attn_doctor.numerics.reference import allowed_mask

    if backend.spec.family == "kernel":
        return _padded(backend, q, k, v, positions, dataclasses.replace(case, seq=k.shape[1]))
    visible = allowed_mask(positions, torch.arange(k.shape[1], device=q.device), case.causal, case.window)
    if backend.spec.family == "sdpa":
        return _sdpa_masked(backend, q, k, v, visible, case)
    if backend.spec.family == "local":
        return _local_masked(q, k, v, visible, case)
    raise ValueError(f"no PyTorch context-parallel path for backend family {backend.spec.family!r}")


# -- one probe ------------------------------------------------------------------------------------


def _grads(torch, out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


def shard_inputs(ctx: Context, case, inputs):
    """This rank's q, k, v, dout (bshd, contiguous copies): its TP heads and, under CP, its chunks."""
    hq, hkv = case.heads // ctx.tp, case.num_kv_heads // ctx.tp
    t = ctx.tp_rank

    def take(x, heads):
        x = x[:, :, t * heads:(t + 1) * heads]
        if ctx.cp > 1:
            x = x.index_select(1, ctx.positions(case.seq, ctx.cp_rank))
        return x.contiguous()

    return take(inputs.q, hq), take(inputs.k, hkv), take(inputs.v, hkv), take(inputs.dout, hq)


def run_tp_only(ctx, backend, case, shard_case, q, k, v, dout):
    """cp == 1: the backend on this rank's head shard, no communication."""
    from attn_doctor.core import layouts

    torch, fmt = ctx.torch, backend.qkv_format

    def work():
        leaves = [layouts.to_format(t, fmt).contiguous().requires_grad_() for t in (q, k, v)]
        out = backend.forward(*leaves, shard_case)
        grads = _grads(torch, out, leaves, layouts.to_format(dout, fmt).contiguous())
        return [layouts.to_bshd(t.detach(), fmt).contiguous() for t in (out, *grads)], backend.ran(out)

    ctx.compute("the backend's forward/backward")
    result, status = guarded(work)
    status["ran"] = result[1] if result else ""
    ctx.agree("the backend", status)
    return result


def run_cp_gather(ctx, backend, case, shard_case, q, k, v, dout, ring: bool):
    """CP all_gather (or p2p ring): full k, v from the CP group, attend at global positions, return the
    dk, dv contributions to their owners."""
    torch, seq = ctx.torch, case.seq
    ctx.collective("ring exchange of k, v (p2p)" if ring else "all_gather of k, v")
    gather = ring_gather_seq if ring else gather_seq
    k_full, v_full = gather(ctx, k, seq), gather(ctx, v, seq)
    positions = ctx.positions(seq, ctx.cp_rank)

    def work():
        leaves = [t.clone().requires_grad_() for t in (q, k_full, v_full)]
        out = attend_at(backend, *leaves, positions, shard_case)
        grads = _grads(torch, out, leaves, dout)
        return [t.detach() for t in (out, *grads)], backend.ran(out)

    ctx.compute("the backend's forward/backward")
    result, status = guarded(work)
    status["ran"] = result[1] if result else ""
    ctx.agree("the backend", status)
    (out, dq, dk_part, dv_part), ran = result
    ctx.collective("ring reduction of dk, dv (p2p)" if ring else "reduce_scatter of dk, dv")
    reduce = ring_reduce_seq if ring else reduce_scatter_seq
    return [out.contiguous(), dq.contiguous(), reduce(ctx, dk_part, seq), reduce(ctx, dv_part, seq)], ran


def run_cp_a2a(ctx, backend, case, shard_case, q, k, v, dout):
    """CP a2a (Ulysses): sequence shards -> head shards over the full sequence, the backend unchanged,
    and back."""
    from attn_doctor.core import layouts

    torch, seq, fmt = ctx.torch, case.seq, backend.qkv_format
    ctx.collective("all_to_all of q, k, v, dout")
    q_a, k_a, v_a, dout_a = (a2a_seq_to_heads(ctx, t, seq) for t in (q, k, v, dout))
    a2a_case = dataclasses.replace(shard_case, heads=q_a.shape[2], kv_heads=k_a.shape[2], seq=seq, seq_kv=seq)

    def work():
        leaves = [layouts.to_format(t, fmt).contiguous().requires_grad_() for t in (q_a, k_a, v_a)]
        out = backend.forward(*leaves, a2a_case)
        grads = _grads(torch, out, leaves, layouts.to_format(dout_a, fmt).contiguous())
        return [layouts.to_bshd(t.detach(), fmt) for t in (out, *grads)], backend.ran(out)

    ctx.compute("the backend's forward/backward")
    result, status = guarded(work)
    status["ran"] = result[1] if result else ""
    ctx.agree("the backend", status)
    tensors, ran = result
    ctx.collective("all_to_all of out, dq, dk, dv")
    return [a2a_heads_to_seq(ctx, t.contiguous(), seq).contiguous() for t in tensors], ran


class TEShards:
    """TE DotProductAttention with TE's own TP/CP (CUDA + TE only; never run on a machine without them)."""

    def __init__(self, backend, ctx: Context):
        self.backend, self.ctx = backend, ctx  # backend: a TEAttention (path forcing, state, log capture)
        self.modules: dict[tuple, object] = {}
        self.stream = None

    def module(self, case):
        ctx, te = self.ctx, self.backend._te.te
        key = (case.heads, case.num_kv_heads, case.head_dim, case.mask, case.window)
        if key not in self.modules:
            from attn_doctor.backends.te import dpa_arguments

            # The full head counts: TE divides them by tp_size itself.
            kwargs = dict(dpa_arguments(case), tp_size=ctx.tp, tp_group=ctx.tp_group)
            if ctx.cp > 1:
                if self.stream is None:
                    self.stream = ctx.torch.cuda.Stream()
                kwargs.update(cp_group=ctx.cp_group, cp_global_ranks=ctx.cp_ranks, cp_stream=self.stream,
                              cp_comm_type=ctx.comm)
            self.modules[key] = te.DotProductAttention(**kwargs)
        return self.modules[key]

    def run(self, case, q, k, v, dout):
        """q, k, v, dout: this rank's bshd shards (local chunks in TE's load-balanced order under CP)."""
        from attn_doctor.backends import Unsupported
        from attn_doctor.backends.te import NO_BACKEND_MESSAGE, describe_state

        ctx, torch = self.ctx, self.ctx.torch
        module = self.module(case)

        def work():
            leaves = [t.transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]  # sbhd
            self.backend._force()
            self.backend._te.capture.lines.clear()
            try:
                out = module(*leaves)
            except ValueError as exc:
                if NO_BACKEND_MESSAGE not in str(exc):
                    raise
                raise Unsupported(self.backend._disabled_reasons() or str(exc)) from None
            ran = describe_state(self.backend._te.state)
            out = out.view(leaves[0].shape[0], leaves[0].shape[1], case.heads // ctx.tp, case.head_dim)
            grads = _grads(torch, out, leaves, dout.transpose(0, 1).contiguous())
            return [t.detach().transpose(0, 1).contiguous() for t in (out, *grads)], ran

        # TE communicates inside forward and backward: a rank failing there leaves the others in TE's
        # collectives until the parent's timeout (the progress files still name it).
        ctx.compute("TE's forward/backward (with its own TP/CP communication)")
        result, status = guarded(work)
        status["ran"] = result[1] if result else ""
        ctx.agree("TE", status)
        return result


def _single(torch, backend, case, inputs):
    """The backend on the full tensors in one process (contiguous, its own format): bshd out, dq, dk, dv."""
    from attn_doctor.core import layouts

    fmt = backend.qkv_format
    leaves = [layouts.to_format(t, fmt).contiguous().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    out = backend.forward(*leaves, case)
    grads = _grads(torch, out, leaves, layouts.to_format(inputs.dout, fmt).contiguous())
    return [layouts.to_bshd(t.detach(), fmt) for t in (out, *grads)]


class Prober:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.backends: dict[str, object] = {}
        self.te_shards: dict[str, TEShards] = {}
        self._case_key: tuple | None = None  # rank 0: the case whose reference and baseline run are kept
        self._case_runs: tuple[dict, float, dict | None, dict, float] | None = None

    def backend(self, spec):
        from attn_doctor.backends import build

        if spec.name not in self.backends:
            self.backends[spec.name] = build(spec)
        return self.backends[spec.name]

    def run(self, probe: dict) -> dict | None:
        """Every rank runs this; rank 0 returns the result, the others None."""
        from attn_doctor.backends import BackendSpec
        from attn_doctor.core.case import Case
        from attn_doctor.probes.run import make_inputs, synchronize

        ctx, torch = self.ctx, self.ctx.torch
        spec, case = BackendSpec.from_dict(probe["backend"]), Case.from_dict(probe["case"])
        shard_case = dataclasses.replace(tp_shard(case, ctx.tp), seq=case.seq // ctx.cp)

        ctx.compute("building the backend and the inputs")

        def setup():
            backend = self.backend(spec)
            why = backend.unsupported(shard_case, ctx.device)
            if why:
                from attn_doctor.backends import Unsupported

                raise Unsupported(why)
            inputs = make_inputs(case, ctx.device)
            checksum = [float(t.double().sum()) for t in (inputs.q, inputs.k, inputs.v, inputs.dout)]
            return backend, inputs, checksum

        result, status = guarded(setup)
        status["checksum"] = result[2] if result else None
        statuses = ctx.agree("building the inputs", status)
        if len({tuple(s["checksum"]) for s in statuses}) != 1:
            raise Stop([{"status": "error", "reason": f"built different inputs from seed {case.seed} "
                         f"(checksums {s['checksum']})"} for s in statuses])
        backend, inputs, _ = result
        q, k, v, dout = shard_inputs(ctx, case, inputs)

        synchronize(ctx.device)
        start = time.perf_counter()
        if spec.family == "te":
            if spec.name not in self.te_shards:
                self.te_shards[spec.name] = TEShards(backend, ctx)
            tensors, ran = self.te_shards[spec.name].run(case, q, k, v, dout)
            method = f"TE's own CP ({ctx.comm})" if ctx.cp > 1 else None
        elif ctx.cp == 1:
            tensors, ran = run_tp_only(ctx, backend, case, shard_case, q, k, v, dout)
            method = None
        elif ctx.comm == "a2a":
            tensors, ran = run_cp_a2a(ctx, backend, case, shard_case, q, k, v, dout)
            method = "all_to_all sequence <-> heads (Ulysses), the backend unchanged on the full sequence"
        else:
            tensors, ran = run_cp_gather(ctx, backend, case, shard_case, q, k, v, dout, ring=ctx.comm == "p2p")
            method = CP_METHODS[spec.family]
        synchronize(ctx.device)
        kernel_s = time.perf_counter() - start

        ctx.collective("gathering the shards on rank 0")
        rans: list = [None] * ctx.world
        ctx.dist.all_gather_object(rans, ran)
        gathered = {}
        for name, tensor in zip(TENSORS, tensors):
            parts = [torch.empty_like(tensor) for _ in range(ctx.world)] if ctx.rank == 0 else None
            ctx.dist.gather(tensor.contiguous(), parts, dst=0)
            gathered[name] = parts
        if ctx.rank != 0:
            return None
        ctx.compute("rank 0: float64 reference, single-process runs, comparison")
        try:
            return self.analyse(spec, backend, case, inputs, gathered, rans, method, kernel_s)
        except Exception as exc:  # noqa: BLE001 - rank 0's own analysis failing is this probe's error
            return {"status": "error", "reason": f"rank 0 failed comparing the shards: {first_line(exc)}",
                    "detail": traceback.format_exc(limit=8)}

    def analyse(self, spec, backend, case, inputs, gathered, rans, method, kernel_s) -> dict:
        from attn_doctor.numerics.metrics import compare
        from attn_doctor.probes.run import relative_distance, synchronize

        ctx, torch = self.ctx, self.ctx.torch
        hq, hkv = case.heads // ctx.tp, case.num_kv_heads // ctx.tp

        def shard_index(name: str, rank: int):
            t, c = grid.grid_position(rank, ctx.tp)
            heads = hq if name in ("out", "dq") else hkv
            pos = ctx.positions(case.seq, c) if ctx.cp > 1 else slice(None)
            return pos, slice(t * heads, (t + 1) * heads)

        def cut(tensor, name: str, rank: int):
            pos, heads = shard_index(name, rank)
            return tensor[:, pos, heads]

        full = {}
        for name, parts in gathered.items():
            like = inputs.q if name in ("out", "dq") else inputs.k
            whole = torch.empty_like(like)
            for rank, part in enumerate(parts):
                pos, heads = shard_index(name, rank)
                whole[:, pos, heads] = part
            full[name] = whole

        reference, reference_s, baseline, notes, baseline_s = self._reference_and_baseline(case, inputs)
        start = time.perf_counter()
        single, single_notes = self._single_run(backend, case, inputs, "single")
        notes = {**single_notes, **notes}
        synchronize(ctx.device)
        single_s = baseline_s + time.perf_counter() - start

        start = time.perf_counter()

        result = {
            "status": "ok",
            "ran": self.ran_label(rans),
            "metrics": {n: compare(full[n], reference[n]).to_dict() for n in TENSORS},
            "single_metrics": {n: compare(single[n], reference[n]).to_dict() for n in TENSORS} if single else {},
            "baseline_metrics": {n: compare(baseline[n], reference[n]).to_dict() for n in TENSORS} if baseline else {},
            "vs_single": {n: relative_distance(full[n], single[n]) for n in TENSORS} if single else {},
            "bitwise_single": {n: bool(torch.equal(full[n], single[n])) for n in TENSORS} if single else {},
            "ranks": [],
            "extra": {"cp_method": method, **notes} if method else dict(notes),
        }
        for rank in range(ctx.world):
            t, c = grid.grid_position(rank, ctx.tp)
            refs = {n: cut(reference[n], n, rank) for n in TENSORS}
            entry = {"rank": rank, "tp_rank": t, "cp_rank": c, "ran": rans[rank],
                     "metrics": {n: compare(gathered[n][rank], refs[n]).to_dict() for n in TENSORS}}
            if baseline:
                entry["baseline_metrics"] = {n: compare(cut(baseline[n], n, rank), refs[n]).to_dict() for n in TENSORS}
            if single:
                entry["vs_single"] = {n: relative_distance(gathered[n][rank], cut(single[n], n, rank)) for n in TENSORS}
            result["ranks"].append(entry)
        result["seconds"] = {"kernel": kernel_s, "reference": reference_s, "single-process runs": single_s,
                             "compare": time.perf_counter() - start}
        return result

    def _reference_and_baseline(self, case, inputs) -> tuple[dict, float, dict | None, dict, float]:
        """Rank 0: the float64 reference and the local baseline's single-process run of `case`, with their
        seconds; computed for the case's first probe and kept for its other backends."""
        from attn_doctor.backends import BASELINE, BackendSpec
        from attn_doctor.probes.run import synchronize
        from attn_doctor.numerics.reference import attention_reference

        if self._case_key != case.key():
            self._case_runs = None  # free the previous case first
            start = time.perf_counter()
            reference = attention_reference(inputs.q, inputs.k, inputs.v, inputs.dout, causal=case.causal,
                                            softmax_scale=case.softmax_scale, window=case.window).tensors()
            synchronize(self.ctx.device)
            reference_s = time.perf_counter() - start
            start = time.perf_counter()
            baseline, notes = self._single_run(self.backend(BackendSpec(BASELINE, "local")), case, inputs, "baseline")
            synchronize(self.ctx.device)
            self._case_key = case.key()
            self._case_runs = (reference, reference_s, baseline, notes, time.perf_counter() - start)
        return self._case_runs

    def _single_run(self, backend, case, inputs, label: str) -> tuple[dict | None, dict]:
        """`backend` on the full tensors in this one process, or None with the note saying why not."""
        from attn_doctor.backends import Unsupported

        try:
            return dict(zip(TENSORS, _single(self.ctx.torch, backend, case, inputs))), {}
        except Unsupported as exc:
            return None, {f"{label}_skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported beside the distributed result
            return None, {f"{label}_error": first_line(exc)}

    def ran_label(self, rans: list[str]) -> str:
        ctx = self.ctx
        what = rans[0] if len(set(rans)) == 1 else "; ".join(f"rank {r}: {x}" for r, x in enumerate(rans))
        return f"{what} + {grid.parallel_label(ctx.tp, ctx.cp, ctx.comm, ctx.world)}"


def stop_result(stop: Stop) -> dict:
    bad = [(r, s) for r, s in enumerate(stop.statuses) if s["status"] != "ok"]
    reasons = {s["reason"] for _, s in bad}
    if len(bad) == len(stop.statuses) and len(reasons) == 1:
        reason = f"every rank: {reasons.pop()}"
    else:
        reason = "; ".join(f"rank {r}: {s['reason']}" for r, s in bad)
    status = "skip" if all(s["status"] == "skip" for _, s in bad) else "error"
    detail = "\n".join(f"--- rank {r} ---\n{s['detail']}" for r, s in bad if s.get("detail"))
    return {"status": status, "reason": reason, "detail": detail}


def run(job: dict, progress: Progress) -> int:
    ctx = Context(job, progress)
    prober = Prober(ctx)
    results: list[dict] = []
    for index, probe in enumerate(job["probes"]):
        progress.probe(index)
        try:
            result = prober.run(probe)
        except Stop as stop:
            result = stop_result(stop) if ctx.rank == 0 else None
        if ctx.rank == 0:
            results.append(result)
            write_atomic(Path(job["output"]), json.dumps(results, allow_nan=True))
    progress.stage("finishing", collective=True)
    ctx.dist.barrier()
    ctx.dist.destroy_process_group()
    progress.state["finished"] = True
    progress.stage("finished")
    return 0


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    _redirect_output(job["folder"], rank)
    progress = Progress(job["folder"], rank)
    _watch_parent()
    if any(p["backend"]["family"] == "te" for p in job["probes"]):
        # TE before anything loads torch's cuDNN (see backends/te.py); failures surface per probe.
        try:
            from attn_doctor.backends.te import load_te

            load_te()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        return record(run)(job, progress)
    except BaseException as exc:
        progress.state["error"] = first_line(exc)
        progress.write()  # keeps "collective": whether it failed waiting on a peer or on its own
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
