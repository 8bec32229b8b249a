"""`run`: one case, every requested backend, judged against float64; in one process's workers, as TP
shards (`--tp` without `--nproc`), or on real ranks (`--nproc`). Callable without the command line."""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from attn_doctor.core.case import Case
from attn_doctor.core.coords import BackendSpec, Coords, check_grid
from attn_doctor.core.errors import BadInput
from attn_doctor.core.probe_kinds import ProbeKind, dense_api_refusal, rules_for
from attn_doctor.execution.progress import ProgressSink
from attn_doctor.core.processes import check_timeout
from attn_doctor.execution.budget import MemoryAsk
from attn_doctor.results.report import RunReport
from attn_doctor.results.row import Row

DEFAULT_TIMEOUT_S = 300.0


class RunInterrupted(Exception):
    """Ctrl-C during a run: `report` holds the probes that finished, judged."""

    def __init__(self, report: RunReport):
        super().__init__("interrupted")
        self.report = report


@dataclass
class RunRequest:
    case: Case
    specs: list[BackendSpec]
    layouts: list[str]
    device: str
    command: str = "attn-doctor run"
    timeout_s: float = DEFAULT_TIMEOUT_S
    tp: int = 1
    cp: int = 1
    cp_comm_type: str | None = None
    nproc: int | None = None  # real ranks; None: one process's workers
    layouts_given: bool = False  # --layout was given (it does not apply to TP shards)
    repeats: int = 1  # --repeats: runs of each single call on the same inputs (judged on the worst)
    notes: list[str] = field(default_factory=list)  # what attn-doctor chose for the user (the CPU sizing), kept
    memory: MemoryAsk = field(default_factory=MemoryAsk)  # --max-memory, and what was free at the start

    @property
    def kind(self) -> ProbeKind:
        """The probes the run makes: ranks with --nproc, else TP shards with --tp > 1, else single calls."""
        if self.nproc is not None:
            return ProbeKind.DISTRIBUTED
        return ProbeKind.TP if self.tp > 1 else ProbeKind.CALL

    def check(self) -> None:
        """Refuse what cannot run whatever the machine: a grid that contradicts itself, options that do not go
        together (what each kind of probe accepts: `attn_doctor.core.probe_kinds`). Every rule here leaves
        nothing silently ignored."""
        check_grid(self.tp, self.cp, self.cp_comm_type if self.cp > 1 else None, self.nproc)
        if self.nproc is None and self.cp > 1:
            raise BadInput(f"--cp {self.cp}: context parallelism runs on real ranks; add --nproc {self.tp * self.cp}")
        rules = rules_for(self.kind, self.case)
        # Ranks holding TP shards (--nproc with --tp > 1) refuse --layout in the shards' words.
        layout_rules = rules_for(ProbeKind.TP, self.case) if self.tp > 1 else rules
        if self.layouts_given and not layout_rules.takes_layout:
            raise BadInput(f"{layout_rules.layout_refusal(explained=True)}; drop --layout or {layout_rules.flag}")
        if not rules.te_api and self.case.api_features():
            raise BadInput(f"{dense_api_refusal('--tp and --nproc', self.case)}: check it as a single call (drop "
                           "--tp/--nproc)")
        if self.case.fp8 != "none" and self.device == "cpu":
            raise BadInput("FP8 attention runs on a GPU (TE's FusedAttention, sm90+); this run is on the CPU: drop "
                           "--fp8 or pass --device cuda on a GPU machine")
        check_repeats(self.repeats)
        check_timeout(self.timeout_s)
        if self.repeats > 1 and not rules.repeats:
            raise BadInput(rules.repeats_refusal(without=rules.flag))


