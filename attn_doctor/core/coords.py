"""Where a probe runs: the one coordinate type of run, sweep, bisect, the results and the reports.

A probe measures one backend on one case, fed through one memory layout, in one of four ways (its kind):

- CALL:        one attention call.
- TP:          the heads split into `tp` shards as Megatron's tensor parallelism splits them, each shard its
               own call in one process, as views of the full tensors (layout `head_slice`) or as contiguous
               copies (layout `contiguous`); the joined shards are judged.
- DEPTH:       an L-layer GPT stack with the backend as its core attention (TP shards inside each layer);
               dQ is judged at the first and the last layer.
- DISTRIBUTED: the backend on tp x cp real ranks launched with torchrun.

Everything that differs between the kinds and needs no tensors lives here, in one place: which baseline
row a probe is judged against, which reference it is measured against, how it is written in the results
(the `coords` object of a results row, unchanged since the first results format) and the command that
re-runs it; what each kind accepts, and so why a coordinate cannot hold its case, is the table of
`attn_doctor.core.probe_kinds`. What a kind does with tensors is in `attn_doctor.probes` (CALL, TP, DEPTH,
in worker processes) and `attn_doctor.distributed` (DISTRIBUTED).
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from dataclasses import dataclass, field
from typing import Any

from attn_doctor.core.case import Case
from attn_doctor.core.errors import BadInput
from attn_doctor.core.probe_kinds import DEPTH_LAYOUT, KindRules, ProbeKind, rules_for

CP_COMM_TYPES = ("all_gather", "p2p", "a2a")
# TE's CP communication types: those attn-doctor runs and the hierarchical one it does not (two CP levels).
TE_CP_COMM_TYPES = CP_COMM_TYPES + ("a2a+p2p",)


@dataclass(frozen=True)
class BackendSpec:
    """Names one kernel path and says how a worker process builds it (see `attn_doctor.backends`)."""

    name: str  # the row's name, e.g. "te.fused", "sdpa.flash", "local", "my_kernel"
    family: str  # the backend class (and worker process) that runs it
    options: dict[str, Any] = field(default_factory=dict)

    def __hash__(self) -> int:  # options is a dict of plain values: hash its canonical JSON
        return hash((self.name, self.family, json.dumps(self.options, sort_keys=True)))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BackendSpec:
        return cls(d["name"], d["family"], dict(d.get("options", {})))


@dataclass(frozen=True)
class Coords:
    """One probe's coordinates. Build them with the constructors below, which keep each kind's fields
    consistent (a CALL has tp 1 and no layers; a DEPTH probe's layout is the stack's)."""

    case: Case
    backend: BackendSpec
    layout: str = "contiguous"
    kind: ProbeKind = ProbeKind.CALL
    tp: int = 1
    cp: int = 1
    cp_comm_type: str | None = None
    layers: int = 0

    # -- constructors ------------------------------------------------------------------------------------

    @classmethod
    def call(cls, case: Case, backend: BackendSpec, layout: str = "contiguous") -> Coords:
        return cls(case, backend, layout)

    @classmethod
    def tp_shards(cls, case: Case, backend: BackendSpec, tp: int, as_views: bool) -> Coords:
        """TP shards as head-sliced views of the full tensors, or as contiguous copies (at tp 1: the
        unsharded call, recorded as views, as it always was)."""
        layout = "head_slice" if as_views and tp > 1 else "contiguous"
        return cls(case, backend, layout, ProbeKind.TP, tp=tp)

    @classmethod
    def depth(cls, case: Case, backend: BackendSpec, layers: int, tp: int = 1) -> Coords:
        return cls(case, backend, DEPTH_LAYOUT, ProbeKind.DEPTH, tp=tp, layers=layers)

    @classmethod
    def distributed(cls, case: Case, backend: BackendSpec, tp: int, cp: int,
                    cp_comm_type: str | None) -> Coords:
        return cls(case, backend, "contiguous", ProbeKind.DISTRIBUTED, tp=tp, cp=cp,
                   cp_comm_type=cp_comm_type if cp > 1 else None)

    def replace(self, **changes: Any) -> Coords:
        return dataclasses.replace(self, **changes)

    # -- derived ---------------------------------------------------------------------------------------

    @property
    def shards_as(self) -> str:
        """A TP probe's shards: "views" of the full tensors or contiguous "copies"."""
        return "copies" if self.layout == "contiguous" and self.tp > 1 else "views"

    @property
    def nproc(self) -> int:
        return self.tp * self.cp

    @property
    def reference_layers(self) -> int | None:
        """Which float64 reference the probe is measured against: its case's attention (None) or the
        case's L-layer stack."""
        return self.layers if self.kind is ProbeKind.DEPTH else None

    def baseline_key(self) -> tuple:
        """Probes with equal keys are judged against the same baseline row (same inputs, same reference)."""
        if self.kind is ProbeKind.DEPTH:
            return (self.case.key(), "depth", self.layers)
        return (self.case.key(), "single call")

    def baseline_coords(self, baseline: BackendSpec) -> Coords:
        """The coordinates of the baseline probe this one is judged against."""
        if self.kind is ProbeKind.DEPTH:
            return Coords.depth(self.case, baseline, self.layers)
        return Coords.call(self.case, baseline)

    def is_baseline(self, baseline: BackendSpec) -> bool:
        """Whether this is the probe every other probe with its baseline key is judged against."""
        if self.backend != baseline:
            return False
        if self.kind is ProbeKind.DEPTH:
            return self.tp == 1
        return self.kind is ProbeKind.CALL and self.layout == "contiguous"

    @property
    def kind_rules(self) -> KindRules:
        """What probes of this kind accept (`attn_doctor.core.probe_kinds`)."""
        return rules_for(self.kind, self.case)

    def unsupported(self) -> str | None:
        """Why these coordinates cannot hold their case (a SKIP reason), whatever the backend."""
        return self.kind_rules.unsupported(self.case, self.layout, self.tp, self.cp, self.cp_comm_type)

    # -- how the coordinates are written ----------------------------------------------------------------

    def params(self) -> dict[str, Any]:
        """The results row's `coords` object: the kind and its parameters ({} for a plain call)."""
        if self.kind is ProbeKind.CALL:
            return {}
        if self.kind is ProbeKind.TP:
            return {"probe": "tp", "tp": self.tp, "shards_as": self.shards_as}
        if self.kind is ProbeKind.DEPTH:
            return {"probe": "depth", "layers": self.layers, "tp": self.tp}
        return {"probe": "distributed", "nproc": self.nproc, "tp": self.tp, "cp": self.cp,
                "cp_comm_type": self.cp_comm_type}

    @classmethod
    def from_params(cls, case: Case, backend: BackendSpec, layout: str, params: dict[str, Any]) -> Coords:
        """Inverse of `params` (with the row's case, backend and layout); ValueError on a damaged object."""
        if not isinstance(params, dict):
            raise ValueError("coords is not an object")
        probe = params.get("probe")
        if probe is None:
            return cls.call(case, backend, layout)

        def whole(name: str, default: int | None = None) -> int:
            value = params.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"a {probe} row has no whole-number coords.{name}")
            return value

        if probe == ProbeKind.TP.value:
            return cls(case, backend, layout, ProbeKind.TP, tp=whole("tp"))
        if probe == ProbeKind.DEPTH.value:
            return cls(case, backend, layout, ProbeKind.DEPTH, tp=whole("tp", 1), layers=whole("layers"))
        if probe == ProbeKind.DISTRIBUTED.value:
            return cls(case, backend, layout, ProbeKind.DISTRIBUTED, tp=whole("tp"), cp=whole("cp"),
                       cp_comm_type=params.get("cp_comm_type"))
        raise ValueError(f"unknown probe kind {probe!r}")

    def to_dict(self) -> dict[str, Any]:
        """Everything, for a worker process or a bisect document."""
        return {"case": self.case.to_dict(), "backend": self.backend.to_dict(), "layout": self.layout,
                "kind": self.kind.value, "tp": self.tp, "cp": self.cp, "cp_comm_type": self.cp_comm_type,
                "layers": self.layers}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Coords:
        return cls(Case.from_dict(d["case"]), BackendSpec.from_dict(d["backend"]), d["layout"], ProbeKind(d["kind"]),
                   d["tp"], d["cp"], d.get("cp_comm_type"), d["layers"])

    def text(self) -> str:
        """The parameters beyond case and layout, as " tp=2 shards_as=views" (empty for a plain call)."""
        return "".join(f" {k}={v}" for k, v in self.params().items() if k != "probe")

    def describe(self) -> str:
        """The case and every coordinate that is not plain, e.g. "b2 s64 ... layout=head_slice tp=2"."""
        text = f"{self.case.short()} layout={self.layout}"
        if self.tp > 1:
            text += f" tp={self.tp}"
        if self.cp > 1:
            text += f" cp={self.cp} {self.cp_comm_type}"
        if self.layers:
            text += f" layers={self.layers}"
        return text

    def place(self) -> str:
        """Where the probe ran, for a sentence: its layout, plus the rank grid of a distributed probe (the
        depth sentence says which stacks fail, the TP probe's layout whether its shards were views)."""
        if self.kind is ProbeKind.DISTRIBUTED:
            cp = f" x CP={self.cp} {self.cp_comm_type or ''}".rstrip() if self.cp > 1 else ""
            return f"{self.layout} (TP={self.tp}{cp}, {self.nproc} rank{'s' if self.nproc > 1 else ''})"
        return self.layout

    def label(self) -> str:
        """The kind and its parameters in a few characters, for a table cell ("" for a plain call)."""
        if self.kind is ProbeKind.TP:
            return f"TP {self.tp} {self.shards_as}"
        if self.kind is ProbeKind.DEPTH:
            return f"{self.layers} layers" + (f" TP {self.tp}" if self.tp > 1 else "")
        if self.kind is ProbeKind.DISTRIBUTED:
            return f"{self.nproc} rank{'s' if self.nproc > 1 else ''}" + (f" TP {self.tp}" if self.tp > 1 else "") + (
                f" CP {self.cp} {self.cp_comm_type}" if self.cp > 1 else "")
        return ""

    def repro_command(self, selector: str) -> str:
        """The attn-doctor command that re-runs exactly this probe; `selector` picks the backend
        (`--backend NAME` or `--kernel SPEC`, from the backend registry)."""
        flags = self.case.cli_flags()
        if self.kind is ProbeKind.DEPTH:
            return f"attn-doctor sweep {selector} {flags} --layers {self.layers} --tp {self.tp}"
        if self.kind is ProbeKind.TP:
            return f"attn-doctor sweep {selector} {flags} --tp {self.tp}"
        if self.kind is ProbeKind.DISTRIBUTED:
            comm = f" --cp-comm-type {self.cp_comm_type}" if self.cp_comm_type else ""
            return f"attn-doctor run {selector} {flags} --nproc {self.nproc} --tp {self.tp} --cp {self.cp}{comm}"
        return f"attn-doctor run {selector} --layout {shlex.quote(self.layout)} {flags}"


