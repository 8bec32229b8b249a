"""A DEPTH probe: dQ at every layer of an L-layer GPT stack with the backend as its core attention (TP
shards inside each layer), against the stack's float64 replica and against the local baseline's stack;
judged on the first and the last layer."""

from __future__ import annotations

import time

import torch

from attn_doctor.backends import Backend, Unsupported
from attn_doctor.core.case import tp_shard
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import kernel_code
from attn_doctor.numerics.inputs import release_cached_memory, synchronize
from attn_doctor.numerics.standalone import TORCH_DTYPES
from attn_doctor.numerics.metrics import compare, relative_distance
from attn_doctor.probes.caches import Caches, Progress
from attn_doctor.probes.outcome import ProbeOutcome
from attn_doctor.probes.stack import BackendAttention, layer_progress, make_stack, run_stack


def run(backend: Backend, coords: Coords, caches: Caches, progress: Progress | None = None) -> ProbeOutcome:
    case, layers, tp, device = coords.case, coords.layers, coords.tp, caches.device
    reference, baseline = caches.depth.get(case, layers, progress)
    stack = make_stack(case, layers, device, TORCH_DTYPES[case.dtype])
    start = time.perf_counter()
    attention = BackendAttention(backend, tp_shard(case, tp))
    with kernel_code(passthrough=(Unsupported,)):
        dqs = run_stack(stack, case, attention, tp=tp, on_layer=layer_progress(backend.name, layers, progress))
        unsharded = run_stack(stack, case, BackendAttention(backend, case)) if tp > 1 else None
        ran = backend.ran(attention.last_out)
        synchronize(device)
    seconds = {"reference": caches.depth.reference_seconds, "kernel": time.perf_counter() - start}
    release_cached_memory(device)

    def bshd(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1)

    by_layer = [compare(bshd(d), bshd(r)) for d, r in zip(dqs, reference)]
    base_by_layer = [compare(bshd(b), bshd(r)) for b, r in zip(baseline, reference)]
    extra = {
        "layers": layers,
        "dq_rel_err_by_layer": [m.rel_err for m in by_layer],
        "baseline_dq_rel_err_by_layer": [m.rel_err for m in base_by_layer],
        "dq_first_vs_baseline": relative_distance(bshd(dqs[0]), bshd(baseline[0])),
        "dq_last_vs_baseline": relative_distance(bshd(dqs[-1]), bshd(baseline[-1])),
    }
    if unsharded is not None:
        extra["dq_first_vs_tp1"] = relative_distance(bshd(dqs[0]), bshd(unsharded[0]))
    return ProbeOutcome("ok", ran=ran, metrics={"dq_first": by_layer[0], "dq_last": by_layer[-1]},
                        seconds=seconds, extra=extra)
