"""Comparing two captures of one model and seed run differently (TP=1 against TP=2, TE against `local`, one
TE version against another), layer by layer, as TTrace (arXiv 2506.09280) compares a distributed run with a
single-device one, with the threshold derived rather than guessed.

First, whether the two runs are the same model, data and settings at all (`attn_doctor.tracing.upstream`:
the weights' fingerprints, the token ids' hash, dropout, the softmax scale): while they differ there, no
attention kernel is named (`Comparison.judges_kernels`), since a kernel is judged against the other run's on
the same inputs.

For every (step, layer) both captures have values of, each run's TP shards are put back together along the
heads (in tp_rank order) and its CP ranks' chunks along the sequence (`_cp_run_of`); packed (thd) calls are put
at their sequences' places in padded tensors, slot padding zeroed, a CP rank's packed tokens first put back at
their places in the whole packed tensors (TE's split of every sequence, `_cp_token_places`). For out, dQ, dK,
dV (when the backward recorded them):

    d     = ‖A − B‖ / ‖B‖                           how far the runs are apart
    e_A   = ‖A − exact(A's inputs)‖ / ‖exact(A)‖    run A's kernel error on its own inputs (float64 replay)
    e_B   likewise for run B
    e_in  = ‖exact(A's inputs) − exact(B's inputs)‖ / ‖exact(B)‖   what the inputs' own difference explains

By the triangle inequality d ≤ e_A + e_in + e_B (up to the norms' ratio): the observed difference is always the
inputs' difference carried by exact attention plus each kernel's own error. A difference that grows with depth
while every e_A, e_B stays at rounding level is rounding amplified upstream, not a fault ("same within
rounding"). A run whose own kernel error is far above what a correct kernel gets on the same call (more than
FACTOR times the other run's error, the dtype's rounding floor, and what a flash-style backward makes on
that run's inputs) is the one far from float64: the first layer where that happens is where the runs
diverge, and its shards name the rank.

Why the flash-style part: an unfused backward (Megatron's local) takes the softmax backward's D from the
probabilities it differentiates, a flash-style one (TE's fused and flash paths, PyTorch's SDPA kernels) from
the output it returned, rounded; where keys share a large common direction, as deep layers' keys do, that
alone makes the flash-style dQ several times less accurate (`attn_doctor.numerics.rounded_output`). On the
H200, TE's dQ on a Megatron GPT's 4th layer was 5.6x local's error from float64, as were PyTorch's flash,
efficient and cuDNN kernels on the same inputs (reports/h200/megatron/run-1): a ratio to the other run alone
called every correct flash-style kernel there a fault. Two runs of one model and seed agree on the first
layer's inputs up to the rounding of what came before it; when exact attention on each run's inputs is already
far apart there (`Comparison.inputs_at_start`), the runs do not compute the same thing, whatever depth does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from attn_doctor.core import layouts
from attn_doctor.core.case import Case
from attn_doctor.core.errors import BadInput
from attn_doctor.numerics.masks import Semantics, valid_tokens
from attn_doctor.tracing.replay_case import case_of, native_format
from attn_doctor.tracing.replay_source import CAPTURED_SOURCE, as_bshd, captured_packing, with_heads
from attn_doctor.tracing.store import CapturedCall, load_values, read_capture
from attn_doctor.tracing.upstream import Upstream, check_upstream

TENSORS = ("out", "dq", "dk", "dv")
INPUTS = ("q", "k", "v")
FACTOR = 3.0  # a kernel error this many times the other run's (and above the floor) is a fault
FLOOR_EPS = 0.5  # the rounding floor of a kernel error, in units of the dtype's machine epsilon
SIDES = {"q": "q", "k": "kv", "v": "kv", "out": "q", "dout": "q", "dq": "q", "dk": "kv", "dv": "kv"}  # whose tokens


@dataclass
class Measured:
    """One tensor of one (step, layer) in both runs."""

    tensor: str
    d: float
    e_in: float
    e: tuple[float, float]  # (run A, run B)
    shard_e: tuple[list[tuple[str, float]], list[tuple[str, float]]]  # per run: (rank, error) per shard
    floor: float
    # Per run, the error a flash-style backward makes on that run's inputs by taking D from the output it returned
    # (`attn_doctor.numerics.rounded_output`; 0 for out and dV, which do not use D).
    flash_e: tuple[float, float] = (0.0, 0.0)

    def allowed(self, run: int) -> float:
        """The largest error of run `run`'s kernel that is not a fault: FACTOR times what a correct kernel gets on
        its inputs (the other run's error, a flash-style backward's own, the dtype's rounding floor)."""
        return FACTOR * max(self.e[1 - run], self.flash_e[run], self.floor)

    def far(self, error: float, run: int) -> bool:
        """Whether an error of run `run`'s kernel (the whole tensor's or one shard's) is far from float64 where
        the other run's is not: NaN/Inf where the other has none, or above what is `allowed`."""
        other = self.e[1 - run]
        return (not math.isfinite(error) and math.isfinite(other)) or error > self.allowed(run)

    @property
    def flash_run(self) -> int | None:
        """0 or 1 when that run's error is more than FACTOR times the other's (and the floor) but within what a
        flash-style backward makes on its inputs: correct, and worth saying why."""
        return next((run for run in (0, 1) if FACTOR * max(self.e[1 - run], self.floor) < self.e[run]
                     and not self.far(self.e[run], run)), None)

    @property
    def faulty_run(self) -> int | None:
        """0 or 1 when that run's kernel is far from float64 and the other's is not; None otherwise."""
        return next((run for run in (0, 1) if self.far(self.e[run], run)), None)


@dataclass
class LayerComparison:
    step: int
    layer: int
    apis: tuple[str, str]
    measured: list[Measured] = field(default_factory=list)
    rank_apis: tuple[dict[int, str], dict[int, str]] = ({}, {})  # per run, the API each rank called
    skipped: str = ""
    inputs_apart: dict[str, float] = field(default_factory=dict)  # q, k, v: how far the runs' are apart
    eps: float = 0.0  # the inputs' machine epsilon (the coarser run's)
    layer_numbers: tuple[int | None, int | None] = (None, None)  # per run, the layer number its framework gave

    @property
    def inputs_distance(self) -> float:
        """How far apart the runs' q, k, v are (the farthest of the three)."""
        return max(self.inputs_apart.values(), default=0.0)

    @property
    def name(self) -> str:
        """The layer as a sentence names it: its place, and the layer number the framework gave it."""
        numbers = {n for n in self.layer_numbers if n is not None}
        given = f" (layer_number {numbers.pop()})" if len(numbers) == 1 else ""
        return f"layer {self.layer}{given}"


@dataclass
class Comparison:
    labels: tuple[str, str]
    layers: list[LayerComparison]
    upstream: Upstream = field(default_factory=Upstream)  # weights, data, dropout, settings: read first

    @property
    def judges_kernels(self) -> bool:
        """Whether a run's attention may be named far from float64: only when the runs are the same model, data
        and settings (`attn_doctor.tracing.upstream`): a kernel's error is judged against the other run's."""
        return not self.upstream.differs

    def far_run(self, measured: Measured) -> int | None:
        """The run (0 or 1) whose attention is named far from float64 on this tensor: none while the runs differ
        upstream (`judges_kernels`)."""
        return measured.faulty_run if self.judges_kernels else None

    def first_fault(self) -> tuple[LayerComparison, Measured] | None:
        for layer in self.layers:
            for measured in layer.measured:
                if self.far_run(measured) is not None:
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
        return self.judges_kernels and self.first_fault() is None and self.inputs_at_start() is None

    def answer(self) -> str:
        if not self.judges_kernels:
            return (f"not the same run: they differ upstream of attention ({', '.join(self.upstream.differing)}, "
                    "said above), so no attention kernel is judged; make them the same and compare again")
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
        ranks = [rank for rank, e in m.shard_e[run] if m.far(e, run)]
        api = layer.rank_apis[run].get(int(ranks[0].split()[0]), layer.apis[run]) if ranks else layer.apis[run]
        return (f"differs from {layer.name} (step {layer.step}) on: {api}, {m.tensor} "
                f"(runs {m.d:.2g} apart); {self.labels[run]} is the one far from float64 "
                f"(its error {m.e[run]:.2g} against {m.e[1 - run]:.2g}) on rank{'s' * (len(ranks) > 1)} "
                f"{', '.join(map(str, ranks))}")

    def account(self) -> list[str]:
        """The answer's three questions, in words: did the runs' attention get the same q, k, v (if not, from
        which layer on do they differ, and by how much: the difference is upstream of attention); is each run's
        attention right on its own inputs (float64); and, when it is, is the difference between the runs what
        their inputs' difference explains."""
        compared = [layer for layer in self.layers if layer.measured]
        if not compared:
            return []
        found = self.first_fault()
        first = next((layer for layer in compared if layer.inputs_distance > 0), None)
        if first is None:
            inputs = f"q, k, v: bitwise the same in both runs at all {len(compared)} compared layer calls"
        else:
            widest = max(compared, key=lambda layer: layer.inputs_distance)
            parts = ", ".join(f"{n} {first.inputs_apart[n]:.2g}" for n in INPUTS if n in first.inputs_apart)
            before = compared.index(first)
            since = (f"bitwise the same up to {compared[before - 1].name}, apart from {first.name} on" if before
                     else f"apart from the first compared call ({first.name}) on")
            growth = (f"; the most {widest.inputs_distance:.2g} apart at {widest.name}" if widest is not first else "")
            if self.inputs_at_start() is not None:
                why = ("beyond what rounding explains already at the first compared call: the runs differ upstream "
                       "of attention")
            elif found is not None and compared.index(found[0]) < before:
                why = (f"what {self.labels[found[1].faulty_run]}'s wrong attention at {found[0].name} passed on to "
                       "the layers after it")
            else:
                why = "the rounding of what comes before attention, carried through the layers"
            inputs = (f"q, k, v: {since} ({parts}, {first.inputs_distance / first.eps:.2g} eps){growth}: {why}")
        errors = [e for layer in compared for m in layer.measured for e in m.e]
        if not self.judges_kernels:
            return [inputs, "attention on its own inputs: not judged between runs that differ upstream (`attn-doctor "
                            "replay` judges each capture's calls on their own)"]
        if found is None:
            kernels = (f"attention on its own inputs: right in both runs (float64 errors at most "
                       f"{max(errors):.2g}, as a correct kernel rounds)")
            flash = [(layer, m) for layer in compared for m in layer.measured if m.flash_run is not None]
            if flash:
                layer, m = max(flash, key=lambda pair: pair[1].e[pair[1].flash_run])
                run = m.flash_run
                kernels += (f"; {self.labels[run]}'s {m.tensor} is up to {m.e[run] / m.e[1 - run]:.1f}x the other's "
                            f"({m.e[run]:.2g} at {layer.name}), which a flash-style backward makes on these inputs: "
                            f"its D, taken from the output it returned, alone moves {m.tensor} by {m.flash_e[run]:.2g}")
            worst = max(((m.d, layer, m) for layer in compared for m in layer.measured), key=lambda x: x[0])
            d, layer, m = worst
            largest = max(range(2), key=lambda run: m.e[run])
            mostly = ("their inputs' difference" if m.e_in >= m.e[largest] else
                      f"{self.labels[largest]}'s kernel rounding")
            explained = (f"the runs' difference: what their inputs' difference and each kernel's rounding explain, "
                         f"mostly {mostly} ({m.tensor} {d:.2g} apart at {layer.name}; exact attention on each run's "
                         f"inputs {m.e_in:.2g} apart, the kernels {m.e[0]:.2g} and {m.e[1]:.2g} from float64)")
            return [inputs, kernels, explained]
        layer, m = found
        return [inputs, f"attention on its own inputs: {self.labels[m.faulty_run]} is wrong from {layer.name} on "
                        f"({m.tensor} {m.e[m.faulty_run]:.2g} from float64, the other run {m.e[1 - m.faulty_run]:.2g})"]


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
    inputs: dict[str, torch.Tensor]  # the q, k, v the run's attention got


def _shard_tensors(call: CapturedCall, root: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], float]:
    """A TP shard's tensors and its float64 replay (heads are independent, so a shard is a whole attention),
    with what a flash-style backward's D moves dQ and dK by (`_exact`)."""
    from attn_doctor.numerics.inputs import make_semantics

    case = case_of(call, root)
    if isinstance(case, str):
        raise ValueError(case)
    raw = _raw(call, case)
    got = {name: raw[name] for name in (*INPUTS, *TENSORS) if name in raw}
    exact = _exact(raw, case.softmax_scale, make_semantics(case, raw["q"].device, CAPTURED_SOURCE),
                   [name for name in TENSORS if name in got])
    return got, exact, torch.finfo(raw["q"].dtype).eps