# The backend of coordinates built without one (the bisect engine's own tests, which probe no kernel).
ANY_BACKEND = BackendSpec("any", "any")


def kind_at(tp: int, layers: int) -> ProbeKind:
    """The kind of probe for these values of bisect's knobs: an L-layer stack when layers > 0, TP shards when
    tp > 1, else one call."""
    if layers > 0:
        return ProbeKind.DEPTH
    return ProbeKind.TP if tp > 1 else ProbeKind.CALL


def coords_at(case: Case, layout: str = "contiguous", tp: int = 1, layers: int = 0,
              backend: BackendSpec = ANY_BACKEND) -> Coords:
    """The probe for these values of bisect's knobs (`kind_at`): an L-layer stack (TP shards inside each
    layer), TP shards (as views when the layout is head_slice, else as copies), or one call on the layout."""
    kind = kind_at(tp, layers)
    if kind is ProbeKind.DEPTH:
        return Coords.depth(case, backend, layers, tp)
    if kind is ProbeKind.TP:
        return Coords(case, backend, layout, kind, tp=tp)
    return Coords.call(case, backend, layout)


def knob_dict(coords: Coords) -> dict:
    """The values of bisect's knobs: what a bisect document records of a probe (and what names its repro),
    with the TE release and the cuDNN build asked for where they were (`--te`, `--cudnn`, or bisect's te and
    cudnn knobs)."""
    cudnn, release = coords.backend.options.get("cudnn"), coords.backend.options.get("te")
    return {"case": coords.case.to_dict(), "layout": coords.layout, "tp": coords.tp, "layers": coords.layers,
            **({"te": dict(release)} if release else {}),
            # as JSON holds it: a build made here has tuples where the same build read back has lists
            **({"cudnn": json.loads(json.dumps(cudnn))} if cudnn else {})}


class BadGrid(BadInput, ValueError):
    """A rank grid that cannot be launched (N != tp * cp, an unknown comm type, ...)."""


def check_grid(tp: int, cp: int, cp_comm_type: str | None, nproc: int | None = None) -> None:
    """Refuse a rank grid that cannot be launched whatever the case."""
    for name, value in (("tp", tp), ("cp", cp), ("nproc", nproc if nproc is not None else tp * cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadGrid(f"--{name} must be a whole number >= 1, got {value!r}")
    if nproc is not None and nproc != tp * cp:
        raise BadGrid(f"--nproc {nproc} must equal --tp {tp} x --cp {cp} = {tp * cp}: the ranks form a tp x cp "
                      "grid")
    if cp > 1 and cp_comm_type not in CP_COMM_TYPES:
        hierarchical = cp_comm_type in TE_CP_COMM_TYPES
        hint = f" (TE's hierarchical {cp_comm_type} needs two CP levels; not supported)" if hierarchical else ""
        raise BadGrid(f"--cp-comm-type {cp_comm_type!r}: choose one of {', '.join(CP_COMM_TYPES)}{hint}")
