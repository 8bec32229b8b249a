"""`sweep`: a grid of cases, each probed on layouts, TP shards or depth stacks, streamed point by point to
`results.jsonl` and resumable (`attn_doctor.results.log`). Callable without the command line:
`prepare` checks the request and reads what a resumed sweep already has, `run` does the rest."""

from __future__ import annotations

import time

from dataclasses import dataclass, field
from pathlib import Path

from attn_doctor.core import bytecode
from attn_doctor.core.case import Case
from attn_doctor.core.coords import BackendSpec
from attn_doctor.core.errors import BadInput
from attn_doctor.core.probe_kinds import rules_for
from attn_doctor.execution.progress import ProgressSink
from attn_doctor.core.processes import check_timeout
from attn_doctor.execution.budget import MemoryAsk
from attn_doctor.probes.plan import Point, in_build_order, plan_points, point_kind, shard_of
from attn_doctor.results.log import DOCUMENT_FILE, ResultsLog
from attn_doctor.results.report import RunReport, dumps
from attn_doctor.results.row import Row

PLOT_FILE = "depth.png"


@dataclass
class SweepRequest:
    cases: list[Case]
    specs: list[BackendSpec]
    layouts: list[str]
    device: str
    directory: Path
    resume: bool = False
    depths: list[int] | None = None
    degrees: list[int] | None = None
    workers: int | None = None  # per backend family; None: the cores shared out on a GPU, 1 on the CPU
    timeout_s: float = 300.0
    command: str = "attn-doctor sweep"
    layouts_given: bool = False  # --layout was given (it does not apply to TP shards and depth stacks)
    repeats: int = 1  # --repeats: runs of each single call on the same inputs (judged on the worst)
    shard: tuple[int, int] | None = None  # --shard I/N: only the I-th of N slices of the points (`shard_of`)
    not_judged: list[str] = field(default_factory=list)  # asked for, not runnable: why each (replay's damaged calls)
    memory: MemoryAsk = field(default_factory=MemoryAsk)  # --max-memory, and what was free at the start
    started: float | None = None  # time.perf_counter() at the command's start (None: the session's start)


@dataclass
class SweepPlan:
    request: SweepRequest
    log: ResultsLog
    points: list[Point]
    todo: list[Point]
    done_rows: list[Row] = field(default_factory=list)
    budget: object = None  # the MemoryBudget the sweep runs within (None: not known)
    memory: object = None  # the MemoryPlan its points fit (None: nothing to run)

    @property
    def workers(self) -> int | None:
        """Workers per family asked for; None: `execution.concurrency.default_workers` decides per family."""
        return self.request.workers


def check_resumable(directory: Path, done_rows: list[Row], points: list[Point], specs: list[BackendSpec]) -> None:
    """Refuse to resume a sweep with other backends: its finished points would be skipped without the new
    backends ever running on them, and the report would mix two backend sets."""
    if not done_rows or not points:
        return
    ran = sorted({row.backend for row in done_rows})
    asked = sorted({coords.backend.name for coords in points[0].coords(specs)})
    if ran != asked:
        raise BadInput(f"--resume {directory}: that sweep ran {', '.join(ran)}, this command asks for "
                       f"{', '.join(asked)}; resume with the same --backend/--kernel options, or start a new "
                       "sweep with --out")


def check_same_repeats(directory: Path, done_rows: list[Row], repeats: int) -> None:
    """Refuse to resume a sweep with another --repeats: its points would mix verdicts on one call and on the
    worst of several."""
    ran = sorted({row.repeats["n"] if row.repeats else 1 for row in done_rows
                  if row.coords.kind_rules.repeats and row.tensors})
    if ran and ran != [repeats]:
        raise BadInput(f"--resume {directory}: that sweep ran each call {' or '.join(map(str, ran))} time(s), this "
                       f"command asks for --repeats {repeats}; resume with the same --repeats, or start a new sweep "
                       "with --out")


def prepare(request: SweepRequest) -> SweepPlan:
    """Check the request against what is on disk and what can run here, before any work starts."""
    from attn_doctor.execution.memory_plan import plan_memory
    from attn_doctor.workflows.run import check_repeats, runnable

    check_repeats(request.repeats)
    check_timeout(request.timeout_s)
    kind = point_kind(request.depths, request.degrees)
    for rules in dict.fromkeys(rules_for(kind, case) for case in request.cases):
        if request.repeats > 1 and not rules.repeats:
            raise BadInput(rules.repeats_refusal(without="--layers/--tp (or the recipe's grid.layers/grid.tp)"))
        if request.layouts_given and not rules.takes_layout:
            raise BadInput(f"{rules.layout_refusal(explained=False)}; drop --layout, or sweep the layouts without "
                           "--layers/--tp")
        if not rules.inputs and any(case.inputs != "normal" for case in request.cases):
            raise BadInput(f"{rules.inputs_refusal()}; drop --inputs, or sweep the input distributions without "
                           f"{rules.flag}")
    log = ResultsLog(request.directory)
    if request.resume and not log.path.exists():
        raise BadInput(f"--resume {request.directory}: no {log.path.name} there; start the sweep with --out instead")
    if not request.resume and log.path.exists():
        raise BadInput(f"{request.directory} already holds a sweep ({log.path.name}); continue it with --resume "
                       f"{request.directory} or choose another --out")
    # A new or empty folder becomes the sweep's (other files in it are left alone); results a sweep would write
    # over are not (a sweep.json alone is a sweep that finished no point: it starts again there).
    taken = [name for name in (DOCUMENT_FILE, PLOT_FILE) if (request.directory / name).exists()]
    if not request.resume and taken:
        raise BadInput(f"{request.directory} already holds {', '.join(taken)}, which the sweep would overwrite; "
                       "choose a new or empty --out folder")
    done_rows, done_points = log.load()
    points = plan_points(request.cases, request.layouts, request.depths, request.degrees)
    if request.shard is not None:
        points = shard_of(points, *request.shard)
    stray = done_points - {point.id for point in points}
    if stray:
        raise BadInput(f"--resume {request.directory}: {len(stray)} of its finished points are not in this command's "
                       "grid (another grid, or another --shard); resume with the command that started it")
    check_resumable(request.directory, done_rows, points, request.specs)
    check_same_repeats(request.directory, done_rows, request.repeats)
    todo = in_build_order([p for p in points if p.id not in done_points])
    plan = SweepPlan(request, log, points, todo, done_rows)
    can_run = set(runnable([c for p in points for c in p.coords(request.specs)], request.specs, request.device,
                           kind, request.degrees or [1]))
    plan.budget = request.memory.budget(request.device)
    plan.memory = plan_memory([c for p in todo for c in p.coords(request.specs) if c in can_run], request.device,
                              plan.budget, plan.workers, request.repeats)  # refused here if it cannot fit
    return plan


