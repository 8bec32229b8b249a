"""`bisect` with real kernels: the engine's probes run on live workers, the minimal case is diagnosed (forward
or backward, which layer), and a standalone repro is written. Callable without the command line."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn_doctor.backends import BASELINE
from attn_doctor.bisect import knobs
from attn_doctor.backends import select
from attn_doctor.bisect.engine import Bisector, BisectResult, Outcome, RunProbe, TensorFailure
from attn_doctor.core.coords import BackendSpec, Coords, ProbeKind
from attn_doctor.core.errors import BadInput
from attn_doctor.execution.budget import MemoryAsk
from attn_doctor.execution.progress import ProgressSink
from attn_doctor.core.processes import check_timeout
from attn_doctor.execution.session import Session
from attn_doctor.results.row import Row
from attn_doctor.verdict.diagnosis import first_wrong
from attn_doctor.verdict.rule import FAIL, MULTIPLE, PASS, SKIP


@dataclass
class BisectRequest:
    start: Coords
    device: str
    directory: Path  # where the repro goes
    repeats: int = 1
    timeout_s: float = 300.0
    command: str = "attn-doctor bisect"
    memory: MemoryAsk = field(default_factory=MemoryAsk)  # --max-memory, and what was free at the start
    full_repro: bool = False  # the long self-contained repro instead of the short one

    def check(self) -> None:
        if self.repeats < 1:
            raise BadInput("--repeats takes a whole number >= 1")
        check_timeout(self.timeout_s)
        why = self.start.unsupported()
        if why:
            raise BadInput(f"the starting point is impossible: {self.start.describe()} ({why}); check --layout, --tp "
                           "and the heads")


@dataclass
class BisectReport:
    result: BisectResult
    diagnosis: dict
    repro: Path
    env: Any
    # The judged rows `report` shows (`attn_doctor.results.bisect_record`): the start's and the minimal case's,
    # each with its baseline, and the correct path the minimal case was checked on.
    rows: list[Row] = dataclasses.field(default_factory=list)
    command: str = ""
    tool_version: str = ""
    created: str = ""

    def to_dict(self) -> dict:
        from attn_doctor.results import bisect_record

        document = {"format": bisect_record.BISECT_FORMAT, "format_version": bisect_record.BISECT_FORMAT_VERSION,
                    "tool_version": self.tool_version, "created": self.created, "command": self.command,
                    **self.result.to_dict()}
        document["backend"] = self.result.start.backend.name
        document["backend_spec"] = self.result.start.backend.to_dict()
        document["diagnosis"] = self.diagnosis
        document["repro"] = str(self.repro)
        document["env"] = self.env.to_dict() if self.env is not None else None
        document["results"] = [row.to_dict() for row in self.rows]
        return document

    @property
    def file_name(self) -> str:
        """bisect_<backend>_<short-id of the start>.json: the document's name in the bisect's folder."""
        from attn_doctor.bisect.repro import repro_name

        return repro_name(self.result.start).replace("repro_", "bisect_", 1).removesuffix(".py") + ".json"


@dataclass(frozen=True)
class StartRow:
    """Where a bisect from a results row starts: the row's coordinates and its folder. A replayed row whose
    capture folder is gone starts from seeded inputs of the call's shapes, laid out contiguously (the `replay`
    knob's simplification); `missing_capture` then names the folder."""

    coords: Coords
    directory: Path
    missing_capture: Path | None = None


