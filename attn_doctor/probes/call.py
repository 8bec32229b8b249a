"""A CALL probe: one backend, one case, one memory layout, measured against float64 (`--repeats N`: N
times on the same inputs, judged on the worst repeat)."""

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
from attn_doctor.probes.repeats import Repeats

TENSORS = ("out", "dq", "dk", "dv")


def run(backend: Backend, coords: Coords, caches: Caches, progress: Progress | None = None,
        repeats: int = 1) -> ProbeOutcome:
    """With `repeats` > 1 the forward and backward run that many times on the same inputs and views; the
    metrics are each tensor's worst repeat, and `extra["repeats"]` says whether the repeats were bitwise
    identical and how far apart they were (`attn_doctor.probes.repeats`)."""
    case, device = coords.case, caches.device
    inputs, reference = caches.case.get(case)
    seconds = {"reference": caches.case.reference_seconds, "kernel": 0.0, "compare": 0.0}
    fmt = backend.qkv_format
    qkv = layouts.build(coords.layout, inputs.q, inputs.k, inputs.v, fmt)
    dout = layouts.to_format(inputs.dout, fmt).contiguous()
    record = Repeats(repeats)
    ran_texts: list[str] = []
    for repeat in range(repeats):
        if progress is not None and repeats > 1:
            progress(f"repeat {repeat + 1}/{repeats}")
        synchronize(device)
        start = time.perf_counter()
        with kernel_code(passthrough=(Unsupported,)):
            out = backend.forward(qkv.q, qkv.k, qkv.v, case)
            ran_texts.append(backend.ran(out))
            expected = tuple(qkv.q.shape)
            if tuple(out.shape) != expected:
                raise ValueError(f"{backend.name} returned out of shape {tuple(out.shape)}, expected {expected} "
                                 f"({fmt})")
            dq, dk, dv = torch.autograd.grad(out, (qkv.q, qkv.k, qkv.v), dout)
            synchronize(device)  # a CUDA fault of the kernel surfaces here, not in the comparison
        seconds["kernel"] += time.perf_counter() - start
        start = time.perf_counter()
        got = {name: layouts.to_bshd(t.detach(), fmt) for name, t in zip(TENSORS, (out, dq, dk, dv))}
        del out, dq, dk, dv
        metrics = {
            name: compare(tensor, reference.tensors()[name], reference.terms(name))
            for name, tensor in got.items()
        }
        record.add(got, metrics)
        del got
        seconds["compare"] += time.perf_counter() - start
    ran = "; then ".join(dict.fromkeys(ran_texts))  # one text, unless the library answered differently
    return ProbeOutcome("ok", ran=ran, metrics=record.worst, seconds=seconds, extra=record.facts())
