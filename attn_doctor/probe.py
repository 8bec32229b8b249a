"""One probe: build a case's inputs, run one backend on one layout, and measure it against float64.

This is what a worker process does for each job. Inputs and the reference are cached per case, so every
backend and layout of the family that uses the same inputs shares one reference computation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from attn_doctor import layouts
from attn_doctor.backends import Backend, Unsupported
from attn_doctor.case import Case
from attn_doctor.metrics import TensorMetrics, compare
from attn_doctor.reference import Reference, attention_reference

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


@dataclass
class ProbeOutcome:
    status: str  # "ok", "skip" or "error"
    ran: str = ""
    reason: str = ""
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "ran": self.ran,
            "reason": self.reason,
            "metrics": {name: m.to_dict() for name, m in self.metrics.items()},
            "seconds": self.seconds,
        }


class CaseCache:
    """Inputs and reference of the most recent case (jobs arrive grouped by case)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._key: tuple | None = None
        self._inputs: Inputs | None = None
        self._reference: Reference | None = None
        self.reference_seconds = 0.0

    def get(self, case: Case) -> tuple[Inputs, Reference]:
        if case.key() != self._key:
            self._inputs = self._reference = None  # free the previous case before building the next
            inputs = make_inputs(case, self.device)
            start = time.perf_counter()
            reference = attention_reference(
                inputs.q, inputs.k, inputs.v, inputs.dout,
                causal=case.causal, softmax_scale=case.softmax_scale, window=case.window,
            )
            synchronize(self.device)
            self.reference_seconds = time.perf_counter() - start
            self._key, self._inputs, self._reference = case.key(), inputs, reference
        return self._inputs, self._reference


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
