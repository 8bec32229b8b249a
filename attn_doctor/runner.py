"""Run a plan of probes (backends x layouts x cases) on worker processes, one worker per backend family.

Families run concurrently; within a family, jobs go case by case so each worker computes a case's
inputs and float64 reference once. The local baseline always runs on the contiguous layout, because
every verdict is relative to it.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from attn_doctor.backends import BASELINE, BackendSpec, te_installed
from attn_doctor.case import Case
from attn_doctor.diagnosis import BASELINE_LAYOUT, judge
from attn_doctor.metrics import TensorMetrics
from attn_doctor.pool import Worker
from attn_doctor.results import Row, RunReport
from attn_doctor.verdict import ERROR, SKIP

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


@dataclass
class RunOutcome:
    rows: list[Row]
    te_facts: dict | None = None  # what the TE worker saw of TE in its own process
    startup_seconds: dict[str, float] = field(default_factory=dict)  # per family, all (re)starts


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
        return RunOutcome(rows=rows, te_facts=session.te_facts,
                          startup_seconds={f: w.startup_seconds for f, w in session.workers.items()})


class Session:
    """Worker processes kept across groups of jobs (a sweep's grid points), one per backend family."""

    def __init__(self, device: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.device = device
        self.timeout_s = timeout_s
        self.workers: dict[str, Worker] = {}

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()

    @property
    def te_facts(self) -> dict | None:
        worker = self.workers.get("te")
        return (worker.hello or {}).get("te_facts") if worker and worker.hello else None

    def run(self, jobs: list[Job], on_row: Callable[[Row], None] | None = None) -> list[Row]:
        """Execute every job (families concurrently) and return judged rows in the order of `jobs`."""
        results: dict[int, Row] = {}
        by_family: dict[str, list[int]] = {}
        for index, job in enumerate(jobs):
            reason = _static_skip(job, self.device)
            if reason is not None:
                results[index] = Row(job.spec.name, job.spec.family, job.layout, job.case, SKIP, reason=reason,
                                     options=job.spec.options, coords=job.coords)
                if on_row:
                    on_row(results[index])
            else:
                by_family.setdefault(job.spec.family, []).append(index)
        for family in by_family:
            self.workers.setdefault(family, Worker(family, self.device, self.timeout_s))

        def serve(family: str) -> None:
            worker = self.workers[family]
            for index in by_family[family]:
                job = jobs[index]
                reply = worker.request({
                    "op": "run", "kind": job.kind, "params": job.params, "backend": job.spec.to_dict(),
                    "case": job.case.to_dict(), "layout": job.layout,
                })
                results[index] = _row(job, reply)
                if on_row:
                    on_row(results[index])

        # Depth stacks hold tens of GiB each on the GPU: run those one family at a time.
        parallel = not any(job.kind == "depth" for job in jobs)
        with ThreadPoolExecutor(max_workers=max(1, len(by_family)) if parallel else 1) as pool:
            for future in [pool.submit(serve, family) for family in by_family]:
                future.result()
        return judge([results[i] for i in range(len(jobs))])


def resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        from attn_doctor.errors import BadInput

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
    reference: dict[tuple, float] = {}
    kernels = compare = 0.0
    for row in outcome.rows:
        reference[(row.family, row.case.key(), tuple(sorted(row.coords.items())))] = row.seconds.get("reference", 0.0)
        kernels += row.seconds.get("kernel", 0.0)
        compare += row.seconds.get("compare", 0.0)
    seconds = {f"worker start ({family})": s for family, s in outcome.startup_seconds.items()}
    seconds.update({"reference": sum(reference.values()), "kernels": kernels, "comparison": compare,
                    "probes (wall)": probes_s, "env + verdicts": total_s - probes_s, "diagnose (wall)": total_s})
    return seconds


def finish_report(rows: list[Row], device: str, command: str, te_facts: dict | None) -> RunReport:
    """Judged rows -> the results document: faulty paths, summary sentence, environment."""
    import datetime

    from attn_doctor import __version__
    from attn_doctor.diagnosis import find_faulty, summarize
    from attn_doctor.env import collect_env

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