def _exact(raw: dict[str, torch.Tensor], softmax_scale: float, semantics: Semantics,
           names: list[str]) -> dict[str, torch.Tensor]:
    """Float64 attention on a run's own inputs: `names` of out, dq, dk, dv, and as `flash.dq`, `flash.dk` how
    far a flash-style backward's D, taken from the output the run returned, moves them
    (`attn_doctor.numerics.rounded_output`): what a correct kernel of that kind gets on top of the rest."""
    from attn_doctor.numerics.reference import attention_reference
    from attn_doctor.numerics.rounded_output import output_rounding_gradients

    reference = attention_reference(raw["q"], raw["k"], raw["v"], raw["dout"], softmax_scale=softmax_scale,
                                    semantics=semantics, with_terms=False)
    exact = {name: getattr(reference, name) for name in names}
    if "dq" in names or "dk" in names:
        moved = output_rounding_gradients(raw["q"], raw["k"], raw["dout"], reference.out, raw["out"],
                                          softmax_scale=softmax_scale, semantics=semantics)
        exact.update({f"flash.{name}": moved[name] for name in ("dq", "dk") if name in names})
    return exact


def _parallel(call: CapturedCall, name: str, default: int = 0) -> int:
    return int(call.meta.get("parallel", {}).get(name, default))