def check_repeats(repeats: object) -> None:
    """--repeats is a whole number >= 1."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise BadInput(f"--repeats takes a whole number >= 1, got {repeats!r}")


def sized_for_cpu(request: RunRequest, given: Collection[str]) -> RunRequest:
    """The request with its case's default sizes shrunk where this CPU's matrix products in the case's dtype are
    too slow for the run to answer in about 30 s (`attn_doctor.core.cpu_sizing`; `given`: the case fields the
    user chose, kept), and a note saying so. The rate is measured (a few milliseconds) only when a size may
    shrink; probes on real ranks (--nproc) are left as they are. What cannot run as asked (bad input, more
    memory than the machine has) is refused as asked, before anything is sized."""
    from attn_doctor.core.cpu_sizing import resizable, size_for_cpu
    from attn_doctor.execution.memory_plan import plan_memory
    from attn_doctor.machine.matmul_rate import cpu_matmul_gflops

    if request.kind is ProbeKind.DISTRIBUTED or not resizable(request.case, request.device, given):
        return request
    request.check()
    probes = runnable(plan(request), request.specs, request.device, request.kind, [request.tp])
    plan_memory(probes, request.device, request.memory.budget(request.device), repeats=request.repeats)
    sizing = size_for_cpu(request.case, request.device, given, len(probes) * request.repeats,
                          cpu_matmul_gflops(request.case.dtype))
    if sizing.note is None:
        return request
    return dataclasses.replace(request, case=sizing.case, notes=[*request.notes, sizing.note])


def plan(request: RunRequest) -> list[Coords]:
    from attn_doctor.probes.plan import plan_calls, plan_tp

    if request.kind is ProbeKind.TP:
        return plan_tp(request.case, request.specs, [request.tp])
    return plan_calls(request.case, request.specs, request.layouts)


def make_report(rows: list[Row], request_specs: list[BackendSpec], device: str, command: str,
                facts: dict | None = None, read_te: bool = True, interrupted: bool = False,
                notes: list[str] | None = None, not_judged: list[str] | None = None) -> RunReport:
    """Judged rows -> the results document, with the machine's fingerprint (TE's facts from the TE worker
    when it ran, else probed in a subprocess when `read_te`)."""
    from attn_doctor import __version__
    from attn_doctor.machine.fingerprint import collect_env
    from attn_doctor.machine.te_facts import te_installed

    te_facts = (facts or {}).get("te_facts")
    env = collect_env(te_facts=te_facts, read_te=read_te and te_facts is None and te_installed())
    return RunReport(command=command, device=device, env=env, rows=rows,
                     requested=list(dict.fromkeys(spec.name for spec in request_specs)),
                     tool_version=__version__, interrupted=interrupted, notes=list(notes or []),
                     not_judged=list(not_judged or []),
                     created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))


def asked_for(coords: Coords, kind: ProbeKind, degrees: Collection[int] = (1,)) -> bool:
    """Whether a planned probe is one the request asked for (probes of `kind`, at one of the TP `degrees` where
    the kind has them), not only the reference the asked ones are measured against: a TP plan's single
    baseline call, a depth plan's TP=1 stack when TP=1 was not asked."""
    if coords.kind is not kind:
        return False
    return kind not in (ProbeKind.TP, ProbeKind.DEPTH) or coords.tp in degrees


def runnable(coords_list: list[Coords], specs: list[BackendSpec], device: str,
             kind: ProbeKind = ProbeKind.CALL, degrees: Collection[int] = (1,)) -> list[Coords]:
    """The probes that can run here. Refuses (BadInput, before any worker starts) a request none of whose
    requested probes can: every probe it asked for (`asked_for` `kind` and `degrees`; the baseline a TP or depth
    plan adds as their reference does not count) statically skipped, with the reasons. Every command that
    judges probes (run, sweep, replay) asks here."""
    from attn_doctor.execution.session import skipped_row
    from attn_doctor.probes.plan import static_skip
    from attn_doctor.verdict.diagnosis import untested

    rows, todo = [], []
    for coords in coords_list:
        reason = static_skip(coords, device)
        if asked_for(coords, kind, degrees):
            rows.append(skipped_row(coords, reason) if reason else Row(coords=coords, verdict=""))  # "": to run
        if not reason:
            todo.append(coords)
    why = untested(rows, [spec.name for spec in specs])
    if why is not None:
        raise BadInput(why)
    return todo


