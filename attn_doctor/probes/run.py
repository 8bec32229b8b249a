"""One probe: build a case's inputs, run one backend on one layout, and measure it against float64.

This is what a worker process does for each job. Inputs and the reference are cached per case; the
reference is normally the parent's, shared by every family's worker (see `shared_reference`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from attn_doctor.core import layouts
from attn_doctor.backends import Backend, Unsupported
from attn_doctor.core.case import Case, tp_shard, tp_unsupported
from attn_doctor.numerics.metrics import TensorMetrics, compare
from attn_doctor.numerics.reference import Reference, attention_reference

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor


def make_inputs(case: Case, device: torch.device) -> Inputs:
    """Seeded standard-normal q, k, v and output gradient, drawn in fp32 on `device` and rounded to the dtype."""
    generator = torch.Generator(device=device).manual_seed(case.seed)
    dtype = TORCH_DTYPES[case.dtype]

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype)

    q = draw(case.batch, case.seq, case.heads, case.head_dim)
    k = draw(case.batch, case.seq_k, case.num_kv_heads, case.head_dim)
    v = draw(case.batch, case.seq_k, case.num_kv_heads, case.head_dim)
    dout = draw(case.batch, case.seq, case.heads, case.head_dim)
    return Inputs(q, k, v, dout)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory(device: torch.device) -> None:
    """Give the caching allocator's free blocks back to the GPU, for the other worker processes."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class ProbeOutcome:
    status: str  # "ok", "skip" or "error"
    ran: str = ""
    reason: str = ""
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # probe-specific facts (per-layer errors, pairwise distances)

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "ran": self.ran,
            "reason": self.reason,
            "metrics": {name: m.to_dict() for name, m in self.metrics.items()},
            "seconds": self.seconds,
            "extra": self.extra,
        }


class CaseCache:
    """Inputs and reference of the most recent case (jobs arrive grouped by case).

    The reference is the parent's shared one when the job carries a handle (see `shared_reference`), else
    computed here. `reference_seconds` is what getting it cost this process; `reference_source` says how.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._key: tuple | None = None
        self._inputs: Inputs | None = None
        self._reference: Reference | None = None
        self.reference_seconds = 0.0
        self.reference_source = ""
        self.shared: tuple[torch.Tensor, ...] | None = None  # the parent's reference, mapped, if the job had one

    def get(self, case: Case) -> tuple[Inputs, Reference]:
        if case.key() != self._key:
            self._inputs = self._reference = None  # free the previous case before building the next
            inputs = make_inputs(case, self.device)
            start = time.perf_counter()
            self.reference_source = "shared" if self.shared is not None else "computed"
            if self.shared is not None:
                reference = Reference(*self.shared)
            else:
                reference = attention_reference(
                    inputs.q, inputs.k, inputs.v, inputs.dout,
                    causal=case.causal, softmax_scale=case.softmax_scale, window=case.window,
                )
            synchronize(self.device)
            self.reference_seconds = time.perf_counter() - start
            self._key, self._inputs, self._reference = case.key(), inputs, reference
        return self._inputs, self._reference

    def clear(self) -> None:
        """Drop the case; a shared reference is released, so the parent can free it."""
        self._key = self._inputs = self._reference = None


def run_probe(backend: Backend, case: Case, layout: str, cache: CaseCache) -> ProbeOutcome:
    """Run `backend` on `case` laid out as `layout`; errors other than Unsupported propagate."""
    device = cache.device
    why_not = layouts.layout_unsupported(layout, case.seq, case.seq_k, case.heads, case.num_kv_heads)
    why_not = why_not or backend.unsupported(case, device)
    if why_not:
        return ProbeOutcome("skip", reason=why_not)
    inputs, reference = cache.get(case)
    seconds = {"reference": cache.reference_seconds}
    fmt = backend.qkv_format
    qkv = layouts.build(layout, inputs.q, inputs.k, inputs.v, fmt)
    dout = layouts.to_format(inputs.dout, fmt).contiguous()
    synchronize(device)
    start = time.perf_counter()
    try:
        out = backend.forward(qkv.q, qkv.k, qkv.v, case)
    except Unsupported as exc:
        return ProbeOutcome("skip", reason=str(exc))
    ran = backend.ran(out)
    expected = tuple(qkv.q.shape)
    if tuple(out.shape) != expected:
        raise ValueError(f"{backend.name} returned out of shape {tuple(out.shape)}, expected {expected} ({fmt})")
    dq, dk, dv = torch.autograd.grad(out, (qkv.q, qkv.k, qkv.v), dout)
    synchronize(device)
    seconds["kernel"] = time.perf_counter() - start
    start = time.perf_counter()
    got = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    metrics = {
        name: compare(layouts.to_bshd(tensor.detach(), fmt), reference.tensors()[name]) for name, tensor in got.items()
    }
    seconds["compare"] = time.perf_counter() - start
    return ProbeOutcome("ok", ran=ran, metrics=metrics, seconds=seconds)


def relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the quantity the bug reports measured between two implementations)."""
    return compare(a, b.to(torch.float64)).rel_err