def _raw(call: CapturedCall, case: Case | None = None, cp_share: tuple[int, int] | None = None
         ) -> dict[str, torch.Tensor]:
    """A call's recorded tensors in bshd (q, k, v, out, dout, and dq, dk, dv when recorded; its boolean
    attn_mask as `mask` [b, 1, s, s_kv] when it had one). A packed (thd) call's tensors are put at their
    sequences' places in padded tensors (its `case` gives the packing), and every token outside a sequence is
    zeroed: what a kernel leaves in slot padding is not an output, and the runs need not agree on it. With
    `cp_share` (cp, cp_rank) the packed call is that CP rank's share of the whole call `case` describes: its
    tokens go to their places in the whole (`_cp_token_places`), every other token is zero."""
    fmt = native_format(call)
    packed = captured_packing(case) if fmt == "thd" else None
    values, dout = load_values(call.values_path), load_values(call.dout_path)["dout"]
    out, dout = (with_heads(t, values["q"]) for t in (values["out"], dout))
    recorded = {"q": values["q"], "k": values["k"], "v": values["v"], "out": out, "dout": dout}
    for name in ("dq", "dk", "dv"):
        gradient = call.gradient(name)
        if gradient is not None:
            recorded[name] = gradient
    if packed is not None and cp_share is not None:
        recorded = {name: _in_whole_packed(t, packed, SIDES[name], *cp_share, name) for name, t in recorded.items()}
    raw = {name: as_bshd(t, fmt, packed, SIDES[name]) for name, t in recorded.items()}
    if packed is not None:
        valid = dict(zip(("q", "kv"), valid_tokens(case, raw["q"].device)))
        raw = {name: t * valid[SIDES[name]][:, :, None, None].to(t.dtype) for name, t in raw.items()}
    if "arg.attn_mask" in values:
        mask = values["arg.attn_mask"]
        raw["mask"] = mask.reshape([1] * (4 - mask.dim()) + list(mask.shape))
    return raw


