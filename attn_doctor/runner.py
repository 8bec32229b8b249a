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


@dataclass
class RunOutcome:
    rows: list[Row]
    te_facts: dict | None = None  # what the TE worker saw of TE in its own process
    worker_starts: dict[str, int] = field(default_factory=dict)


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
    )


def run_jobs(
    jobs: list[Job],
    device: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    on_row: Callable[[Row], None] | None = None,
) -> RunOutcome:
    """Execute every job and return judged rows in the order of `jobs`."""
    results: dict[int, Row] = {}
    by_family: dict[str, list[int]] = {}
    for index, job in enumerate(jobs):
        reason = _static_skip(job, device)
        if reason is not None:
            results[index] = Row(job.spec.name, job.spec.family, job.layout, job.case, SKIP, reason=reason)
            if on_row:
                on_row(results[index])
        else:
            by_family.setdefault(job.spec.family, []).append(index)

    workers = {family: Worker(family, device, timeout_s) for family in by_family}

    def serve(family: str) -> None:
        worker = workers[family]
        try:
            for index in by_family[family]:
                job = jobs[index]
                reply = worker.request(
                    {"op": "run", "backend": job.spec.to_dict(), "case": job.case.to_dict(), "layout": job.layout}
                )
                results[index] = _row(job, reply)
                if on_row:
                    on_row(results[index])
        finally:
            worker.close()

    with ThreadPoolExecutor(max_workers=max(1, len(workers))) as pool:
        for future in [pool.submit(serve, family) for family in workers]:
            future.result()

    te_worker = workers.get("te")
    rows = judge([results[i] for i in range(len(jobs))])
    return RunOutcome(
        rows=rows,
        te_facts=(te_worker.hello or {}).get("te_facts") if te_worker else None,
        worker_starts={family: w.starts for family, w in workers.items()},
    )


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
    import datetime
    import time

    from attn_doctor import __version__
    from attn_doctor.diagnosis import find_faulty, summarize
    from attn_doctor.env import collect_env

    start = time.perf_counter()
    outcome = run_jobs(plan_jobs(cases, specs, layouts), device, timeout_s=timeout_s, on_row=on_row)
    probes_s = time.perf_counter() - start
    env = collect_env(te_facts=outcome.te_facts, probe_te=outcome.te_facts is None and te_installed())
    faulty = find_faulty(outcome.rows)
    return RunReport(
        command=command,
        device=device,
        env=env,
        rows=outcome.rows,
        faulty=faulty,
        summary=summarize(outcome.rows, faulty),
        tool_version=__version__,
        created=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        seconds={"probes": probes_s, "total": time.perf_counter() - start},
    )
