"""A CALL probe: one backend, one case, one memory layout, measured against float64."""

from __future__ import annotations

import time

import torch

from attn_doctor.backends import Backend, Unsupported
from attn_doctor.core import layouts
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import kernel_code
from attn_doctor.numerics.inputs import synchronize
from attn_doctor.numerics.metrics import compare
from attn_doctor.probes.caches import Caches, Progress
from attn_doctor.probes.outcome import ProbeOutcome


def run(backend: Backend, coords: Coords, caches: Caches, progress: Progress | None = None) -> ProbeOutcome:
    case, device = coords.case, caches.device
    inputs, reference = caches.case.get(case)
    seconds = {"reference": caches.case.reference_seconds}
    fmt = backend.qkv_format
    qkv = layouts.build(coords.layout, inputs.q, inputs.k, inputs.v, fmt)
    dout = layouts.to_format(inputs.dout, fmt).contiguous()
    synchronize(device)
    start = time.perf_counter()
    with kernel_code(passthrough=(Unsupported,)):
        out = backend.forward(qkv.q, qkv.k, qkv.v, case)
        ran = backend.ran(out)
        expected = tuple(qkv.q.shape)
        if tuple(out.shape) != expected:
            raise ValueError(f"{backend.name} returned out of shape {tuple(out.shape)}, expected {expected} ({fmt})")
        dq, dk, dv = torch.autograd.grad(out, (qkv.q, qkv.k, qkv.v), dout)
        synchronize(device)  # a CUDA fault of the kernel surfaces here, not in the comparison
    seconds["kernel"] = time.perf_counter() - start
    start = time.perf_counter()
    got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    metrics = {
        name: compare(layouts.to_bshd(tensor.detach(), fmt), reference.tensors()[name]) for name, tensor in got.items()
    }
    seconds["compare"] = time.perf_counter() - start
    return ProbeOutcome("ok", ran=ran, metrics=metrics, seconds=seconds)
