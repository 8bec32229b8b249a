"""Launching a distributed probe: `python -m torch.distributed.run --standalone --nproc-per-node N -m
attn_doctor.distributed.rank JOB.json` (PyTorch's own launcher and process groups: gloo on the CPU, NCCL
on CUDA with rank r on cuda:LOCAL_RANK), watched, and read back from what rank 0 wrote.

Every rank builds the full-size inputs from the case's seed; rank 0 gathers every rank's out/dq/dk/dv
shard, reassembles the full tensors and measures them against float64, and against a single-process run
of the same backend and of the local baseline on the full tensors (`rank.py`, `analysis.py`).

A rank that dies, raises or hangs ends its probe as an ERROR outcome whose reason names the rank (from
each rank's progress file and torchrun's failure report); a hang past `timeout_s` kills torchrun's and
every rank's process group, so nothing outlives the launch.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attn_doctor.backends import BackendSpec
from attn_doctor.core import processes
from attn_doctor.core.case import Case
from attn_doctor.core.coords import BadGrid, Coords, check_grid
from attn_doctor.distributed.grid import PROGRESS_PREFIX
from attn_doctor.distributed.outcome import DistributedOutcome, outcome_from_result
from attn_doctor.execution.pool import STARTUP_TIMEOUT_S
from attn_doctor.probes.plan import static_skip

KILL_GRACE_S = 5.0  # after SIGTERM to torchrun, before SIGKILL to everything
POLL_S = 0.1


# ---------------------------------------------------------------------------------------------------
# launching


def check_launchable(nproc: int, tp: int, cp: int, cp_comm_type: str | None, device: str) -> None:
    """Refuse a launch that cannot work whatever the case (BadInput)."""
    check_grid(tp, cp, cp_comm_type, nproc)
    if not (device == "cpu" or device.startswith("cuda")):
        raise BadGrid(f"--device {device!r}: distributed runs use cpu (gloo) or cuda (NCCL, rank r on cuda:r)")


def launch(spec: BackendSpec, case: Case, *, nproc: int, tp: int, cp: int, cp_comm_type: str | None = "p2p",
           device: str = "cpu", timeout_s: float = 300.0) -> DistributedOutcome:
    """Run one backend on one case on N = tp * cp ranks and return what rank 0 measured."""
    return launch_many([(spec, case)], nproc=nproc, tp=tp, cp=cp, cp_comm_type=cp_comm_type, device=device,
                       timeout_s=timeout_s)[0]


def launch_many(requests: list[tuple[BackendSpec, Case]], *, nproc: int, tp: int, cp: int,
                cp_comm_type: str | None = "p2p", device: str = "cpu",
                timeout_s: float = 300.0) -> list[DistributedOutcome]:
    """Several (backend, case) probes on one rank grid, in as few torchrun launches as possible.

    `timeout_s` bounds each probe (from the moment its first rank starts it) and, at least
    STARTUP_TIMEOUT_S, the start-up. A probe that crashes or hangs becomes an ERROR outcome and the rest
    run in a fresh launch."""
    check_launchable(nproc, tp, cp, cp_comm_type, device)
    coords = [Coords.distributed(case, spec, tp, cp, cp_comm_type) for spec, case in requests]
    outcomes: list[DistributedOutcome | None] = [None] * len(coords)
    pending = []
    for index, c in enumerate(coords):
        why = static_skip(c, device)
        if why is not None:
            outcomes[index] = DistributedOutcome(c, device, status="skip", reason=why)
        else:
            pending.append(index)
    while pending:
        started = time.perf_counter()
        results, failure = _launch_once([coords[i] for i in pending], device=device, timeout_s=timeout_s)
        wall = time.perf_counter() - started
        for index, result in zip(pending, results):
            outcomes[index] = outcome_from_result(coords[index], device, result)
            outcomes[index].seconds["launch (wall)"] = wall
        done = len(results)
        if failure is None:
            for index in pending[done:]:  # torchrun ended cleanly without answering (should not happen)
                outcomes[index] = DistributedOutcome(coords[index], device, status="error",
                                                     reason="the ranks ended without reporting this probe")
            break
        failed_at, reason, detail = failure
        if failed_at is None:  # the launch failed before any probe started: nothing would go better again
            for index in pending[done:]:
                outcomes[index] = DistributedOutcome(coords[index], device, status="error", reason=reason,
                                                     detail=detail)
            break
        index = pending[failed_at]
        outcomes[index] = DistributedOutcome(coords[index], device, status="error", reason=reason, detail=detail)
        pending = pending[failed_at + 1:]
    return outcomes  # type: ignore[return-value]


_FAILURE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def parse_torchrun_failures(text: str) -> tuple[dict[int, int], int | None]:
    """({global rank: exit code}, root-cause rank) from torchrun's ChildFailedError report."""
    codes = {int(m.group(1)): int(m.group(3)) for m in _FAILURE.finditer(text)}
    root = None
    head, sep, tail = text.partition("Root Cause")
    if sep:
        m = _FAILURE.search(tail)
        root = int(m.group(1)) if m else None
    return codes, root


