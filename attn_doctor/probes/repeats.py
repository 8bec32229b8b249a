"""A CALL probe run N times on the same inputs and views (`--repeats N`): per tensor, whether every repeat is
bitwise identical to the first, the spread (the largest relative L2 distance, in float64, between a repeat
and the first) and which repeat was the worst; the row's metrics are the worst repeat's, so the verdict is
on the worst repeat, never on a lucky one.

What a row's `extra["repeats"]` holds (only when N > 1: a single call adds nothing):

    {"n": 3,
     "identical": {"out": true, "dq": false, ...},     # every repeat bitwise equal to the first
     "spread": {"out": 0.0, "dq": 1.2e-07, ...},       # max over repeats of ||x_i - x_1|| / ||x_1||
     "worst": {"out": 0, "dq": 2, ...},                # the repeat (0-based) whose metrics the row carries
     "rel_err": {"out": [4.1e-3, 4.1e-3, 4.1e-3], ...}}  # each repeat's error against float64
"""

from __future__ import annotations

import torch

from attn_doctor.numerics.metrics import TensorMetrics, relative_distance

# Integer types of each element size: bitwise equality that also holds for NaN payloads and -0.0.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (any strides)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    bits = _BITS.get(a.element_size())
    if bits is None or a.is_complex():
        return torch.equal(a, b)
    return torch.equal(a.view(bits), b.view(bits))


def _badness(m: TensorMetrics) -> tuple:
    """How bad one repeat's tensor is: NaN/Inf first, then the error (against the terms' scale), then the worst
    head's."""
    return (m.nan + m.inf, m.scaled_err, m.worst_head_scaled_err)


class Repeats:
    """The repeats of one probe, fed one repeat at a time (`add`), holding only the first repeat's tensors."""

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"repeats must be a whole number >= 1, got {n!r}")
        self.n = n
        self.count = 0
        self._first: dict[str, torch.Tensor] = {}
        self.worst: dict[str, TensorMetrics] = {}
        self._worst_index: dict[str, int] = {}
        self._identical: dict[str, bool] = {}
        self._spread: dict[str, float] = {}
        self._errors: dict[str, list[float]] = {}

    def add(self, tensors: dict[str, torch.Tensor], metrics: dict[str, TensorMetrics]) -> None:
        """One repeat's tensors (bshd, detached) and their metrics against float64."""
        index = self.count
        self.count += 1
        for name, m in metrics.items():
            self._errors.setdefault(name, []).append(m.rel_err)
            if name not in self.worst or _badness(m) > _badness(self.worst[name]):
                self.worst[name], self._worst_index[name] = m, index
        if self.n == 1:
            return
        if index == 0:
            # A copy: a kernel that hands back the same buffer each call must not compare equal to itself.
            self._first = {name: t.clone() for name, t in tensors.items()}
            self._identical = {name: True for name in tensors}
            self._spread = {name: 0.0 for name in tensors}
            return
        for name, tensor in tensors.items():
            first = self._first[name]
            if bitwise_equal(tensor, first):
                continue
            self._identical[name] = False
            self._spread[name] = max(self._spread[name], relative_distance(tensor, first))

    def facts(self) -> dict:
        """The row's extra: {"repeats": {...}} when the probe ran more than once, else {}."""
        self._first = {}
        if self.n == 1:
            return {}
        return {"repeats": {"n": self.count, "identical": dict(self._identical), "spread": dict(self._spread),
                            "worst": dict(self._worst_index), "rel_err": dict(self._errors)}}
