"""A DEPTH probe: dQ at every layer of an L-layer GPT stack with the backend as its core attention (TP
shards inside each layer), against the stack's float64 replica and against the local baseline's stack;
judged on the first and the last layer.

Each layer's dQ is compared as the backward hands it on (`stack.LayerErrors`), and only the first and the last
layer's are kept: a 128-layer stack never holds 128 dQ besides the reference's."""

from __future__ import annotations

import time

import torch

from attn_doctor.backends import Backend, Unsupported
from attn_doctor.core.case import tp_shard
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import kernel_code
from attn_doctor.numerics.inputs import release_cached_memory, synchronize
from attn_doctor.numerics.metrics import relative_distance
from attn_doctor.numerics.standalone import TORCH_DTYPES
from attn_doctor.probes.caches import Caches, Progress
from attn_doctor.probes.outcome import ProbeOutcome
from attn_doctor.probes.stack import BackendAttention, LayerErrors, bshd, layer_progress, make_stack, run_stack


def run(backend: Backend, coords: Coords, caches: Caches, progress: Progress | None = None) -> ProbeOutcome:
    case, layers, tp, device = coords.case, coords.layers, coords.tp, caches.device
    reference, baseline = caches.depth.get(case, layers, progress)
    stack = make_stack(case, layers, device, TORCH_DTYPES[case.dtype])
    start = time.perf_counter()
    attention = BackendAttention(backend, tp_shard(case, tp))
    measured = LayerErrors(reference)
    unsharded: dict[int, torch.Tensor] = {}

    def keep_first(index: int, dq: torch.Tensor) -> None:
        if index == 0:
            unsharded[0] = dq

    with kernel_code(passthrough=(Unsupported,)):
        run_stack(stack, case, attention, measured, tp=tp, on_layer=layer_progress(backend.name, layers, progress))
        if tp > 1:
            run_stack(stack, case, BackendAttention(backend, case), keep_first)
        ran = backend.ran(attention.last_out)
        synchronize(device)
    seconds = {"reference": caches.depth.reference_seconds, "kernel": time.perf_counter() - start}
    extra = {
        "layers": layers,
        "dq_rel_err_by_layer": [m.rel_err for m in measured.metrics],
        "baseline_dq_rel_err_by_layer": [m.rel_err for m in baseline.metrics],
        "dq_first_vs_baseline": relative_distance(bshd(measured.first), bshd(baseline.first)),
        "dq_last_vs_baseline": relative_distance(bshd(measured.last), bshd(baseline.last)),
    }
    if tp > 1:
        extra["dq_first_vs_tp1"] = relative_distance(bshd(measured.first), bshd(unsharded[0]))
    metrics = {"dq_first": measured.metrics[0], "dq_last": measured.metrics[-1]}
    del stack, measured, unsharded
    release_cached_memory(device)
    return ProbeOutcome("ok", ran=ran, metrics=metrics, seconds=seconds, extra=extra)