class _Launch:
    """One torchrun process and the files its ranks write into `folder`."""

    def __init__(self, folder: Path, nproc: int):
        self.folder = folder
        self.nproc = nproc
        self.proc: subprocess.Popen | None = None

    def progress(self) -> dict[int, dict]:
        found = {}
        for rank in range(self.nproc):
            path = self.folder / f"{PROGRESS_PREFIX}{rank}.json"
            try:
                found[rank] = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                continue  # not written yet, or being replaced this instant
        return found

    def log_tail(self, name: str, lines: int = 20) -> str:
        try:
            text = (self.folder / name).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def kill(self, graceful: bool = True) -> None:
        """Stop torchrun's process group (SIGTERM first when `graceful`: torchrun then stops its ranks), then
        SIGKILL every rank's process group (torchrun starts each rank in its own session)."""
        proc = self.proc
        if proc is None:
            return
        if graceful:
            processes.stop(proc, KILL_GRACE_S)
        else:
            processes.kill_group(proc)
        for state in self.progress().values():
            pid = state.get("pid")
            if isinstance(pid, int) and pid > 1 and pid != os.getpid():
                processes.signal_group(pid, signal.SIGKILL, only_if_leader=True)


def _launch_once(coords: list[Coords], *, device: str,
                 timeout_s: float) -> tuple[list[dict], tuple[int | None, str, str] | None]:
    """(results of the probes rank 0 finished, in order; None or (index of the failed probe, or None when
    no probe had started, reason, detail))."""
    first = coords[0]
    nproc = first.nproc
    with tempfile.TemporaryDirectory(prefix="attn-doctor-ranks-") as tmp:
        folder = Path(tmp)
        output = folder / "results.json"
        job = {
            "probes": [c.to_dict() for c in coords],
            "nproc": nproc, "tp": first.tp, "cp": first.cp, "cp_comm_type": first.cp_comm_type, "device": device,
            "folder": str(folder), "output": str(output), "timeout_s": timeout_s,
        }
        job_path = folder / "job.json"
        job_path.write_text(json.dumps(job))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   "-m", "attn_doctor.distributed.rank", str(job_path)]
        launch = _Launch(folder, nproc)
        hung: str | None = None
        with open(folder / "torchrun.log", "wb") as log:
            try:
                # The lent multi-GPU machines require NVLink multicast off.
                launch.proc = processes.start(command, stdout=log, stderr=subprocess.STDOUT,
                                              env=processes.child_env({"NCCL_NVLS_ENABLE": "0"}))
                hung = _watch(launch, timeout_s)
            except BaseException:  # Ctrl-C included: never leave ranks behind, and answer at once
                launch.kill(graceful=False)
                raise
            if hung is not None or launch.proc.poll() is None:
                launch.kill()
            processes.wait(launch.proc)
        results = _read_results(output)
        if len(results) >= len(coords):
            return results[:len(coords)], None  # every probe answered; anything after them does not matter
        progress = launch.progress()
        started = any(s.get("probe", -1) >= len(results) for s in progress.values())
        failed_at = len(results) if started else None
        if hung is not None:
            reason, culprits = hung, [r for r, s in progress.items() if not s.get("collective")]
        else:
            reason, culprits = _death_reason(launch, progress, launch.proc.returncode)
        if failed_at is None:
            reason = f"before the first probe: {reason}"
        return results, (failed_at, reason, _detail(launch, culprits, torchrun=hung is None))


