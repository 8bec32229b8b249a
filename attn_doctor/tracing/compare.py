"""Comparing two captures of one model and seed run differently (TP=1 against TP=2, TE against `local`, one
TE version against another), layer by layer, as TTrace (arXiv 2506.09280) compares a distributed run with a
single-device one, with the threshold derived rather than guessed.

For every (step, layer) both captures have values of, each run's TP shards are put back together along the
heads (in tp_rank order), and for out, dQ, dK, dV (when the backward recorded them):

    d     = ‖A − B‖ / ‖B‖                           how far the runs are apart
    e_A   = ‖A − exact(A's inputs)‖ / ‖exact(A)‖    run A's kernel error on its own inputs (float64 replay)
    e_B   likewise for run B
    e_in  = ‖exact(A's inputs) − exact(B's inputs)‖ / ‖exact(B)‖   what the inputs' own difference explains

By the triangle inequality d ≤ e_A + e_in + e_B (up to the norms' ratio): the observed difference is always the
inputs' difference carried by exact attention plus each kernel's own error. A difference that grows with depth
while every e_A, e_B stays at rounding level is rounding amplified upstream, not a fault ("same within
rounding"). A run whose own kernel error is far above the other run's on the same call (more than FACTOR
times, and above the dtype's rounding floor) is the one far from float64: the first layer where that happens
is where the runs diverge, and its shards name the rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from attn_doctor.core.errors import BadInput
from attn_doctor.tracing.replay import _to_bshd, case_of, native_format, with_heads
from attn_doctor.tracing.store import CapturedCall, load_values, read_capture

TENSORS = ("out", "dq", "dk", "dv")
FACTOR = 3.0  # a kernel error this many times the other run's (and above the floor) is a fault
FLOOR_EPS = 0.5  # the rounding floor of a kernel error, in units of the dtype's machine epsilon


@dataclass
class Measured:
    """One tensor of one (step, layer) in both runs."""

    tensor: str
    d: float
    e_in: float
    e: tuple[float, float]  # (run A, run B)
    shard_e: tuple[list[tuple[str, float]], list[tuple[str, float]]]  # per run: (rank, error) per shard
    floor: float

    @property
    def faulty_run(self) -> int | None:
        """0 or 1 when that run's kernel is far from float64 and the other's is not; None otherwise."""
        for run in (0, 1):
            mine, other = self.e[run], self.e[1 - run]
            if mine > FACTOR * max(other, self.floor):
                return run
        return None


@dataclass
class LayerComparison:
    step: int
    layer: int
    apis: tuple[str, str]
    measured: list[Measured] = field(default_factory=list)
    rank_apis: tuple[dict[int, str], dict[int, str]] = ({}, {})  # per run, the API each rank called
    skipped: str = ""


@dataclass
class Comparison:
    labels: tuple[str, str]
    layers: list[LayerComparison]

    def first_fault(self) -> tuple[LayerComparison, Measured] | None:
        for layer in self.layers:
            for measured in layer.measured:
                if measured.faulty_run is not None:
                    return layer, measured
        return None

    @property
    def same(self) -> bool:
        return self.first_fault() is None

    def answer(self) -> str:
        found = self.first_fault()
        compared = [layer for layer in self.layers if layer.measured]
        if found is None:
            worst = max(((m.d, layer, m) for layer in compared for m in layer.measured), key=lambda x: x[0])
            d, layer, m = worst
            return (f"same within rounding: {len(compared)} layer calls compared; the largest difference "
                    f"({m.tensor} {d:.2g} at step {layer.step}, layer {layer.layer}) is explained by the inputs' "
                    f"own difference ({m.e_in:.2g}) and each kernel's rounding ({m.e[0]:.2g}, {m.e[1]:.2g})")
        layer, m = found
        run = m.faulty_run
        ranks = [rank for rank, e in m.shard_e[run] if e > FACTOR * max(m.e[1 - run], m.floor)]
        api = layer.rank_apis[run].get(int(ranks[0].split()[0]), layer.apis[run]) if ranks else layer.apis[run]
        return (f"differs from layer {layer.layer} (step {layer.step}) on: {api}, {m.tensor} "
                f"(runs {m.d:.2g} apart); {self.labels[run]} is the one far from float64 "
                f"(its error {m.e[run]:.2g} against {m.e[1 - run]:.2g}) on rank{'s' * (len(ranks) > 1)} "
                f"{', '.join(map(str, ranks))}")


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


@dataclass
class _Run:
    """One run's tensors of one (step, layer), shards put back together (bshd), with its float64 replay."""

    api: str
    got: dict[str, torch.Tensor]
    exact: dict[str, torch.Tensor]
    shard_e: dict[str, list[tuple[str, float]]]
    eps: float