def _grads(backend: Backend, q, k, v, dout, case: Case):
    out = backend.forward(q, k, v, case)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def run_tp_probe(backend: Backend, case: Case, tp: int, shards_as: str, cache: CaseCache) -> ProbeOutcome:
    """Split the heads into `tp` shards as Megatron's tensor parallelism does; run each as its own call
    (`shards_as` "views": head slices of the full tensors; "copies": contiguous copies), join the shards'
    outputs and gradients, and measure them against float64 and against the unsharded (TP=1) run."""
    device = cache.device
    why_not = tp_unsupported(case, tp) or backend.unsupported(case, device)
    if why_not:
        return ProbeOutcome("skip", reason=why_not)
    inputs, reference = cache.get(case)
    fmt = backend.qkv_format
    full = layouts.build("contiguous", inputs.q, inputs.k, inputs.v, fmt)
    dout = layouts.to_format(inputs.dout, fmt).contiguous()
    shard_case = tp_shard(case, tp)
    hq, hkv = shard_case.heads, shard_case.num_kv_heads
    start = time.perf_counter()
    try:
        unsharded = [t.detach() for t in _grads(backend, full.q, full.k, full.v, dout, case)]
        parts = []
        for shard in range(tp):
            q = full.q[:, :, shard * hq:(shard + 1) * hq]
            k = full.k[:, :, shard * hkv:(shard + 1) * hkv]
            v = full.v[:, :, shard * hkv:(shard + 1) * hkv]
            if shards_as == "copies":
                q, k, v = (t.contiguous() for t in (q, k, v))
            parts.append(_grads(backend, q, k, v, dout[:, :, shard * hq:(shard + 1) * hq].contiguous(), shard_case))
    except Unsupported as exc:
        return ProbeOutcome("skip", reason=str(exc))
    synchronize(device)
    seconds = {"reference": cache.reference_seconds, "kernel": time.perf_counter() - start}
    joined = [torch.cat([p[i].detach() for p in parts], dim=2) for i in range(4)]
    names = ("out", "dq", "dk", "dv")
    metrics = {
        name: compare(layouts.to_bshd(t, fmt), reference.tensors()[name]) for name, t in zip(names, joined)
    }
    extra = {
        f"{name}_vs_tp1": relative_distance(layouts.to_bshd(t, fmt), layouts.to_bshd(u, fmt))
        for name, t, u in zip(names, joined, unsharded)
    }
    return ProbeOutcome("ok", ran=backend.ran(parts[-1][0]), metrics=metrics, seconds=seconds, extra=extra)


class BackendAttention:
    """The backend as the core attention of a stack: sbhd in, sbhd out, whatever format it wants."""

    def __init__(self, backend: Backend, case: Case):
        self.backend, self.case = backend, case
        self.last_out: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.backend.qkv_format == "bshd":
            out = self.backend.forward(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), self.case)
            self.last_out = out
            return out.transpose(0, 1)
        self.last_out = self.backend.forward(q, k, v, self.case)
        return self.last_out


class DepthCache:
    """Per (case, layers): the float64 replica's dQ at every layer (the parent's shared copy when the job
    carries a handle, else computed here) and the local baseline's, computed here."""

    def __init__(self, device: torch.device):
        self.device = device
        self._key: tuple | None = None
        self.reference: list[torch.Tensor] = []
        self.baseline: list[torch.Tensor] = []
        self.reference_seconds = 0.0
        self.reference_source = ""
        self.shared: tuple[torch.Tensor, ...] | None = None  # the parent's per-layer dQ, mapped, if any

    def get(self, case: Case, layers: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        from attn_doctor.backends import BASELINE, BackendSpec, build
        from attn_doctor.probes.stack import float64_replica_dqs, make_stack, run_stack

        key = (case.key(), layers)
        if key != self._key:
            self.reference = self.baseline = []
            start = time.perf_counter()
            self.reference_source = "shared" if self.shared is not None else "computed"
            model_dtype = TORCH_DTYPES[case.dtype]
            if self.shared is not None:
                self.reference = list(self.shared)
            else:
                self.reference = float64_replica_dqs(case, layers, self.device, model_dtype)
            synchronize(self.device)
            self.reference_seconds = time.perf_counter() - start
            local = build(BackendSpec(BASELINE, "local"))
            self.baseline = run_stack(make_stack(case, layers, self.device, model_dtype), case, BackendAttention(local, case))
            self._key = key
            release_cached_memory(self.device)
        return self.reference, self.baseline

    def clear(self) -> None:
        self._key = None
        self.reference = self.baseline = []


def run_depth_probe(backend: Backend, case: Case, layers: int, tp: int, cache: DepthCache) -> ProbeOutcome:
    """dQ at every layer of an L-layer stack with `backend` as core attention (TP shards inside), against
    the float64 replica and against the local baseline's stack; metrics for the first and last layer."""
    from attn_doctor.probes.stack import make_stack, run_stack

    device = cache.device
    why_not = tp_unsupported(case, tp)
    if why_not:
        return ProbeOutcome("skip", reason=why_not)
    if case.seq_k != case.seq:
        return ProbeOutcome("skip", reason="the depth stack is self-attention: it needs seq_kv == seq")
    why_not = backend.unsupported(case, device)
    if why_not:
        return ProbeOutcome("skip", reason=why_not)
    reference, baseline = cache.get(case, layers)
    shard_case = tp_shard(case, tp)
    stack = make_stack(case, layers, device, TORCH_DTYPES[case.dtype])
    start = time.perf_counter()
    attention = BackendAttention(backend, shard_case)
    try:
        dqs = run_stack(stack, case, attention, tp=tp)
        unsharded = run_stack(stack, case, BackendAttention(backend, case)) if tp > 1 else None
    except Unsupported as exc:
        return ProbeOutcome("skip", reason=str(exc))
    synchronize(device)
    seconds = {"reference": cache.reference_seconds, "kernel": time.perf_counter() - start}
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
    return ProbeOutcome("ok", ran=backend.ran(attention.last_out), metrics={"dq_first": by_layer[0], "dq_last": by_layer[-1]},
                        seconds=seconds, extra=extra)
