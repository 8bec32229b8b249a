"""Run a plan of probes (backends x layouts x cases) on worker processes, per backend family.

Families run concurrently; within a family, jobs go case by case to its workers (one, unless a sweep asks
for more). Depth stacks are too large for that: a depth run takes one depth at a time, the families in
turn. Each case's float64 reference (a depth stack's too) is computed once, here in the parent, and mapped
by the workers (`shared_reference`). The local baseline always runs on the contiguous layout, because every
verdict is relative to it.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from attn_doctor.backends import BASELINE, BackendSpec, te_installed
from attn_doctor.core.case import Case
from attn_doctor.verdict.diagnosis import BASELINE_LAYOUT, judge
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.execution.pool import Worker
from attn_doctor.results.document import Row, RunReport
from attn_doctor.verdict.rule import ERROR, SKIP

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Job:
    spec: BackendSpec
    case: Case
    layout: str
    kind: str = "layout"  # "layout": one call on one layout; "tp": head shards; "depth": an L-layer stack
    params: dict = field(default_factory=dict)  # tp: {"tp", "shards_as"}; depth: {"layers", "tp"}

    @property
    def coords(self) -> dict:
        return {"probe": self.kind, **self.params} if self.kind != "layout" else {}

    @property
    def reference_layers(self) -> int | None:
        """Which reference the job is measured against: its case's attention (None) or an L-layer stack's."""
        return self.params["layers"] if self.kind == "depth" else None


@dataclass
class RunOutcome:
    rows: list[Row]
    te_facts: dict | None = None  # what the TE worker saw of TE in its own process
    startup_seconds: dict[str, float] = field(default_factory=dict)  # per family, all (re)starts
    reference_seconds: float = 0.0  # computing the shared references in the parent


def plan_jobs(cases: list[Case], specs: list[BackendSpec], layouts: list[str]) -> list[Job]:
    jobs: list[Job] = []
    baseline = BackendSpec(BASELINE, "local")
    for case in cases:
        jobs.append(Job(baseline, case, BASELINE_LAYOUT))
        for spec in specs:
            for layout in layouts:
                if spec.name == BASELINE and layout == BASELINE_LAYOUT:
                    continue
                jobs.append(Job(spec, case, layout))
    return jobs


def plan_tp_jobs(case: Case, specs: list[BackendSpec], degrees: list[int]) -> list[Job]:
    """Per backend and TP degree t: the t shards as views of the full tensors and as contiguous copies."""
    jobs = [Job(BackendSpec(BASELINE, "local"), case, BASELINE_LAYOUT)]
    for spec in specs:
        for tp in degrees:
            variants = [("views", "head_slice"), ("copies", "contiguous")] if tp > 1 else [("views", "contiguous")]
            for shards_as, layout in variants:
                jobs.append(Job(spec, case, layout, "tp", {"tp": tp, "shards_as": shards_as}))
    return jobs


DEPTH_LAYOUT = "sbh3d_packed"  # the stack feeds attention Megatron's split of the mixed qkv tensor


def plan_depth_jobs(case: Case, specs: list[BackendSpec], depths: list[int], degrees: list[int]) -> list[Job]:
    jobs = []
    for layers in depths:
        jobs.append(Job(BackendSpec(BASELINE, "local"), case, DEPTH_LAYOUT, "depth", {"layers": layers, "tp": 1}))
        for spec in specs:
            for tp in degrees:
                if spec.name == BASELINE and tp == 1:
                    continue
                jobs.append(Job(spec, case, DEPTH_LAYOUT, "depth", {"layers": layers, "tp": tp}))
    return jobs


def _static_skip(job: Job, device: str) -> str | None:
    if job.spec.family == "te":
        if not device.startswith("cuda"):
            return "TE attention needs a CUDA GPU; this run is on the CPU"
        if not te_installed():
            return "transformer_engine is not installed (pip install 'attn-doctor[te]')"
    return None


def _row(job: Job, reply: dict) -> Row:
    status = reply.get("status", "error")
    verdict = {"ok": "", "skip": SKIP}.get(status, ERROR)
    metrics = {name: TensorMetrics(**m) for name, m in reply.get("metrics", {}).items()}
    return Row(
        backend=job.spec.name,
        family=job.spec.family,
        layout=job.layout,
        case=job.case,
        verdict=verdict,
        ran=reply.get("ran", ""),
        reason=reply.get("reason", ""),
        detail=reply.get("detail", ""),
        metrics=metrics,
        seconds=reply.get("seconds", {}),
        options=job.spec.options,
        coords=job.coords,
        extra=reply.get("extra", {}),
    )


def run_jobs(
    jobs: list[Job],
    device: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_row: Callable[[Row], None] | None = None,
) -> RunOutcome:
    """Execute every job and return judged rows in the order of `jobs`."""
    with Session(device, timeout_s) as session:
        rows = session.run(jobs, on_row=on_row)
        return RunOutcome(rows=rows, te_facts=session.te_facts, startup_seconds=session.startup_seconds,
                          reference_seconds=session.references.seconds)


class Session:
    """Worker processes kept across groups of jobs (a sweep's grid points): `workers_per_family` per backend
    family. A family's jobs go to its workers one (group, case) at a time, so a worker builds each case's
    inputs and maps its shared reference once; families, and the workers of a family, run concurrently."""

    def __init__(self, device: str, timeout_s: float = DEFAULT_TIMEOUT_S, workers_per_family: int = 1):
        from attn_doctor.execution.shared_reference import ReferenceStore

        self.device = device
        self.timeout_s = timeout_s
        self.workers_per_family = max(1, workers_per_family)
        self.workers: dict[str, list[Worker]] = {}
        self.references = ReferenceStore(device)  # one float64 reference per case, shared with the workers

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for family in self.workers.values():
            for worker in family:
                worker.close()
        self.references.clear()

    @property
    def te_facts(self) -> dict | None:
        for worker in self.workers.get("te", []):
            if worker.hello:
                return worker.hello.get("te_facts")
        return None

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Per family, the slowest worker's start-up (they start in parallel), restarts included."""
        return {family: max(w.startup_seconds for w in workers) for family, workers in self.workers.items()}

    def run(self, jobs: list[Job], on_row: Callable[[Row], None] | None = None) -> list[Row]:
        """Execute every job and return judged rows in the order of `jobs`."""
        return self.run_groups([jobs], on_row=on_row)[0]

    def run_groups(
        self,
        groups: list[list[Job]],
        on_row: Callable[[Row], None] | None = None,
        on_group: Callable[[int, list[Row]], None] | None = None,
    ) -> list[list[Row]]:
        """Execute groups of jobs (each judged on its own, e.g. one sweep point) without waiting for one
        group to finish before the next starts. `on_group(index, rows)` is called as each group completes;
        callbacks run one at a time. Returns each group's judged rows, in order."""
        results: list[dict[int, Row]] = [{} for _ in groups]
        judged: list[list[Row] | None] = [None] * len(groups)
        lock = threading.Lock()
        units: dict[str, list[tuple[int, list[int]]]] = {}  # family -> [(group, job indices)], in order

        def finish(group: int, index: int, row: Row) -> None:
            with lock:
                results[group][index] = row
                if on_row:
                    on_row(row)
                if len(results[group]) == len(groups[group]):
                    judged[group] = judge([results[group][i] for i in range(len(groups[group]))])
                    if on_group:
                        on_group(group, judged[group])

        for group, jobs in enumerate(groups):
            for index, job in enumerate(jobs):
                reason = _static_skip(job, self.device)
                if reason is not None:
                    finish(group, index, Row(job.spec.name, job.spec.family, job.layout, job.case, SKIP,
                                             reason=reason, options=job.spec.options, coords=job.coords))
                    continue
                family_units = units.setdefault(job.spec.family, [])
                if not family_units or family_units[-1][0] != group:
                    family_units.append((group, []))
                family_units[-1][1].append(index)
                self.references.expect(job.case, job.reference_layers)

        # Depth stacks hold tens of GiB each on the GPU: those run one family, one worker at a time.
        depth = any(job.kind == "depth" for jobs in groups for job in jobs)
        per_family = 1 if depth else self.workers_per_family
        for family, family_units in units.items():
            pool = self.workers.setdefault(family, [])
            while len(pool) < min(per_family, len(family_units)):
                pool.append(Worker(family, self.device, self.timeout_s))

        stop = threading.Event()  # set when the caller is interrupted: finish the jobs in flight, start none

        def start(worker: Worker) -> threading.Thread:
            # The worker starts (TE import: seconds) while the parent computes the reference.
            thread = threading.Thread(target=worker.ensure_started, daemon=True)
            thread.start()
            return thread

        def serve(worker: Worker, todo: queue.Queue, starting: threading.Thread | None = None) -> None:
            while not stop.is_set():
                try:
                    group, indices = todo.get_nowait()
                except queue.Empty:
                    return
                starting = starting or start(worker)
                for index in indices:
                    if stop.is_set():
                        return
                    job = groups[group][index]
                    message = {"op": "run", "kind": job.kind, "params": job.params, "backend": job.spec.to_dict(),
                               "case": job.case.to_dict(), "layout": job.layout,
                               "reference": self.references.handle(job.case, job.reference_layers)}
                    starting.join()
                    try:
                        reply = worker.request(message)
                    finally:
                        self.references.done(job.case, job.reference_layers)
                    finish(group, index, _row(job, reply))

        def serve_family(family: str) -> None:
            todo: queue.Queue = queue.Queue()
            for unit in units[family]:
                todo.put(unit)
            pool = self.workers[family][:per_family]
            with ThreadPoolExecutor(max_workers=len(pool)) as threads:
                for future in [threads.submit(serve, worker, todo) for worker in pool]:
                    future.result()

        def serve_depth() -> None:
            # One stack reference at a time: every family measures a depth before the next depth is built.
            starting = {family: start(self.workers[family][0]) for family in units}
            for family, unit in _depth_steps(groups, units):
                todo: queue.Queue = queue.Queue()
                todo.put(unit)
                serve(self.workers[family][0], todo, starting[family])

        with ThreadPoolExecutor(max_workers=max(1, len(units))) as families:
            try:
                futures = [families.submit(serve_depth)] if depth else [families.submit(serve_family, f) for f in units]
                for future in futures:
                    future.result()
            except BaseException:  # Ctrl-C included
                stop.set()
                raise
        return [rows if rows is not None else [] for rows in judged]


def _depth_steps(groups: list[list[Job]], units: dict[str, list[tuple[int, list[int]]]]) -> list[tuple[str, tuple[int, list[int]]]]:
    """A depth run's order: per group and depth, each family's jobs at that depth, families in turn."""
    steps = []
    for group, jobs in enumerate(groups):
        for layers in dict.fromkeys(job.reference_layers for job in jobs):
            for family, family_units in units.items():
                indices = [i for g, unit in family_units if g == group for i in unit if jobs[i].reference_layers == layers]
                if indices:
                    steps.append((family, (group, indices)))
    return steps


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        from attn_doctor.core.errors import BadInput

        raise BadInput(f"--device {name}: torch sees no CUDA GPU here; use --device cpu or auto")
    return name


def diagnose(
    cases: list[Case],
    specs: list[BackendSpec],
    layouts: list[str],
    device: str,
    *,
    command: str,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_row: Callable[[Row], None] | None = None,
) -> RunReport:
    """The whole `run`: probes, verdicts, faulty paths, the summary sentence and the environment."""
    import time

    start = time.perf_counter()
    outcome = run_jobs(plan_jobs(cases, specs, layouts), device, timeout_s=timeout_s, on_row=on_row)
    probes_s = time.perf_counter() - start
    report = finish_report(outcome.rows, device, command, te_facts=outcome.te_facts)
    report.seconds = profile(outcome, probes_s, time.perf_counter() - start)
    return report


def profile(outcome: RunOutcome, probes_s: float, total_s: float) -> dict[str, float]:
    """Where the time went. Families run concurrently, so per-family sums can exceed the wall time."""
    in_workers: dict[tuple, float] = {}  # opening the shared reference, or computing it where sharing failed
    kernels = compare = 0.0
    for row in outcome.rows:
        in_workers[(row.family, row.case.key(), tuple(sorted(row.coords.items())))] = row.seconds.get("reference", 0.0)
        kernels += row.seconds.get("kernel", 0.0)
        compare += row.seconds.get("compare", 0.0)
    seconds = {f"worker start ({family})": s for family, s in outcome.startup_seconds.items()}
    seconds.update({"reference (once per case)": outcome.reference_seconds,
                    "reference (in the workers)": sum(in_workers.values()), "kernels": kernels, "comparison": compare,
                    "probes (wall)": probes_s, "env + verdicts": total_s - probes_s, "diagnose (wall)": total_s})
    return seconds


def finish_report(rows: list[Row], device: str, command: str, te_facts: dict | None) -> RunReport:
    """Judged rows -> the results document: faulty paths, summary sentence, environment."""
    import datetime

    from attn_doctor import __version__
    from attn_doctor.verdict.diagnosis import find_faulty, summarize
    from attn_doctor.machine.fingerprint import collect_env

    env = collect_env(te_facts=te_facts, probe_te=te_facts is None and te_installed())
    faulty = find_faulty(rows)
    return RunReport(
        command=command,
        device=device,
        env=env,
        rows=rows,
        faulty=faulty,
        summary=summarize(rows, faulty),
        tool_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
