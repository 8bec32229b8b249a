"""A CALL probe: one backend, one case, one memory layout, measured against float64 (`--repeats N`: N
times on the same inputs, judged on the worst repeat). A forward-only case runs no backward and is judged on out
(and the max logit, where the case asks TE for it and the path returns one) alone. The baseline's probe also measures, once per case, what a
correct flash-style backward's output rounding makes on it (`attn_doctor.numerics.rounded_output`): the part of
flash-style paths' yardstick the baseline's own error does not hold."""

from __future__ import annotations

import dataclasses
import time

import torch

from attn_doctor.backends import BASELINE, Backend, Unsupported
from attn_doctor.core import layouts
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import kernel_code
from attn_doctor.numerics import views
from attn_doctor.numerics.inputs import synchronize
from attn_doctor.numerics.masks import valid_tokens, with_sink_leaf
from attn_doctor.numerics.metrics import compare
from attn_doctor.probes.caches import Caches, Progress
from attn_doctor.probes.outcome import ProbeOutcome
from attn_doctor.probes.repeats import Repeats

TENSORS = ("out", "dq", "dk", "dv")


def _padding_counts(tensor: torch.Tensor, valid: torch.Tensor) -> tuple[int, int]:
    """(values in padding, how many of them are not 0) of a bshd tensor whose valid tokens are `valid` (on the
    host: one wait for the tensor's device, not three)."""
    padding = ~valid
    values = int(padding.sum()) * tensor[0, 0].numel()
    if not values:
        return 0, 0
    return values, int(((tensor != 0) & padding.to(tensor.device)[:, :, None, None]).sum())


def _warm_up(backend: Backend, qkv, case, semantics, dout: torch.Tensor) -> None:
    """One discarded step (forward and backward, this output gradient) before the measured one.

    FP8 delayed scaling quantises each tensor with a scale from the amaxes of earlier steps (scale 1 on the
    very first). After one step on these very inputs the scales are the ones a converged training run has for
    them (and what the FP8 simulation of the baseline assumes), so the measured step is judged as a user's
    steady state, not as a first step. The step runs with gradients enabled also before a forward-only probe: TE
    updates the scales as its autocast exits only then (`autocast_exit`, TE 2.20 quantization.py), and a
    forward-only warm-up left TE's unfused path on scale 1, its output 2.6-7.6x the yardstick (the H100's
    te-tests): a model run for inference has the scales its training left."""
    with kernel_code(passthrough=(Unsupported,)), torch.set_grad_enabled(True):
        out = backend.forward(qkv.q, qkv.k, qkv.v, case, with_sink_leaf(semantics))
        if not case.forward_only:
            torch.autograd.grad(out, (qkv.q, qkv.k, qkv.v), dout.reshape(out.shape), allow_unused=True)
        del out


