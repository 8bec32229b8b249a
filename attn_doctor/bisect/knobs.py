"""The knobs bisect turns, as a table: what each one reads from a probe's coordinates, how it moves, and
which values it may take. The engine (`engine.py`) knows only this table.

Categorical knobs move to their plainest value (the layout to contiguous, thd to padded tensors, ragged
lengths to full ones, no FP8, no sink, no bias, v's head dim to q's, the mask to a plainer TE mask type down
to no_mask, GQA to plain heads, no window, self-attention, TP 1, one layer, the plainest dtype and input
distribution that still fail, and for TE's paths each other cuDNN build found here); integer knobs are binary-searched down to the smallest value that still fails. A value a case cannot
take (heads not divisible by the TP degree, say) is never probed. Relations name two lengths whose boundary may
move together (seq > seq_kv), so the engine can tell a relation from a threshold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from attn_doctor.core.case import DEFAULT_MASKED_FRACTION, DTYPES, Case
from attn_doctor.core.coords import ANY_BACKEND, Coords, ProbeKind, coords_at, kind_at, knob_dict
from attn_doctor.core.errors import BadInput


def _without_capture(case: Case) -> dict[str, Any]:
    """A replayed case as seeded inputs of its shapes: its captured mask becomes a random one of the same kind
    (and a packed call's own slots the usual padding between sequences)."""
    fields = {**case.to_dict(), "replay": None}
    if case.mask_source == "captured":
        fields["mask_source"] = f"random:{DEFAULT_MASKED_FRACTION}"
    return fields


def _rebuilt(coords: Coords, **changes: Any) -> Coords:
    values = {"case": coords.case, "layout": coords.layout if coords.kind is not ProbeKind.DEPTH else "contiguous",
              "tp": coords.tp, "layers": coords.layers, **changes}
    return coords_at(values["case"], values["layout"], values["tp"], values["layers"], coords.backend)


def _with_case(coords: Coords, **fields: Any) -> Coords:
    """The coordinates on a case with `fields` changed (BadInput when the case is impossible: a replayed call
    keeps its captured shapes, which are those of the case it was made as, since no knob changes them)."""
    case = Case.from_dict({**coords.case.to_dict(), **fields})
    if case.replay is not None and coords.case.qkv_format != "thd" and _q_elements(case) != _q_elements(coords.case):
        raise BadInput("a replayed call keeps its captured shapes; drop --replay to change them")
    return _rebuilt(coords, case=case)


def _q_elements(case: Case) -> int:
    return case.batch * case.seq * case.heads * case.head_dim


@dataclass(frozen=True)
class Categorical:
    name: str
    value: Callable[[Coords], Any]
    plainer: Callable[[Coords], list]  # values plainer than the current one, plainest first
    simplify: Callable[[Coords, Any], Coords]  # the coordinates with the knob at that plainer value
    # False for a knob whose values are alternatives, not simplifications (a cuDNN build): each is tried, one
    # where the case passes makes a condition, and one where it still fails is never adopted in its place.
    adopt: bool = True


@dataclass(frozen=True)
class Integer:
    name: str
    value: Callable[[Coords], int]
    values: Callable[[Coords], list[int]]  # every value it may take, smallest first
    set: Callable[[Coords, int], Coords]


def _heads_values(coords: Coords) -> list[int]:
    case = coords.case
    group = case.heads // case.kv_heads
    unit = group * coords.tp  # heads stay a multiple of the group size and of the TP degree
    return [n for n in range(unit, case.heads + 1, unit) if (n // group) % coords.tp == 0]


def _set_heads(coords: Coords, heads: int) -> Coords:
    group = coords.case.heads // coords.case.kv_heads
    return _with_case(coords, heads=heads, kv_heads=heads // group)


def _set_seq(coords: Coords, seq: int) -> Coords:
    """seq (and seq_kv with it under self-attention); per-sequence lengths are cut to fit."""
    case = coords.case
    fields: dict[str, Any] = {"seq": seq, **({"seq_kv": seq} if case.seq_kv == case.seq else {})}
    if case.seqlens is not None:
        fields["seqlens"] = [min(n, seq) for n in case.seqlens]
    if case.seqlens_kv is not None and case.seq_kv == case.seq:
        fields["seqlens_kv"] = [min(n, seq) for n in case.seqlens_kv]
    return _with_case(coords, **fields)


def _set_batch(coords: Coords, batch: int) -> Coords:
    """The first `batch` sequences (their lengths with them)."""
    case = coords.case
    fields: dict[str, Any] = {"batch": batch}
    for name in ("seqlens", "seqlens_kv"):
        if getattr(case, name) is not None:
            fields[name] = list(getattr(case, name)[:batch])
    return _with_case(coords, **fields)


# Mask types by what they add to no_mask: a plainer mask has a subset of these.
MASK_PARTS = {"no_mask": set(), "causal": {"causal"}, "causal_bottom_right": {"causal", "bottom_right"},
              "padding": {"padding"}, "padding_causal": {"padding", "causal"},
              "padding_causal_bottom_right": {"padding", "causal", "bottom_right"}, "arbitrary": {"arbitrary"}}


def _plainer_masks(coords: Coords) -> list[str]:
    parts = MASK_PARTS[coords.case.mask]
    plainer = [m for m, p in MASK_PARTS.items() if p < parts]
    return sorted(plainer, key=lambda m: len(MASK_PARTS[m]))


def _set_mask(coords: Coords, mask: str) -> Coords:
    """Another mask type; leaving arbitrary drops its mask source."""
    return _with_case(coords, mask=mask, **({"mask_source": None} if coords.case.mask == "arbitrary" else {}))


def _plainer(value: Any, order: tuple) -> list:
    """The values of `order` (plainest first) before `value`."""
    return list(order[:order.index(value)]) if value in order else []


# The input distributions from the plainest: a fault that still shows on Gaussian inputs reduces to them.
INPUTS_PLAINEST_FIRST = ("normal", "uniform", "structured", "outliers", "large-logits", "deep-layer")


def _head_dims(coords: Coords) -> list[int]:
    current = coords.case.head_dim
    step = 8 if current % 8 == 0 else 1  # the fused kernels take head dims in multiples of 8
    return list(range(step, current + 1, step))


@functools.cache
def _cudnn_builds() -> tuple:
    from attn_doctor.machine.cudnn_builds import find_builds

    return tuple(find_builds())


def _cudnn_value(coords: Coords) -> str:
    build = coords.backend.options.get("cudnn")
    return (build["version"] or build["directory"]) if build else "as installed"


def _other_cudnn_builds(coords: Coords) -> list:
    """The cuDNN builds found here other than the one the path runs on (paths whose process loads cuDNN)."""
    from attn_doctor.backends import backend_class

    if coords.backend.family == ANY_BACKEND.family or not backend_class(coords.backend).loads_cudnn:
        return []
    current = (coords.backend.options.get("cudnn") or {}).get("directory")
    return [build for build in _cudnn_builds() if build.directory != current]


@functools.cache
def _te_releases() -> tuple:
    from attn_doctor.machine.te_installs import choices

    return tuple(choices())


def _te_value(coords: Coords) -> str:
    release = coords.backend.options.get("te")
    return release["version"] if release else "as installed"


def _other_te_releases(coords: Coords) -> list:
    """The TE releases (prepared with `attn-doctor te add`, and the environment's own) other than the one TE's path
    runs on (a path on no `--te` runs on the environment's)."""
    from attn_doctor.backends import backend_class

    if coords.backend.family == ANY_BACKEND.family or not backend_class(coords.backend).loads_cudnn:
        return []
    releases = _te_releases()
    own = next((install.version for install in releases if not install.prepared), None)
    current = (coords.backend.options.get("te") or {}).get("version", own)
    return [install for install in releases if install.version != current]


def _set_te(coords: Coords, release: Any) -> Coords:
    from attn_doctor.backends import on_release
    from attn_doctor.machine.te_installs import resolve

    release = resolve(release, list(_te_releases())) if isinstance(release, str) else release
    return dataclasses.replace(coords, backend=on_release(coords.backend, release))


def _set_cudnn(coords: Coords, build: Any) -> Coords:
    from attn_doctor.backends import on_build
    from attn_doctor.machine.cudnn_builds import resolve

    build = resolve(build, list(_cudnn_builds())) if isinstance(build, str) else build
    return dataclasses.replace(coords, backend=on_build(coords.backend, build))


CATEGORICAL: tuple[Categorical, ...] = (
    # A replayed call first: does the fault need the captured values and views, or do seeded inputs of its
    # shapes, contiguous, show it too (then every other knob can shrink it)?
    Categorical("replay", lambda c: c.case.replay, lambda c: [None] if c.case.replay is not None else [],
                lambda c, _: _rebuilt(c, case=Case.from_dict(_without_capture(c.case)),
                                      layout="contiguous" if c.layout == "captured" else c.layout)),
    Categorical("layout", lambda c: c.layout,
                lambda c: ["contiguous"] if c.kind is not ProbeKind.DEPTH and c.layout != "contiguous" else [],
                lambda c, v: _rebuilt(c, layout=v)),
    Categorical("qkv_format", lambda c: c.case.qkv_format,  # packed tokens to padded tensors, TE's default first
                lambda c: _plainer(c.case.qkv_format, ("sbhd", "bshd", "thd")),
                lambda c, v: _with_case(c, qkv_format=v, pad_between_seqs=False)),
    Categorical("pad_between_seqs", lambda c: c.case.pad_between_seqs,
                lambda c: [False] if c.case.pad_between_seqs else [],
                lambda c, v: _with_case(c, pad_between_seqs=v)),
    Categorical("lengths", lambda c: c.case.seqlens is not None or c.case.seqlens_kv is not None,
                lambda c: [False] if c.case.seqlens is not None or c.case.seqlens_kv is not None else [],
                lambda c, _: _with_case(c, seqlens=None, seqlens_kv=None)),  # every sequence full length
    Categorical("fp8", lambda c: c.case.fp8, lambda c: ["none"] if c.case.fp8 != "none" else [],
                lambda c, v: _with_case(c, fp8=v)),
    Categorical("softmax", lambda c: c.case.softmax,
                lambda c: _plainer(c.case.softmax, ("vanilla", "off-by-one", "learnable")),
                lambda c, v: _with_case(c, softmax=v)),
    Categorical("bias", lambda c: c.case.bias, lambda c: ["no_bias"] if c.case.bias != "no_bias" else [],
                lambda c, v: _with_case(c, bias=v)),
    Categorical("head_dim_v", lambda c: c.case.head_dim_v if c.case.mla else None, lambda c: [None] if c.case.mla else [],
                lambda c, v: _with_case(c, head_dim_v=v)),
    Categorical("mask", lambda c: c.case.mask, _plainer_masks, _set_mask),
    Categorical("kv_heads", lambda c: c.case.kv_heads,
                lambda c: [c.case.heads] if c.case.kv_heads != c.case.heads else [],
                lambda c, _: _with_case(c, kv_heads=c.case.heads)),  # tied to heads, whatever heads is by then
    Categorical("window", lambda c: c.case.window, lambda c: [None] if c.case.window is not None else [],
                lambda c, v: _with_case(c, window=v)),
    Categorical("seq_kv", lambda c: c.case.seq_kv, lambda c: [c.case.seq] if c.case.seq_kv != c.case.seq else [],
                lambda c, _: _with_case(c, seq_kv=c.case.seq)),  # tied to seq
    Categorical("tp", lambda c: c.tp, lambda c: [1] if c.tp != 1 else [], lambda c, v: _rebuilt(c, tp=v)),
    Categorical("layers", lambda c: c.layers, lambda c: [1] if c.layers > 1 else [],
                lambda c, v: _rebuilt(c, layers=v)),
    Categorical("dtype", lambda c: c.case.dtype,  # plainest first
                lambda c: [d for d in ("fp32", "fp16", "bf16") if d != c.case.dtype and d in DTYPES],
                lambda c, v: _with_case(c, dtype=v)),
    Categorical("inputs", lambda c: c.case.inputs,  # the plainer distributions, plainest first
                lambda c: list(INPUTS_PLAINEST_FIRST[:INPUTS_PLAINEST_FIRST.index(c.case.inputs)]),
                lambda c, v: _with_case(c, inputs=v)),
    # The TE release and the cuDNN build TE's process loads: "fails with 9.14.0, passes with 9.19.0" is a condition
    # like any other.
    Categorical("te", _te_value, _other_te_releases, _set_te, adopt=False),
    Categorical("cudnn", _cudnn_value, _other_cudnn_builds, _set_cudnn, adopt=False),
)

INTEGER: tuple[Integer, ...] = (
    Integer("layers", lambda c: c.layers, lambda c: list(range(1, c.layers + 1)) if c.layers > 1 else [],
            lambda c, v: _rebuilt(c, layers=v)),
    Integer("batch", lambda c: c.case.batch, lambda c: list(range(1, c.case.batch + 1)), _set_batch),
    Integer("seq", lambda c: c.case.seq, lambda c: list(range(1, c.case.seq + 1)), _set_seq),
    Integer("seq_kv", lambda c: c.case.seq_kv,  # self-attention: seq_kv follows seq
            lambda c: list(range(1, c.case.seq_kv + 1)) if c.case.seq_kv != c.case.seq else [],
            lambda c, v: _with_case(c, seq_kv=v)),
    Integer("heads", lambda c: c.case.heads, _heads_values, _set_heads),
    Integer("head_dim", lambda c: c.case.head_dim, _head_dims, lambda c, v: _with_case(c, head_dim=v)),
)

CATEGORICAL_BY_NAME = {knob.name: knob for knob in CATEGORICAL}


def _set_lengths(coords: Coords, seq: int, seq_kv: int) -> Coords:
    """Both lengths at once, whatever their order (per-sequence lengths cut to fit)."""
    case = coords.case
    fields: dict[str, Any] = {"seq": seq, "seq_kv": seq_kv}
    if case.seqlens is not None:
        fields["seqlens"] = [min(n, seq) for n in case.seqlens]
    if case.seqlens_kv is not None:
        fields["seqlens_kv"] = [min(n, seq_kv) for n in case.seqlens_kv]
    return _with_case(coords, **fields)


@dataclass(frozen=True)
class Relation:
    """Two integer knobs whose boundary may be a relation between them rather than a threshold on one: a
    kernel wrong whenever seq_kv < seq fails from seq = seq_kv + 1 whatever seq_kv is. `set` moves both."""

    knob: str
    other: str
    set: Callable[[Coords, int, int], Coords]  # the coordinates with knob = x and other = y
    applies: Callable[[Coords], bool]  # whether the two are separate lengths in these coordinates


RELATIONS: tuple[Relation, ...] = (
    Relation("seq", "seq_kv", _set_lengths, lambda c: c.case.seq_kv != c.case.seq),
    Relation("seq_kv", "seq", lambda c, x, y: _set_lengths(c, y, x), lambda c: c.case.seq_kv != c.case.seq),
)
RELATION_OF = {relation.knob: relation for relation in RELATIONS}


def valid(coords: Coords) -> bool:
    """Whether the coordinates can hold their case (impossible ones are never probed)."""
    return coords.unsupported() is None


def moves(coords: Coords) -> list[tuple[str, str, Coords]]:
    """(knob, plainer value, coordinates with only that knob simplified) for every categorical knob."""
    found = []
    for knob in CATEGORICAL:
        for value in knob.plainer(coords):
            try:
                found.append((knob.name, "none" if value is None else str(value), knob.simplify(coords, value)))
            except BadInput:
                pass
    return found


def carry(coords: Coords, knob: str, candidate: Coords) -> Coords | None:
    """`coords` with `knob` moved as it is in `candidate` (None when that is impossible there)."""
    spec = CATEGORICAL_BY_NAME[knob]
    try:
        return spec.simplify(coords, spec.value(candidate))
    except BadInput:
        return None


def value(coords: Coords, knob: str) -> Any:
    spec = CATEGORICAL_BY_NAME.get(knob) or next(k for k in INTEGER if k.name == knob)
    return spec.value(coords)


__all__ = ["ANY_BACKEND", "CATEGORICAL", "INTEGER", "RELATIONS", "Categorical", "Integer", "Relation", "carry",
           "coords_at", "kind_at", "knob_dict", "moves", "valid", "value"]
