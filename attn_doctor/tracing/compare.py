"""Comparing two captures of one model and seed run differently (TP=1 against TP=2, TE against `local`, one
TE version against another), layer by layer, as TTrace (arXiv 2506.09280) compares a distributed run with a
single-device one, with the threshold derived rather than guessed.

For every (step, layer) both captures have values of, each run's TP shards are put back together along the
heads (in tp_rank order) and its CP ranks' chunks along the sequence (`_cp_run_of`); packed (thd) calls are put
at their sequences' places in padded tensors, slot padding zeroed. For out, dQ, dK, dV (when the backward
recorded them):

    d     = ‖A − B‖ / ‖B‖                           how far the runs are apart
    e_A   = ‖A − exact(A's inputs)‖ / ‖exact(A)‖    run A's kernel error on its own inputs (float64 replay)
    e_B   likewise for run B
    e_in  = ‖exact(A's inputs) − exact(B's inputs)‖ / ‖exact(B)‖   what the inputs' own difference explains

By the triangle inequality d ≤ e_A + e_in + e_B (up to the norms' ratio): the observed difference is always the
inputs' difference carried by exact attention plus each kernel's own error. A difference that grows with depth
while every e_A, e_B stays at rounding level is rounding amplified upstream, not a fault ("same within
rounding"). A run whose own kernel error is far above the other run's on the same call (more than FACTOR
times, and above the dtype's rounding floor) is the one far from float64: the first layer where that happens
is where the runs diverge, and its shards name the rank. Two runs of one model and seed agree on the first
layer's inputs up to the rounding of what came before it; when exact attention on each run's inputs is already
far apart there (`Comparison.inputs_at_start`), the runs do not compute the same thing, whatever depth does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attn_doctor.core import layouts
from attn_doctor.core.case import Case
from attn_doctor.core.errors import BadInput
from attn_doctor.numerics.masks import valid_tokens
from attn_doctor.tracing.replay import as_bshd, case_of, native_format, with_heads
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
            if not math.isfinite(mine) and math.isfinite(other):  # NaN/Inf where float64 has none
                return run
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

    def inputs_at_start(self) -> tuple[LayerComparison, Measured] | None:
        """The first compared call when its forward inputs already differ beyond its kernels' rounding (exact
        attention on each run's inputs is more than FACTOR times their own errors apart): two runs of one model
        and seed agree there up to the rounding of what came before, so a difference there is not depth."""
        for layer in self.layers:
            out = next((m for m in layer.measured if m.tensor == "out"), None)
            if out is not None:
                return (layer, out) if out.e_in > FACTOR * max(*out.e, out.floor) else None
        return None

    @property
    def same(self) -> bool:
        return self.first_fault() is None and self.inputs_at_start() is None

    def answer(self) -> str:
        found = self.first_fault()
        compared = [layer for layer in self.layers if layer.measured]
        if found is None:
            worst = max(((m.d, layer, m) for layer in compared for m in layer.measured), key=lambda x: x[0])
            d, layer, m = worst
            explained = (f"the largest difference ({m.tensor} {d:.2g} at step {layer.step}, layer {layer.layer}) "
                         f"is explained by the inputs' own difference ({m.e_in:.2g}) and each kernel's rounding "
                         f"({m.e[0]:.2g}, {m.e[1]:.2g})")
            start = self.inputs_at_start()
            if start is not None:
                first, out = start
                return (f"no attention call is at fault, but the runs' inputs differ beyond rounding already at "
                        f"step {first.step}, layer {first.layer} (out {out.e_in:.2g} apart computed exactly on "
                        f"each run's inputs): the runs do not compute the same thing upstream; {explained}")
            return f"same within rounding: {len(compared)} layer calls compared; {explained}"
        layer, m = found
        run = m.faulty_run
        ranks = [rank for rank, e in m.shard_e[run]
                 if not math.isfinite(e) or e > FACTOR * max(m.e[1 - run], m.floor)]
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
    """A TP shard's tensors and its float64 replay (heads are independent, so a shard is a whole attention)."""
    from attn_doctor.numerics.inputs import make_semantics
    from attn_doctor.numerics.reference import attention_reference

    case = case_of(call, root)
    if isinstance(case, str):
        raise ValueError(case)
    raw = _raw(call, case)
    got = {name: raw[name] for name in TENSORS if name in raw}
    reference = attention_reference(raw["q"], raw["k"], raw["v"], raw["dout"], softmax_scale=case.softmax_scale,
                                    semantics=make_semantics(case, raw["q"].device), with_terms=False)
    exact = {name: getattr(reference, name) for name in got}
    return got, exact, torch.finfo(raw["q"].dtype).eps


