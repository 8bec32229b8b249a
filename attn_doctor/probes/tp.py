"""A TP probe: the heads split into `tp` shards as Megatron's tensor parallelism splits them, each shard
its own call (as head-sliced views of the full tensors, or as contiguous copies), the shards' outputs and
gradients joined and measured against float64 and against the unsharded (TP=1) run."""

from __future__ import annotations

import time

import torch

from attn_doctor.backends import Backend, Unsupported
from attn_doctor.core.case import tp_shard
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import kernel_code
from attn_doctor.numerics import views
from attn_doctor.numerics.inputs import synchronize
from attn_doctor.numerics.metrics import compare, relative_distance
from attn_doctor.probes.caches import Caches, Progress
from attn_doctor.probes.outcome import ProbeOutcome

TENSORS = ("out", "dq", "dk", "dv")


def _grads(backend: Backend, q, k, v, dout, case):
    out = backend.forward(q, k, v, case)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def run(backend: Backend, coords: Coords, caches: Caches, progress: Progress | None = None) -> ProbeOutcome:
    case, tp, device = coords.case, coords.tp, caches.device
    inputs, reference = caches.case.get(case)
    fmt = backend.format_for(case)
    full = views.build("contiguous", inputs.q, inputs.k, inputs.v, fmt)
    dout = views.to_format(inputs.dout, fmt).contiguous()
    shard_case = tp_shard(case, tp)
    hq, hkv = shard_case.heads, shard_case.kv_heads
    start = time.perf_counter()
    with kernel_code(passthrough=(Unsupported,)):
        unsharded = [t.detach() for t in _grads(backend, full.q, full.k, full.v, dout, case)]
        parts = []
        for shard in range(tp):
            q = full.q[:, :, shard * hq:(shard + 1) * hq]
            k = full.k[:, :, shard * hkv:(shard + 1) * hkv]
            v = full.v[:, :, shard * hkv:(shard + 1) * hkv]
            if coords.shards_as == "copies":
                q, k, v = (t.contiguous() for t in (q, k, v))
            parts.append(_grads(backend, q, k, v, dout[:, :, shard * hq:(shard + 1) * hq].contiguous(), shard_case))
        ran = backend.ran(parts[-1][0])
        synchronize(device)
    seconds = {"reference": caches.case.reference_seconds, "kernel": time.perf_counter() - start}
    joined = [torch.cat([p[i].detach() for p in parts], dim=2) for i in range(4)]
    metrics = {
        name: compare(views.to_bshd(t, fmt), reference.tensors()[name], reference.terms(name))
        for name, t in zip(TENSORS, joined)
    }
    extra = {
        f"{name}_vs_tp1": relative_distance(views.to_bshd(t, fmt), views.to_bshd(u, fmt))
        for name, t, u in zip(TENSORS, joined, unsharded)
    }
    return ProbeOutcome("ok", ran=ran, metrics=metrics, seconds=seconds, extra=extra)
