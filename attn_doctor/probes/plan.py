"""Planning: which coordinates a request expands to, and which of them cannot run here (known before any
worker starts).

A point is one case probed in one way: every layout of a CALL probe, every TP degree of a TP probe, every
depth (and TP degree) of a DEPTH probe. Its coordinates are judged together (each against the baseline the
point carries), and a sweep streams and resumes point by point. The local baseline always comes first in a
point: every verdict is relative to it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from attn_doctor.backends import BASELINE, BackendSpec, own_layout
from attn_doctor.backends import static_skip as backend_static_skip
from attn_doctor.core.case import Case
from attn_doctor.core.coords import Coords, ProbeKind
from attn_doctor.core.layouts import default_layouts


def plan_calls(case: Case, specs: list[BackendSpec], layouts: list[str]) -> list[Coords]:
    """The baseline, then every spec on every layout (none given: the case's defaults, `default_layouts`); a layer
    path, which makes its own q, k, v, on its own layout once."""
    coords = [Coords.call(case, BASELINE)]
    for spec in specs:
        for layout in [own_layout(spec)] if own_layout(spec) else layouts or default_layouts(case):
            if not (spec == BASELINE and layout == "contiguous"):
                coords.append(Coords.call(case, spec, layout))
    return coords


def plan_tp(case: Case, specs: list[BackendSpec], degrees: list[int]) -> list[Coords]:
    """Per backend and TP degree t: the t shards as views of the full tensors and as contiguous copies."""
    coords = [Coords.call(case, BASELINE)]
    for spec in specs:
        for tp in degrees:
            coords.append(Coords.tp_shards(case, spec, tp, as_views=True))
            if tp > 1:
                coords.append(Coords.tp_shards(case, spec, tp, as_views=False))
    return coords


def plan_depth(case: Case, specs: list[BackendSpec], depths: list[int], degrees: list[int]) -> list[Coords]:
    coords = []
    for layers in depths:
        coords.append(Coords.depth(case, BASELINE, layers))
        for spec in specs:
            for tp in degrees:
                if not (spec == BASELINE and tp == 1):
                    coords.append(Coords.depth(case, spec, layers, tp))
    return coords


@dataclass(frozen=True)
class Point:
    """One case with one kind of probe: the unit a sweep judges, streams and resumes."""

    case: Case
    kind: ProbeKind
    layouts: tuple[str, ...] = ()
    depths: tuple[int, ...] = ()
    degrees: tuple[int, ...] = (1,)

    @property
    def id(self) -> str:
        spec = {"case": self.case.to_dict(), "kind": self.kind.value, "layouts": list(self.layouts),
                "depths": list(self.depths), "tp": list(self.degrees)}
        return json.dumps(spec, sort_keys=True)

    def coords(self, specs: list[BackendSpec]) -> list[Coords]:
        if self.kind is ProbeKind.DEPTH:
            return plan_depth(self.case, specs, list(self.depths), list(self.degrees))
        if self.kind is ProbeKind.TP:
            return plan_tp(self.case, specs, list(self.degrees))
        return plan_calls(self.case, specs, list(self.layouts))


def point_kind(depths: list[int] | None, degrees: list[int] | None) -> ProbeKind:
    """How a sweep's points probe: depth stacks when depths are given (with TP inside), else TP shards when
    degrees are, else single calls on layouts."""
    if depths:
        return ProbeKind.DEPTH
    return ProbeKind.TP if degrees else ProbeKind.CALL


def plan_points(cases: list[Case], layouts: list[str], depths: list[int] | None = None,
                degrees: list[int] | None = None) -> list[Point]:
    """One point per case, of `point_kind`."""
    kind = point_kind(depths, degrees)
    if kind is ProbeKind.DEPTH:
        return [Point(c, kind, depths=tuple(depths), degrees=tuple(degrees or [1])) for c in cases]
    if kind is ProbeKind.TP:
        return [Point(c, kind, degrees=tuple(degrees)) for c in cases]
    return [Point(c, kind, layouts=tuple(layouts or default_layouts(c))) for c in cases]


def shard_of(points: list[Point], index: int, count: int) -> list[Point]:
    """The `index`-th (1-based) of `count` slices of `points`: ordered by their ids, every count-th from the
    index-th. The same on every machine whatever order the grid was written in; the slices are disjoint, their
    union is every point, and their sizes differ by one at most."""
    return sorted(points, key=lambda point: point.id)[index - 1::count]


def kernel_key(case: Case) -> tuple:
    """What the libraries under test build a kernel for, as far as a case says: cuDNN compiles a kernel per dtype,
    head dims, mask, bias, softmax, window, FP8 recipe and ragged layout, and reuses it across batch sizes, layouts
    and GQA (the H100: 1.1 s of CPU for a new configuration, 0.1 s once built, 0.09 s for sbhd after bshd at
    the same dims; reports/h100/issue51/lease4). An approximation: it orders work, it judges nothing."""
    return (case.dtype, case.head_dim, case.head_dim_v, case.mask, case.bias.split(":")[0], case.softmax,
            case.window is not None, case.fp8, case.fp8_backward, case.qkv_format == "thd", case.forward_only)


def in_build_order(points: list[Point]) -> list[Point]:
    """`points` in an order where neighbours need different kernels built: one point of each `kernel_key` in turn,
    then the second of each, and so on, each key's points in their order. A sweep's workers take neighbouring
    points at once: in grid order they built the same kernel side by side (te-coverage's 211 points, 72 kernel
    keys: 51 builds of a key another point of the same 7 neighbours builds first; none in this order), where here
    each is built once and found in CUDA's JIT cache after. Only the order changes: the same points, judged the
    same (a sweep's rows come in the order its points ran, as a shard's do)."""
    by_key: dict[tuple, list[Point]] = {}
    for point in points:
        by_key.setdefault(kernel_key(point.case), []).append(point)
    rounds = max((len(same) for same in by_key.values()), default=0)
    return [same[turn] for turn in range(rounds) for same in by_key.values() if turn < len(same)]


def static_skip(coords: Coords, device: str) -> str | None:
    """Why a probe cannot run here, known before starting anything: the coordinates cannot hold the case,
    or the backend cannot run it on this device."""
    return coords.unsupported() or backend_static_skip(coords.backend, coords.case, device)