def _parallel(call: CapturedCall, name: str, default: int = 0) -> int:
    return int(call.meta.get("parallel", {}).get(name, default))


def _raw(call: CapturedCall, case: Case | None = None) -> dict[str, torch.Tensor]:
    """A call's recorded tensors in bshd (q, k, v, out, dout, and dq, dk, dv when recorded; its boolean
    attn_mask as `mask` [b, 1, s, s_kv] when it had one). A packed (thd) call's tensors are put at their
    sequences' places in padded tensors (its `case` gives the packing), and every token outside a sequence is
    zeroed: what a kernel leaves in slot padding is not an output, and the runs need not agree on it."""
    fmt = native_format(call)
    packed = None
    if fmt == "thd":
        if case is None:
            raise ValueError("thd calls under context parallelism are not compared yet")
        packed = layouts.packing(case)
    values, dout = load_values(call.values_path), load_values(call.dout_path)["dout"]
    out, dout = (with_heads(t, values["q"]) for t in (values["out"], dout))
    sides = {"q": "q", "k": "kv", "v": "kv", "out": "q", "dout": "q", "dq": "q", "dk": "kv", "dv": "kv"}
    recorded = {"q": values["q"], "k": values["k"], "v": values["v"], "out": out, "dout": dout}
    raw = {name: as_bshd(t, fmt, packed, sides[name]) for name, t in recorded.items()}
    for name in ("dq", "dk", "dv"):
        gradient = call.gradient(name)
        if gradient is not None:
            raw[name] = as_bshd(gradient, fmt, packed, sides[name])
    if packed is not None:
        valid = dict(zip(("q", "kv"), valid_tokens(case, raw["q"].device)))
        raw = {name: t * valid[sides[name]][:, :, None, None].to(t.dtype) for name, t in raw.items()}
    if "arg.attn_mask" in values:
        mask = values["arg.attn_mask"]
        raw["mask"] = mask.reshape([1] * (4 - mask.dim()) + list(mask.shape))
    return raw