def _read_results(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []


def _watch(launch: _Launch, timeout_s: float) -> str | None:
    """Wait for torchrun; the reason if a probe (or the start-up) ran past its time, else None."""
    started = time.time()
    proc = launch.proc
    assert proc is not None
    startup_limit = max(STARTUP_TIMEOUT_S, timeout_s)
    while proc.poll() is None:
        time.sleep(POLL_S)
        progress = launch.progress()
        now = time.time()
        current = [s for s in progress.values() if s.get("probe", -1) >= 0]
        if not current:
            if now - started > startup_limit:
                return _hang_reason(progress, launch.nproc, f"the start-up took more than {startup_limit:g} s")
            continue
        # The probe the slowest rank is on began when its first rank began it.
        lagging = min(progress.get(r, {}).get("probe", -1) for r in range(launch.nproc))
        at_lagging = [s for s in current if s["probe"] == lagging] or current
        if now - min(s["probe_t0"] for s in at_lagging) > timeout_s:
            return _hang_reason(progress, launch.nproc, f"no result within --timeout {timeout_s:g} s")
    return None


def _where(state: dict) -> str:
    probe = state.get("probe", -1)
    at = f" of probe {probe}" if probe >= 0 else ""
    return f"{state.get('stage', '?')}{at}"


def _hang_reason(progress: dict[int, dict], nproc: int, what: str) -> str:
    missing = [r for r in range(nproc) if r not in progress]
    stuck = [r for r, s in sorted(progress.items()) if not s.get("collective") and not s.get("finished")]
    waiting = [r for r, s in sorted(progress.items()) if s.get("collective")]
    parts = []
    if stuck:
        parts.append("; ".join(f"rank {r} stuck in {_where(progress[r])}" for r in stuck))
    if missing:
        parts.append(f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never started")
    if waiting:
        parts.append("; ".join(f"rank {r} waiting in {_where(progress[r])}" for r in waiting))
    if not stuck and not missing:
        parts.insert(0, "every rank waiting in a collective")
    return f"hung: {what} ({'; '.join(parts)}); torchrun and all ranks killed"


def _death_reason(launch: _Launch, progress: dict[int, dict], code: int | None) -> tuple[str, list[int]]:
    """Which rank died or failed first, from the ranks' progress files and torchrun's failure report."""
    report = launch.log_tail("torchrun.log", lines=400)
    codes, root = parse_torchrun_failures(report)
    errors = {r: s for r, s in progress.items() if s.get("error")}
    # A rank that raised outside a collective, or died without a word, is at fault; a rank that failed
    # inside a collective (its peer vanished) or was stopped by torchrun (SIGTERM) is collateral.
    raised = [r for r, s in sorted(errors.items()) if not s.get("collective")]
    silent = [r for r, c in sorted(codes.items())
              if r not in errors and c != -signal.SIGTERM and not progress.get(r, {}).get("collective")
              and not progress.get(r, {}).get("finished")]
    culprits = raised + [r for r in silent if r not in raised]
    if not culprits and root is not None:
        culprits = [root]
    if not culprits:
        culprits = sorted(codes) or sorted(errors)
    parts = []
    for r in culprits:
        state = progress.get(r)
        how = f"failed ({state['error']})" if state and state.get("error") else \
            f"died ({processes.describe_exit(codes[r])})" if r in codes else "failed"
        where = f" in {_where(state)}" if state else " before reporting any progress"
        parts.append(f"rank {r} {how}{where}")
    others = [r for r in sorted(set(codes) | set(errors)) if r not in culprits]
    tail = f"; torchrun then stopped rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}" if others else ""
    if not parts:
        last = report.strip().splitlines()[-1] if report.strip() else ""
        return f"torchrun failed ({processes.describe_exit(code) if code is not None else 'no exit code'}): {last}", []
    return "; ".join(parts) + tail, culprits


def _detail(launch: _Launch, culprits: list[int], torchrun: bool = True) -> str:
    """The failing ranks' own output, and torchrun's failure report (not after a kill: then it only shows
    torchrun's reaction to our SIGTERM)."""
    tails = []
    for r in culprits:
        tail = launch.log_tail(f"rank{r}.log")
        if tail:
            tails.append(f"--- rank {r} ---\n{tail}")
    torchrun = torchrun and launch.log_tail("torchrun.log", lines=12)
    if torchrun:
        tails.append(f"--- torchrun ---\n{torchrun}")
    return "\n".join(tails)