def _cp_token_places(slots: tuple[int, ...], cp: int, cp_rank: int) -> torch.Tensor:
    """Where CP rank `cp_rank`'s tokens are in the whole tensor, in the order the rank holds them: of every
    sequence slot (one after the other, as in a packed tensor; a bshd sequence is one slot), cut in 2*cp equal
    chunks, chunk cp_rank then chunk 2*cp-1-cp_rank (so every rank gets as much of a causal mask's work).

    This is TE's split for bshd/sbhd and for packed (thd) calls alike (TransformerEngine d0067d0):
    - thd: each sequence is split on its padded slot (cu_seqlens_*_padded), not on its length: the kernel
      behind tex.thd_get_partitioned_indices maps local token i of a sequence with local slot L to
      i + rank * L/2 of the sequence when i < L/2, else to i + (2*cp-2-rank) * L/2
      (transformer_engine/common/fused_attn/context_parallel.cu:82-90), as Megatron-style
      get_batch_on_this_cp_rank slices [r*c, (r+1)*c) and [(2cp-1-r)*c, (2cp-r)*c) of every padded sequence
      (transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py:5322-5339), and TE's CP
      test splits a thd batch so (tests/pytorch/attention/run_attention_with_cp.py:470-477). A rank's padded
      tokens are those of its two chunks past the sequence's length (`get_cu_seqlens_on_cp_rank`,
      context_parallel.py:210-232): a chunk can be all padding.
    - A rank's call gets the whole batch's cu_seqlens_q/_kv, cu_seqlens_*_padded and max_seqlen_*, not its own:
      TE's test passes the global ones to every rank (run_attention_with_cp.py:535-542, the local ones are made
      only to compare, :635-648), and AttnFuncWithCPAndKVP2P divides them by cp itself
      (context_parallel.py:1446-1450); its q, k and v hold 1/cp of the padded tokens. Keys and values come in
      the same split with every cp_comm_type (all-gather reorders them to sequence order inside,
      context_parallel.py:3217-3223).
    - TE requires every padded sequence to divide by 2*cp (context_parallel.cu:100-103, the note in
      dot_product_attention/utils.py:1168) and, for thd, cu_seqlens_*_padded (context_parallel.py:5050-5052;
      FusedAttention otherwise takes cu_seqlens as the padded ones, backends.py:2207-2210)."""
    if any(slot % (2 * cp) for slot in slots):
        raise ValueError(f"sequence slots {list(slots)} that do not all divide by 2 x CP size ({2 * cp}), as TE's "
                         "context parallelism requires")
    places, start = [], 0
    for slot in slots:
        chunk = slot // (2 * cp)
        for index in (cp_rank, 2 * cp - 1 - cp_rank):
            places.append(torch.arange(start + index * chunk, start + (index + 1) * chunk))
        start += slot
    return torch.cat(places) if places else torch.zeros(0, dtype=torch.long)