def run(request: RunRequest, progress: ProgressSink | None = None) -> RunReport:
    """The whole `run`: probes, verdicts and the environment, in a results document."""
    request.check()
    if request.kind is ProbeKind.DISTRIBUTED:
        return run_distributed(request, progress)
    from attn_doctor.execution.memory_plan import plan_memory
    from attn_doctor.execution.session import Session

    coords = plan(request)
    budget = request.memory.budget(request.device)
    memory = plan_memory(runnable(coords, request.specs, request.device, request.kind, [request.tp]), request.device,
                         budget, repeats=request.repeats)  # refused here, before anything starts, if it cannot fit
    progress = progress or ProgressSink()
    start = time.perf_counter()
    progress.begin(len(coords), "probes")
    try:
        with Session(request.device, request.timeout_s, progress=progress, repeats=request.repeats,
                     budget=budget) as session:
            rows = session.run(coords, on_row=lambda row: progress.advance(1, f"{row.backend} {row.layout}"))
            facts, startup = session.facts, session.startup_seconds
            reference_s = session.references.seconds
            memory = session.plan or memory
    except KeyboardInterrupt as exc:
        progress.end()
        finished = getattr(exc, "finished_rows", [])
        raise RunInterrupted(make_report(finished, request.specs, request.device, request.command, read_te=False,
                                         interrupted=True, notes=request.notes)) from None
    progress.end()
    probes_s = time.perf_counter() - start
    report = make_report(rows, request.specs, request.device, request.command, facts,
                         notes=[*request.notes, *([memory.fewer] if memory.fewer else [])])
    report.memory = memory.to_dict()
    report.seconds = profile(rows, startup, reference_s, probes_s, time.perf_counter() - start)
    return report


def run_distributed(request: RunRequest, progress: ProgressSink | None = None) -> RunReport:
    """`run --nproc`: each backend on N torchrun ranks, judged against the baseline rank 0 measured."""
    from attn_doctor import distributed

    comm = request.cp_comm_type if request.cp > 1 else None
    distributed.check_launchable(request.nproc, request.tp, request.cp, comm, request.device)
    runnable([Coords.distributed(request.case, spec, request.tp, request.cp, comm) for spec in request.specs],
             request.specs, request.device, ProbeKind.DISTRIBUTED)
    progress = progress or ProgressSink()
    progress.begin(len(request.specs), f"probes on {request.nproc} ranks")
    outcomes = distributed.launch_many([(spec, request.case) for spec in request.specs], nproc=request.nproc,
                                       tp=request.tp, cp=request.cp, cp_comm_type=comm, device=request.device,
                                       timeout_s=request.timeout_s)
    progress.end()
    return make_report(distributed.judged_rows(outcomes), request.specs, request.device, request.command)


def profile(rows: list[Row], startup: dict[str, float], reference_s: float, probes_s: float,
            total_s: float) -> dict[str, float]:
    """Where the time went. Families run concurrently, so per-family sums can exceed the wall time."""
    in_workers: dict[tuple, float] = {}  # opening the shared reference, or computing it where sharing failed
    kernels = kernels_cpu = compare = flash_style = 0.0
    for row in rows:
        in_workers[(row.family, row.coords.baseline_key())] = row.seconds.get("reference", 0.0)
        kernels += row.seconds.get("kernel", 0.0)
        kernels_cpu += row.seconds.get("kernel_cpu", 0.0)
        compare += row.seconds.get("compare", 0.0)
        flash_style += row.seconds.get("flash_style", 0.0)
    seconds = {f"worker start ({family})": s for family, s in startup.items()}
    seconds.update({"reference (once per case)": reference_s,
                    "reference (in the workers)": sum(in_workers.values()),
                    "flash-style part (once per case)": flash_style, "kernels": kernels,
                    "kernels, on a CPU": kernels_cpu, "comparison": compare,
                    "probes (wall)": probes_s, "env + verdicts": total_s - probes_s, "diagnose (wall)": total_s})
    return seconds