def _shard_tensors(call: CapturedCall, root: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    from attn_doctor.numerics.inputs import make_semantics
    from attn_doctor.numerics.reference import attention_reference

    case = case_of(call, root)
    if isinstance(case, str):
        raise ValueError(case)
    fmt = native_format(call)
    if fmt == "thd":
        raise ValueError("thd calls are not compared yet")
    values, dout = load_values(call.values_path), load_values(call.dout_path)["dout"]
    out, dout = (with_heads(t, values["q"]) for t in (values["out"], dout))
    q, k, v, out, dout = (_to_bshd(t, fmt) for t in (values["q"], values["k"], values["v"], out, dout))
    got = {"out": out}
    for name in ("dq", "dk", "dv"):
        gradient = call.gradient(name)
        if gradient is not None:
            got[name] = _to_bshd(gradient, fmt)
    reference = attention_reference(q, k, v, dout, softmax_scale=case.softmax_scale,
                                    semantics=make_semantics(case, q.device), with_terms=False)
    exact = {name: getattr(reference, name) for name in got}
    return got, exact, torch.finfo(q.dtype).eps


def _run_of(calls: list[CapturedCall], root: Path) -> _Run:
    calls = sorted(calls, key=lambda c: (c.meta.get("parallel", {}).get("tp_rank", c.rank), c.rank))
    shards = [_shard_tensors(c, root) for c in calls]
    names = [n for n in TENSORS if all(n in got for got, _, _ in shards)]
    got = {n: torch.cat([g[n] for g, _, _ in shards], dim=2) for n in names}  # heads: bshd dim 2
    exact = {n: torch.cat([x[n] for _, x, _ in shards], dim=2) for n in names}
    shard_e = {n: [(_shard_label(c, calls), _relative(g[n], x[n])) for c, (g, x, _) in zip(calls, shards)]
               for n in names}
    return _Run(calls[0].meta["api"], got, exact, shard_e, shards[0][2])


def _shard_label(call: CapturedCall, calls: list[CapturedCall]) -> str:
    """The rank that ran a shard; with its TP rank when one process ran several shards (a TP simulation)."""
    if sum(c.rank == call.rank for c in calls) == 1:
        return str(call.rank)
    return f"{call.rank} (tp_rank {call.meta.get('parallel', {}).get('tp_rank', '?')})"


def _values_by_layer(root: Path) -> dict[tuple[int, int], list[CapturedCall]]:
    groups: dict[tuple[int, int], list[CapturedCall]] = {}
    for call in read_capture(root):
        if call.values_path is not None and call.dout_path is not None:
            groups.setdefault((call.meta["step"], call.meta["layer"]), []).append(call)
    return groups


def compare_captures(root_a: Path, root_b: Path, labels: tuple[str, str] | None = None) -> Comparison:
    """Layer by layer, the calls both captures have values of (see the module docstring)."""
    a, b = _values_by_layer(root_a), _values_by_layer(root_b)
    common = sorted(set(a) & set(b))
    if not common:
        raise BadInput(f"{root_a} and {root_b} have no (step, layer) with values in both; capture both with "
                       "--values and the same --layers/--steps")
    layers = []
    for step, layer in common:
        entry = LayerComparison(step, layer, (a[step, layer][0].meta["api"], b[step, layer][0].meta["api"]))
        try:
            run_a, run_b = _run_of(a[step, layer], root_a), _run_of(b[step, layer], root_b)
        except ValueError as exc:
            entry.skipped = str(exc)
            layers.append(entry)
            continue
        entry.rank_apis = tuple({c.rank: c.meta["api"] for c in calls} for calls in (a[step, layer], b[step, layer]))
        for name in [n for n in TENSORS if n in run_a.got and n in run_b.got]:
            if run_a.got[name].shape != run_b.got[name].shape:
                entry.skipped = (f"{name} has shape {tuple(run_a.got[name].shape)} in one run and "
                                 f"{tuple(run_b.got[name].shape)} in the other")
                break
            entry.measured.append(Measured(
                name, _relative(run_a.got[name], run_b.got[name]), _relative(run_a.exact[name], run_b.exact[name]),
                (_relative(run_a.got[name], run_a.exact[name]), _relative(run_b.got[name], run_b.exact[name])),
                (run_a.shard_e[name], run_b.shard_e[name]), FLOOR_EPS * max(run_a.eps, run_b.eps)))
        layers.append(entry)
    return Comparison(labels or (str(root_a), str(root_b)), layers)