def _in_whole_packed(t: torch.Tensor, packed: layouts.Packing, side: str, cp: int, cp_rank: int,
                     name: str) -> torch.Tensor:
    """A CP rank's packed tensor put at its places in the whole packed tensor, zeros at the other ranks'."""
    slots = packed.slots_q if side == "q" else packed.slots_kv
    places = _cp_token_places(slots, cp, cp_rank)
    if t.shape[0] != len(places):
        raise ValueError(f"CP rank {cp_rank}'s {name} holds {t.shape[0]} tokens; its share of the sequence slots "
                         f"{list(slots)} is {len(places)}")
    return t.new_zeros(sum(slots), *t.shape[1:]).index_copy_(0, places.to(t.device), t)


def _whole_packed_case(call: CapturedCall, root: Path, cp: int) -> Case:
    """The whole packed call a CP rank's thd call is a share of: the call's own arguments (TE gives every rank
    the whole batch's cu_seqlens, `_cp_token_places`) with cp times its tokens."""
    if call.meta["api"] != "te.DotProductAttention":
        raise ValueError(f"thd calls of {call.meta['api']} under context parallelism are not compared (TE's "
                         "DotProductAttention's split of the sequences is the one known)")
    tensors = {name: {**t, "shape": [t["shape"][0] * cp, *t["shape"][1:]]} if name in ("q", "k", "v") else t
               for name, t in call.meta["tensors"].items()}
    case = case_of(dataclasses.replace(call, meta={**call.meta, "tensors": tensors}), root)
    if isinstance(case, str):
        raise ValueError(case)
    return case