def start_from_results(path: Path, index: int) -> StartRow:
    """The coordinates of the `index`-th failing row of a results file or sweep folder, and its folder."""
    from attn_doctor.results.log import load_results
    from attn_doctor.tracing.replay_case import capture_of, readable

    report, directory = load_results(path)
    failing = report.failing_rows
    if not failing:
        raise BadInput(f"{path} has no failing row to start from; every path passed there")
    if not 0 <= index < len(failing):
        raise BadInput(f"--row {index}: {path} has {len(failing)} failing rows (0..{len(failing) - 1})")
    coords = failing[index].coords
    if coords.kind is ProbeKind.DISTRIBUTED:
        raise BadInput(f"--row {index} of {path} ran on {coords.nproc} ranks; bisect probes one process (bisect its "
                       "case with --tp to follow the TP shards)")
    start = knobs.coords_at(coords.case, coords.layout, coords.tp, coords.layers, coords.backend)
    if start.case.replay is None or readable(start.case.replay):
        return StartRow(start, directory)
    return StartRow(knobs.CATEGORICAL_BY_NAME["replay"].simplify(start, None), directory, capture_of(start.case.replay))


def missing_values(start: StartRow) -> str:
    """Why a bisect from a replayed row whose capture is gone may find nothing: the values it needs."""
    return (f"the row failed on the captured call's own values and views, which are needed and missing: its capture "
            f"{start.missing_capture} is gone (restore the folder, or capture again and replay)")


def probe_row(session: Session, coords: Coords) -> Row:
    """The row of one probe, judged against its baseline (run alongside unless it is the baseline)."""
    baseline = coords.baseline_coords(BASELINE)
    return session.run([coords] if coords == baseline else [baseline, coords])[-1]


class RecordingSession:
    """A session that keeps the last row run at each coordinates (what the bisect document records)."""

    def __init__(self, session: Session):
        self.session = session
        self.rows: dict[Coords, Row] = {}

    def run(self, coords: list[Coords]) -> list[Row]:
        rows = self.session.run(coords)
        self.rows.update(zip(coords, rows))
        return rows


def outcome_of(row: Row) -> Outcome:
    """What the engine sees of a judged row: its verdict and how each failing tensor fails."""
    failures = {}
    for name, t in row.tensors.items():
        if t.verdict == FAIL:
            kind = "nonfinite" if t.nan or t.inf else "bias" if t.bias_failed else "error"
            failures[name] = TensorFailure(kind, t.ratio, t.scaled_err, t.cancelled,
                                           math.nan if t.worst_row_err is None else t.worst_row_err)
    return Outcome(row.verdict, row.reason, tuple(row.failing_tensors), row.extra, internal=row.internal,
                   failures=failures, measured=tuple(row.tensors) or None)


def session_probe(session: Session, progress: ProgressSink) -> RunProbe:
    def probe(coords: Coords) -> Outcome:
        row = probe_row(session, coords)
        progress.advance(1, f"{coords.describe()}: {row.verdict}")
        return outcome_of(row)

    return probe


def control_spec(tested: BackendSpec) -> BackendSpec:
    """A correct path to check a minimal case with: PyTorch's math SDPA kernel (its flash kernel when that
    is the path under test)."""
    name = "sdpa.flash" if tested.name == "sdpa.math" else "sdpa.math"
    return next(spec for spec in select([name]) if spec.name == name)


def confirm_minimal(session: Session, result: BisectResult) -> str:
    """Check the minimal case on a correct path before it is reported. Where the correct path fails there
    too, the failure is the case's, not the kernel's: the minimal case falls back to the last adopted
    simplification (the start at worst) on which the correct path passes. Returns what was checked."""
    control = control_spec(result.start.backend)
    for config in reversed([result.start, *result.trail]):
        if config.layers:
            return f"not checked on {control.name} (a depth stack)"
        row = probe_row(session, dataclasses.replace(config, backend=control))
        if row.verdict in (PASS, SKIP):
            checked = f"{control.name} {'passes' if row.verdict == PASS else 'cannot run'} on it"
            if config != result.minimal:
                result.minimal, result.minimal_outcome = config, result.outcome_at(config)
                checked += (f"; a smaller case where {control.name} also fails was set aside (the failure there "
                            "is the case's, not the kernel's)")
            return checked
    return f"{control.name} fails on every case tried, even the start: the failure may not be the kernel's"