def run(backend: Backend, coords: Coords, caches: Caches, progress: Progress | None = None,
        repeats: int = 1) -> ProbeOutcome:
    """With `repeats` > 1 the forward and backward run that many times on the same inputs and views; the
    metrics are each tensor's worst repeat, and `extra["repeats"]` says whether the repeats were bitwise
    identical and how far apart they were (`attn_doctor.probes.repeats`)."""
    case, device = coords.case, caches.device
    inputs, reference = caches.case.get(case)
    # kernel_cpu: the process's CPU time in the kernel's calls: a library building and compiling its kernels, and
    # the waits for the GPU too, since CUDA spins a core while a process waits (on the H100 it was 99 % of `kernel`
    # for every path; reports/h100/issue51/lease8).
    seconds = {"reference": caches.case.reference_seconds, "kernel": 0.0, "kernel_cpu": 0.0, "compare": 0.0}
    fmt = backend.format_for(case)
    packed = layouts.packing(case, inputs.semantics.slots) if fmt == "thd" else None
    dout = None
    if coords.layout == layouts.CAPTURED:
        source = caches.source_of(case)
        qkv = source.views(case, inputs.q, inputs.k, inputs.v, fmt)
        dout = source.dout(case, inputs.dout)  # dO as the run's backward got it, when captured
    else:
        qkv = views.build(coords.layout, inputs.q, inputs.k, inputs.v, fmt, packed)
    if dout is None:
        dout = views.to_format(inputs.dout, fmt, packed).contiguous()
    valid = valid_tokens(case, "cpu")
    masks = caches.case.compared_rows(case)
    record = Repeats(repeats)
    ran_texts: list[str] = []
    if case.fp8 == "delayed":
        _warm_up(backend, qkv, case, inputs.semantics, dout)
    for repeat in range(repeats):
        if progress is not None and repeats > 1:
            progress(f"repeat {repeat + 1}/{repeats}")
        synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        semantics = with_sink_leaf(inputs.semantics)
        with kernel_code(passthrough=(Unsupported,)), torch.set_grad_enabled(not case.forward_only):
            out = backend.forward(qkv.q, qkv.k, qkv.v, case, semantics)
            ran_texts.append(backend.ran(out))
            expected = (*qkv.q.shape[:-1], case.head_dim_v)
            if tuple(out.shape) != expected:
                raise ValueError(f"{backend.name} returned out of shape {tuple(out.shape)}, expected {expected} "
                                 f"({fmt})")
            max_logit = backend.max_logit() if reference.max_logit is not None else None
            grads: list[torch.Tensor | None] = []
            if not case.forward_only:
                sink = backend.sink_leaf(semantics) if reference.dsink is not None else None
                grads = list(torch.autograd.grad(out, (qkv.q, qkv.k, qkv.v) + ((sink,) if sink is not None else ()),
                                                 dout, allow_unused=True))
                # An input the output does not depend on has a zero gradient (judged like any other).
                grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads[:3], (qkv.q, qkv.k, qkv.v))] + (
                    grads[3:] if sink is not None else [None])
            synchronize(device)  # a CUDA fault of the kernel surfaces here, not in the comparison
        seconds["kernel"] += time.perf_counter() - start
        seconds["kernel_cpu"] += time.process_time() - cpu_start
        start = time.perf_counter()
        got = {name: views.to_bshd(t.detach(), fmt, packed, "q" if name in ("out", "dq") else "kv")
               for name, t in zip(TENSORS, (out, *grads[:3]))}
        if reference.dsink is not None and grads:
            dsink = grads[3] if grads[3] is not None else torch.zeros(case.heads, device=device)
            got["dsink"] = dsink.detach().reshape(1, 1, case.heads, 1)
        if max_logit is not None:
            got["max_logit"] = max_logit.detach().reshape(1, 1, case.heads, 1)
        del out, grads, max_logit
        measured = caches.case.measured
        metrics = {name: measured.find(name, tensor) for name, tensor in got.items()}
        for name, tensor in got.items():
            if metrics[name] is not None:
                continue  # bitwise equal to a tensor already compared on this case: the same metrics
            metrics[name] = compare(tensor, reference.tensors()[name], reference.terms(name), **masks.get(name, {}))
            if case.padded and name in TENSORS:
                values, nonzero = _padding_counts(tensor, valid[0] if name in ("out", "dq") else valid[1])
                metrics[name] = dataclasses.replace(metrics[name], padding_values=values, padding_nonzero=nonzero)
            measured.keep(name, tensor, metrics[name])
        record.add(got, metrics)
        del got
        seconds["compare"] += time.perf_counter() - start
    ran = "; then ".join(dict.fromkeys(ran_texts))  # one text, unless the library answered differently
    flash_style = {}
    if coords.is_baseline(BASELINE):
        flash_style = caches.case.flash_style(case, masks)
        seconds["flash_style"] = caches.case.flash_style_seconds
    return ProbeOutcome("ok", ran=ran, metrics=record.worst, seconds=seconds, extra=record.facts(),
                        flash_style=flash_style)