def run(plan: SweepPlan, progress: ProgressSink | None = None) -> RunReport:
    """Run the points still to do, streaming each finished one; the results document of every point.

    On Ctrl-C the finished points stay in results.jsonl (resumable), and no results.json is written."""
    from attn_doctor.execution.memory_plan import phases_document, phases_notes
    from attn_doctor.execution.session import Session
    from attn_doctor.workflows.run import make_report, profile

    request = plan.request
    progress = progress or ProgressSink()
    start = time.perf_counter()
    plan.log.write_header(make_report([], request.specs, request.device, request.command, read_te=False,
                                      not_judged=request.not_judged))
    rows = list(plan.done_rows)
    groups = [point.coords(request.specs) for point in plan.todo]
    progress.begin(sum(len(coords) for coords in groups), "probes")

    def point_done(index: int, point_rows: list[Row]) -> None:
        plan.log.append(plan.todo[index].id, point_rows)  # streamed as each point completes, in any order
        progress.advance(0, f"{plan.todo[index].case.short()} [{plan.todo[index].kind.name.lower()}] done")

    with Session(request.device, request.timeout_s, workers_per_family=plan.workers, progress=progress,
                 repeats=request.repeats, budget=plan.budget) as session:
        for point_rows in session.run_groups(groups, on_row=lambda row: progress.advance(1), on_group=point_done):
            rows.extend(point_rows)
        facts, startup, reference_s = session.facts, session.startup_seconds, session.references.seconds
        plans = session.plans or ([plan.memory] if plan.memory is not None else [])
        moves, servers, turns = len(session.moves), session.server_starts, session.turn_seconds
    probes_s = time.perf_counter() - start
    progress.end()
    report = make_report(rows, request.specs, request.device, request.command, facts, not_judged=request.not_judged,
                         notes=phases_notes(plans))
    report.memory = phases_document(plans)
    # This run's wall time and pace, from the command's start (its imports, TE's among them, and its plan count:
    # what a user waits; points already done by an earlier run are not counted), and where the time went
    # (`workflows.run.profile`: each family's slowest worker start, the parent's references, the probes).
    now = time.perf_counter()
    origin = request.started if request.started is not None else start
    wall = now - origin
    report.seconds = {**profile(rows[len(plan.done_rows):], startup, reference_s, probes_s, now - start),
                      "wall": wall, "points": float(len(plan.todo)),
                      "points per minute": 60 * len(plan.todo) / wall if wall > 0 else 0.0,
                      "workers that changed family": float(moves)}
    if len(turns) > 1:  # the phases' turns (`memory.phases` says each one's workers) and the retries alone after
        report.seconds.update({f"{turn} (wall)": seconds for turn, seconds in turns.items()})
    if request.started is not None:  # not known, not said
        report.seconds["before the session (from the command's start)"] = start - request.started
    for key, server in servers.items():  # the server's imports, from its start (at the command's first lines)
        report.seconds[f"fork server imports ({key})"] = float(server["ready_s"])
        report.seconds[f"fork server imports ({key}), on a CPU"] = float(server["cpu_s"])
        report.seconds[f"fork server imports ({key}), pages read from disk"] = float(server.get("major_faults", 0))
    compiled = bytecode.outcome()  # the sources compiled ahead for this command's processes (`core.bytecode`)
    if compiled is not None:
        report.seconds["sources compiled ahead"] = float(compiled["seconds"])
        report.seconds["sources compiled ahead, files"] = float(compiled["compiled"])
    if report.depth_lines:
        from attn_doctor.render.plot import plot_depth

        plot = plot_depth(report.depth_lines, request.directory / PLOT_FILE)
        report.artifacts = {"plot": plot.name} if plot else {}
    return report


def save(report: RunReport, directory: Path):
    """Write results.json beside the stream; where it went and, if the folder failed, why."""
    from attn_doctor.results.files import write_or_keep

    return write_or_keep(Path(directory) / DOCUMENT_FILE, dumps(report.to_dict()))