def planned_probes(start: Coords) -> int:
    """About how many probes a bisect of `start` takes (for the progress bar): the start, each categorical
    move and their combination, and a binary search per integer knob."""
    categorical = len(knobs.moves(start))
    integers = sum(math.ceil(math.log2(len(k.values(start)))) + 1 for k in knobs.INTEGER if len(k.values(start)) > 1)
    return 1 + 2 * categorical + integers


def diagnose(session: Session, result: BisectResult) -> dict:
    """Where the fault first shows: the forward or the backward, and for a depth failure the first layer
    (in backward order, from the deepest) whose dQ leaves the baseline's band."""
    minimal = result.minimal
    if minimal.layers:  # the stack's minimal case, as one call
        single = probe_row(session, knobs.coords_at(minimal.case, backend=minimal.backend))
        single_verdict, failing = single.verdict, single.failing_tensors
    else:  # the minimal case is one call already, and the bisector probed it
        single_verdict, failing = result.minimal_outcome.verdict, list(result.minimal_outcome.tensors)
    diagnosis = {"first_wrong": first_wrong(failing) if failing else
                 "neither in one call: the fault shows only through the stack", "single_call_verdict": single_verdict}
    if minimal.layers:
        errors = result.minimal_outcome.extra.get("dq_rel_err_by_layer", [])
        baseline = result.minimal_outcome.extra.get("baseline_dq_rel_err_by_layer", [])
        band = MULTIPLE["dq"]
        out_of_band = [i + 1 for i, (e, b) in enumerate(zip(errors, baseline)) if e > band * b]
        diagnosis["first_layer_out_of_band"] = max(out_of_band) if out_of_band else None
        diagnosis["dq_ratio_by_layer"] = [e / b if b else None for e, b in zip(errors, baseline)]
    return diagnosis


def recorded_rows(result: BisectResult, seen: dict[Coords, Row]) -> list[Row]:
    """The rows a bisect document keeps: the start's and the minimal case's, each with its baseline, then the
    correct path the minimal case was checked on."""
    wanted = [result.start, result.minimal]
    wanted = [c for config in dict.fromkeys(wanted) for c in (config.baseline_coords(BASELINE), config)]
    control = dataclasses.replace(result.minimal, backend=control_spec(result.start.backend))
    return [seen[c] for c in dict.fromkeys([*wanted, control]) if c in seen]


def bisect(request: BisectRequest, progress: ProgressSink | None = None) -> BisectReport:
    """Bisect from the request's start; NothingToBisect when it does not fail, CannotBisect when
    attn-doctor itself fails on it."""
    import datetime

    from attn_doctor import __version__
    from attn_doctor.bisect.repro import write_repro
    from attn_doctor.execution.memory_plan import plan_memory
    from attn_doctor.machine.fingerprint import collect_env

    request.check()
    start = request.start
    budget = request.memory.budget(request.device)
    plan_memory([start.baseline_coords(BASELINE), start], request.device, budget)  # the largest case it probes
    progress = progress or ProgressSink()
    progress.begin(planned_probes(start), f"bisect probes of {start.backend.name}")
    with Session(request.device, request.timeout_s, progress=progress, budget=budget) as live:
        session = RecordingSession(live)
        engine = Bisector(session_probe(session, progress), repeats=request.repeats, valid=knobs.valid)
        result = engine.run(start)
        checked = confirm_minimal(session, result)
        diagnosis = diagnose(session, result)
        diagnosis["minimal_case_checked"] = checked
        facts = live.facts
    progress.end()
    env = collect_env(te_facts=facts.get("te_facts"), read_te=False)
    minimal = result.minimal
    repro_coords = minimal if not minimal.layers else knobs.coords_at(minimal.case, backend=minimal.backend)
    repro = write_repro(request.directory, repro_coords, env, __version__, request.command, request.full_repro)
    created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return BisectReport(result, diagnosis, repro, env, recorded_rows(result, session.rows), request.command,
                        __version__, created)