def _load_balanced(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """CP ranks' local tensors put back in sequence order: rank r holds chunks r and 2cp-1-r (the split
    Megatron and TE use so that every rank gets as much of a causal mask's work)."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)


def _cp_run_of(calls: list[CapturedCall], root: Path, cp: int) -> _Run:
    """A context-parallel run: TP shards joined along the heads per CP rank, then the CP ranks' chunks joined
    along the sequence (`_load_balanced`). Keys and values either come in chunks too (TE's p2p and a2a) or
    whole on every rank (all-gather), whose dK and dV are then each rank's share, summed. The float64 replay
    runs on the whole sequence: a CP rank's call alone is not a whole attention."""
    from attn_doctor.numerics.masks import Semantics
    from attn_doctor.numerics.reference import attention_reference

    ranks = sorted({_parallel(c, "cp_rank") for c in calls})
    if ranks != list(range(cp)):
        raise ValueError(f"CP ranks {ranks} of {cp} were captured with values; capture every rank's")
    per_rank = []
    for cp_rank in ranks:
        shards = sorted((c for c in calls if _parallel(c, "cp_rank") == cp_rank), key=lambda c: _parallel(c, "tp_rank"))
        raws = [_raw(c) for c in shards]
        joined = {n: torch.cat([r[n] for r in raws], dim=2) for n in raws[0] if n != "mask"}
        if "mask" in raws[0]:
            joined["mask"] = raws[0]["mask"]
        per_rank.append((shards, joined))
    local = per_rank[0][1]["q"].shape[1]
    whole = {n: _load_balanced([j[n] for _, j in per_rank], dim=1) for n in ("q", "out", "dout", "dq")
             if all(n in j for _, j in per_rank)}
    gathered = per_rank[0][1]["k"].shape[1] != local  # keys whole on every rank
    for n in ("k", "v", "dk", "dv"):
        if not all(n in j for _, j in per_rank):
            continue
        parts = [j[n] for _, j in per_rank]
        whole[n] = (parts[0] if n in ("k", "v") else sum(parts)) if gathered else _load_balanced(parts, dim=1)
    case = case_of(per_rank[0][0][0], root)
    if isinstance(case, str):
        raise ValueError(case)
    if case.bias != "no_bias" or ("mask" in per_rank[0][1] and per_rank[0][1]["mask"].dtype != torch.bool):
        raise ValueError("a bias (or float attn_mask) under context parallelism is not compared yet")
    seq, seq_kv = whole["q"].shape[1], whole["k"].shape[1]
    fields = {**case.to_dict(), "seq": seq, "seq_kv": seq_kv, "replay": None, "seqlens": None, "seqlens_kv": None}
    if "mask" in per_rank[0][1]:  # each rank's rows of the explicit mask, in sequence order
        fields.update(mask="arbitrary", mask_source="random:0")
        mask = _load_balanced([j["mask"].expand(-1, -1, local, -1) for _, j in per_rank], dim=2)
    from attn_doctor.core.case import make_case

    whole_case = make_case(**fields)
    semantics = Semantics(whole_case)
    if "mask" in per_rank[0][1]:
        semantics.allowed = mask.expand(whole_case.batch, 1, seq, seq_kv)
    reference = attention_reference(whole["q"], whole["k"], whole["v"], whole["dout"],
                                    softmax_scale=whole_case.softmax_scale, semantics=semantics, with_terms=False)
    names = [n for n in TENSORS if n in whole]
    got = {n: whole[n] for n in names}
    exact = {n: getattr(reference, n) for n in names}
    chunk = local // 2
    rows = {rank: torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                             torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]) for rank in ranks}
    firsts = [shards[0] for shards, _ in per_rank]
    labels = [_shard_label(first, firsts, "cp_rank") for first in firsts]
    shard_e = {}
    for n in names:  # each CP rank's own rows (keys too, when they come in chunks)
        if n in ("dk", "dv") and gathered:  # every rank's share summed: not one rank's
            shard_e[n] = [("every CP rank (summed)", _relative(got[n], exact[n]))]
            continue
        shard_e[n] = [(label, _relative(got[n].index_select(1, rows[rank]), exact[n].index_select(1, rows[rank])))
                      for label, rank in zip(labels, ranks)]
    return _Run(calls[0].meta["api"], got, exact, shard_e, torch.finfo(whole["q"].dtype).eps)


def _run_of(calls: list[CapturedCall], root: Path) -> _Run:
    cp = max(_parallel(c, "cp", 1) for c in calls)
    if cp > 1:
        return _cp_run_of(calls, root, cp)
    calls = sorted(calls, key=lambda c: (c.meta.get("parallel", {}).get("tp_rank", c.rank), c.rank))
    shards = [_shard_tensors(c, root) for c in calls]
    names = [n for n in TENSORS if all(n in got for got, _, _ in shards)]
    got = {n: torch.cat([g[n] for g, _, _ in shards], dim=2) for n in names}  # heads: bshd dim 2
    exact = {n: torch.cat([x[n] for _, x, _ in shards], dim=2) for n in names}
    shard_e = {n: [(_shard_label(c, calls), _relative(g[n], x[n])) for c, (g, x, _) in zip(calls, shards)]
               for n in names}
    return _Run(calls[0].meta["api"], got, exact, shard_e, shards[0][2])


def _shard_label(call: CapturedCall, calls: list[CapturedCall], within: str = "tp_rank") -> str:
    """The rank that ran a shard; with its TP (or CP) rank when one process ran several shards (a simulation)."""
    if sum(c.rank == call.rank for c in calls) == 1:
        return str(call.rank)
    return f"{call.rank} ({within} {call.meta.get('parallel', {}).get(within, '?')})"


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