def _load_balanced(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """CP ranks' local tensors (in cp_rank order) put back in sequence order (`_cp_token_places`)."""
    cp, seq = len(parts), sum(part.shape[dim] for part in parts)
    places = torch.cat([_cp_token_places((seq,), cp, rank) for rank in range(cp)])
    return torch.cat(parts, dim=dim).index_select(dim, torch.argsort(places).to(parts[0].device))


def _cp_run_of(calls: list[CapturedCall], root: Path, cp: int) -> _Run:
    """A context-parallel run: TP shards joined along the heads per CP rank, then the CP ranks' chunks joined
    along the sequence (`_load_balanced`; a packed call's per sequence, `_cp_token_places`). Keys and values
    either come in chunks too (TE's p2p and a2a; every packed call) or whole on every rank (all-gather), whose
    dK and dV are then each rank's share, summed. The float64 replay runs on the whole sequence: a CP rank's
    call alone is not a whole attention."""
    from attn_doctor.numerics.masks import Semantics

    ranks = sorted({_parallel(c, "cp_rank") for c in calls})
    if ranks != list(range(cp)):
        raise ValueError(f"CP ranks {ranks} of {cp} were captured with values; capture every rank's")
    first = min(calls, key=lambda c: (_parallel(c, "cp_rank"), _parallel(c, "tp_rank")))
    packed_case = _whole_packed_case(first, root, cp) if native_format(first) == "thd" else None
    per_rank = []
    for cp_rank in ranks:
        shards = sorted((c for c in calls if _parallel(c, "cp_rank") == cp_rank), key=lambda c: _parallel(c, "tp_rank"))
        raws = [_raw(c, packed_case, (cp, cp_rank)) for c in shards]
        joined = {n: torch.cat([r[n] for r in raws], dim=2) for n in raws[0] if n != "mask"}
        if "mask" in raws[0]:
            joined["mask"] = raws[0]["mask"]
        per_rank.append((shards, joined))
    case = packed_case or case_of(first, root)
    if isinstance(case, str):
        raise ValueError(case)
    if (case.bias != "no_bias" or case.softmax != "vanilla"
            or ("mask" in per_rank[0][1] and per_rank[0][1]["mask"].dtype != torch.bool)):
        raise ValueError("a bias, a float attn_mask or a softmax sink under context parallelism is not compared yet")
    present = [n for n in ("q", "k", "v", "out", "dout", "dq", "dk", "dv") if all(n in j for _, j in per_rank)]
    local = per_rank[0][1]["q"].shape[1]
    gathered = packed_case is None and per_rank[0][1]["k"].shape[1] != local  # keys whole on every rank
    if packed_case is not None:  # every rank's tokens at their places already, zeros at the others'
        whole = {n: sum(j[n] for _, j in per_rank) for n in present}
    else:
        whole = {n: _load_balanced([j[n] for _, j in per_rank], dim=1) for n in present
                 if not (gathered and n in ("k", "v", "dk", "dv"))}
        if gathered:
            whole.update({n: per_rank[0][1][n] for n in ("k", "v") if n in present})
            whole.update({n: sum(j[n] for _, j in per_rank) for n in ("dk", "dv") if n in present})
    seq, seq_kv = whole["q"].shape[1], whole["k"].shape[1]
    if packed_case is not None:
        whole_case = packed_case
    else:
        from attn_doctor.core.case import make_case

        fields = {**case.to_dict(), "seq": seq, "seq_kv": seq_kv, "replay": None, "seqlens": None,
                  "seqlens_kv": None}
        if "mask" in per_rank[0][1]:
            fields.update(mask="arbitrary", mask_source="random:0")
        whole_case = make_case(**fields)
    semantics = Semantics(whole_case)
    if "mask" in per_rank[0][1]:  # each rank's rows of the explicit mask, in sequence order
        mask = _load_balanced([j["mask"].expand(-1, -1, local, -1) for _, j in per_rank], dim=2)
        semantics.allowed = mask.expand(whole_case.batch, 1, seq, seq_kv)
    names = [n for n in TENSORS if n in whole]
    got = {n: whole[n] for n in names}
    exact = _exact(whole, whole_case.softmax_scale, semantics, names)
    firsts = [shards[0] for shards, _ in per_rank]
    labels = [_shard_label(first, firsts, "cp_rank") for first in firsts]
    owned = {rank: _cp_rank_tokens(packed_case, (seq, seq_kv), cp, rank,
                                   whole["q"].device) for rank in ranks}
    shard_e = {}
    for n in names:  # each CP rank's own tokens (keys too, when they come in chunks)
        if n in ("dk", "dv") and gathered:  # every rank's share summed: not one rank's
            shard_e[n] = [("every CP rank (summed)", _relative(got[n], exact[n]))]
            continue
        mine = {rank: owned[rank][SIDES[n]].expand(got[n].shape[:2]) for rank in ranks}
        shard_e[n] = [(label, _relative(got[n][mine[rank]], exact[n][mine[rank]]))
                      for label, rank in zip(labels, ranks)]
    return _Run(calls[0].meta["api"], got, exact, shard_e, torch.finfo(whole["q"].dtype).eps,
                {n: whole[n] for n in INPUTS})


def _cp_rank_tokens(packed_case: Case | None, seqs: tuple[int, int], cp: int, cp_rank: int,
                    device: torch.device) -> dict[str, torch.Tensor]:
    """Boolean [batch or 1, seq] per side (q, kv) of the whole bshd tensors: the tokens CP rank `cp_rank`
    computed (`_cp_token_places`); of a packed call those in its sequences only (the slot padding is zeroed)."""
    if packed_case is None:
        return {side: torch.zeros(seq, dtype=torch.bool, device=device).index_fill(
            0, _cp_token_places((seq,), cp, cp_rank).to(device), True)[None] for side, seq in zip(("q", "kv"), seqs)}
    packed = captured_packing(packed_case)
    valid = dict(zip(("q", "kv"), valid_tokens(packed_case, device)))
    owned = {}
    for side, slots in (("q", packed.slots_q), ("kv", packed.slots_kv)):
        flat = torch.zeros(sum(slots), dtype=torch.bool, device=device)
        flat[_cp_token_places(slots, cp, cp_rank).to(device)] = True
        owned[side] = as_bshd(flat, "thd", packed, side) & valid[side]
    return owned


def _run_of(calls: list[CapturedCall], root: Path) -> _Run:
    cp = max(_parallel(c, "cp", 1) for c in calls)
    if cp > 1:
        return _cp_run_of(calls, root, cp)
    calls = sorted(calls, key=lambda c: (c.meta.get("parallel", {}).get("tp_rank", c.rank), c.rank))
    shards = [_shard_tensors(c, root) for c in calls]
    names = [n for n in TENSORS if all(n in got for got, _, _ in shards)]
    got = {n: torch.cat([g[n] for g, _, _ in shards], dim=2) for n in names}  # heads: bshd dim 2
    exact = {n: torch.cat([x[n] for _, x, _ in shards], dim=2) for n in shards[0][1]}  # flash.* too
    shard_e = {n: [(_shard_label(c, calls), _relative(g[n], x[n])) for c, (g, x, _) in zip(calls, shards)]
               for n in names}
    inputs = {n: torch.cat([g[n] for g, _, _ in shards], dim=2) for n in INPUTS}
    return _Run(calls[0].meta["api"], got, exact, shard_e, shards[0][2], inputs)


def _flash_e(run: _Run, name: str) -> float:
    """The part of a run's `name` error a flash-style backward makes on its inputs, relative like its error."""
    moved = run.exact.get(f"flash.{name}")
    return 0.0 if moved is None else float(moved.norm() / run.exact[name].norm().clamp_min(1e-300))


def _shard_label(call: CapturedCall, calls: list[CapturedCall], within: str = "tp_rank") -> str:
    """The rank that ran a shard; with its TP (or CP) rank when one process ran several shards (a simulation)."""
    if sum(c.rank == call.rank for c in calls) == 1:
        return str(call.rank)
    return f"{call.rank} ({within} {call.meta.get('parallel', {}).get(within, '?')})"


def _layer_number(call: CapturedCall) -> int | None:
    """The layer number the framework gave the call's module (Megatron's and TE's `layer_number`), if any."""
    number = call.meta["arguments"].get("module", {}).get("layer_number")
    return number if isinstance(number, int) else None


def _values_by_layer(calls: list[CapturedCall]) -> dict[tuple[int, int], list[CapturedCall]]:
    groups: dict[tuple[int, int], list[CapturedCall]] = {}
    for call in calls:
        if call.values_path is not None and call.dout_path is not None:
            groups.setdefault((call.meta["step"], call.meta["layer"]), []).append(call)
    return groups


def compare_captures(root_a: Path, root_b: Path, labels: tuple[str, str] | None = None) -> Comparison:
    """First whether the runs are the same model, data and settings (`attn_doctor.tracing.upstream`); then layer
    by layer, the calls both captures have values of (see the module docstring)."""
    labels = labels or (str(root_a), str(root_b))
    calls_a, calls_b = read_capture(root_a), read_capture(root_b)
    for root, calls in ((root_a, calls_a), (root_b, calls_b)):  # the check replay reads values through
        for call in calls:
            problem = call.values_problem() if call.meta.get("values") else None
            if problem is not None:
                raise BadInput(f"{root}: {call.where()}: {problem}; capture it again (compare reads every recorded "
                               "value)")
    upstream = check_upstream((root_a, root_b), (calls_a, calls_b), labels)
    a, b = _values_by_layer(calls_a), _values_by_layer(calls_b)
    common = sorted(set(a) & set(b))
    if not common and not upstream.differs:
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
        entry.layer_numbers = tuple(_layer_number(calls[0]) for calls in (a[step, layer], b[step, layer]))
        entry.eps = max(run_a.eps, run_b.eps)
        entry.inputs_apart = {n: _relative(run_a.inputs[n], run_b.inputs[n]) for n in INPUTS
                              if run_a.inputs[n].shape == run_b.inputs[n].shape}
        for name in [n for n in TENSORS if n in run_a.got and n in run_b.got]:
            if run_a.got[name].shape != run_b.got[name].shape:
                entry.skipped = (f"{name} has shape {tuple(run_a.got[name].shape)} in one run and "
                                 f"{tuple(run_b.got[name].shape)} in the other")
                break
            entry.measured.append(Measured(
                name, _relative(run_a.got[name], run_b.got[name]), _relative(run_a.exact[name], run_b.exact[name]),
                (_relative(run_a.got[name], run_a.exact[name]), _relative(run_b.got[name], run_b.exact[name])),
                (run_a.shard_e[name], run_b.shard_e[name]), FLOOR_EPS * max(run_a.eps, run_b.eps),
                (_flash_e(run_a, name), _flash_e(run_b, name))))
        layers.append(entry)
    if not upstream.differs and not any(layer.measured for layer in layers):
        first = layers[0]
        raise BadInput(f"no layer of {root_a} and {root_b} could be compared ({len(layers)} with values in both; "
                       f"step {first.step}, layer {first.layer}: {first.skipped or 'no tensor in both'})")
    return Comparison(labels, layers, upstream)
