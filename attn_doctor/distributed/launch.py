"""Real tensor and context parallelism: launch N ranks with torchrun, gather their shards, judge them.

`launch` starts `python -m torch.distributed.run --standalone --nproc-per-node N -m
attn_doctor.distributed.rank JOB.json` (PyTorch's own launcher and process groups: gloo on the CPU,
NCCL on CUDA with rank r on cuda:LOCAL_RANK) and reads back what rank 0 wrote. What each rank does is
described in distributed_rank.py; in short:

* Ranks form a tp x cp grid, TP fastest (Megatron's order): rank = cp_rank * tp + tp_rank, so a TP
  group is `tp` consecutive ranks and a CP group is the ranks tp_rank, tp_rank + tp, ... Both are real
  process groups (torch.distributed.new_group).
* TP splits the query heads and the key/value heads into tp equal shards (both must divide).
* CP splits the sequence load-balanced as TE expects: 2*cp chunks, CP rank c holds chunks c and
  2*cp-1-c, in that order.
* Every rank builds the full-size inputs from the case's seed; rank 0 gathers every rank's out/dq/dk/dv
  shard, reassembles the full tensors and measures them against float64, and against a single-process
  run of the same backend and of the local baseline on the full tensors (all on rank 0).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn_doctor.backends import BASELINE, BackendSpec, te_installed
from attn_doctor.core.case import Case, tp_unsupported
from attn_doctor.core.errors import BadInput
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.execution.pool import STARTUP_TIMEOUT_S, child_env, describe_exit
from attn_doctor.results.document import Row
from attn_doctor.verdict.rule import ERROR, FAIL, PASS, SKIP, TensorVerdict, judge_tensor

COMM_TYPES = ("all_gather", "p2p", "a2a")
RANK_LAYOUT = "tp fastest (Megatron order): rank = cp_rank * tp + tp_rank"
CP_SPLIT = "load-balanced: 2*cp sequence chunks, CP rank c holds chunks c and 2*cp-1-c"
KILL_GRACE_S = 5.0  # after SIGTERM to torchrun, before SIGKILL to everything
POLL_S = 0.1
PROGRESS_PREFIX = "progress."
TENSORS = ("out", "dq", "dk", "dv")


class BadLayout(BadInput, ValueError):
    """A rank grid that cannot be launched (N != tp * cp, unknown comm type, ...)."""


# ---------------------------------------------------------------------------------------------------
# the rank grid (pure Python: the rank program uses the same functions)


def grid_position(rank: int, tp: int) -> tuple[int, int]:
    """(tp_rank, cp_rank) of a global rank; TP is the fastest-varying dimension."""
    return rank % tp, rank // tp


def tp_group_ranks(tp: int, cp: int) -> list[list[int]]:
    return [[c * tp + t for t in range(tp)] for c in range(cp)]


def cp_group_ranks(tp: int, cp: int) -> list[list[int]]:
    return [[c * tp + t for c in range(cp)] for t in range(tp)]


def cp_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of 2*cp sequence chunks CP rank `cp_rank` holds (TE's load-balanced causal split)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def cp_positions(seq: int, cp: int, cp_rank: int) -> list[int]:
    """Global sequence positions of CP rank `cp_rank`'s tokens, in the order the rank holds them."""
    chunk = seq // (2 * cp)
    first, second = cp_chunks(cp, cp_rank)
    return list(range(first * chunk, (first + 1) * chunk)) + list(range(second * chunk, (second + 1) * chunk))


def validate_grid(nproc: int, tp: int, cp: int, cp_comm_type: str | None, device: str) -> None:
    """Refuse a launch that cannot work whatever the case (BadLayout, a BadInput and a ValueError)."""
    for name, value in (("nproc", nproc), ("tp", tp), ("cp", cp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadLayout(f"--{name} must be a whole number >= 1, got {value!r}")
    if nproc != tp * cp:
        raise BadLayout(f"--nproc {nproc} must equal --tp {tp} x --cp {cp} = {tp * cp}: the ranks form a tp x cp grid")
    if cp > 1 and cp_comm_type not in COMM_TYPES:
        hint = " (TE's hierarchical a2a+p2p needs two CP levels; not supported)" if cp_comm_type == "a2a+p2p" else ""
        raise BadLayout(f"--cp-comm-type {cp_comm_type!r}: choose one of {', '.join(COMM_TYPES)}{hint}")
    if not (device == "cpu" or device.startswith("cuda")):
        raise BadLayout(f"--device {device!r}: distributed runs use cpu (gloo) or cuda (NCCL, rank r on cuda:r)")


def case_unsupported(spec: BackendSpec, case: Case, tp: int, cp: int, cp_comm_type: str | None,
                     device: str) -> str | None:
    """Why this (backend, case) cannot run on the grid, known before launching: a SKIP reason."""
    why_not = tp_unsupported(case, tp)
    if why_not:
        return why_not
    if cp > 1:
        if case.seq_k != case.seq:
            return f"CP={cp} splits one sequence for q, k and v: it needs self-attention (seq_kv == seq)"
        if case.seq % (2 * cp):
            return f"CP={cp} splits the sequence into {2 * cp} equal chunks: seq ({case.seq}) must be divisible by {2 * cp}"
        if cp_comm_type == "a2a" and ((case.heads // tp) % cp or (case.num_kv_heads // tp) % cp):
            return (f"CP a2a regroups heads over {cp} ranks: heads per TP rank ({case.heads // tp}) and kv heads "
                    f"per TP rank ({case.num_kv_heads // tp}) must be divisible by {cp}")
    if spec.family == "te":
        if not device.startswith("cuda"):
            return "TE attention needs a CUDA GPU; this run is on the CPU"
        if not te_installed():
            return "transformer_engine is not installed (pip install 'attn-doctor[te]')"
    return None


def parallel_label(tp: int, cp: int, cp_comm_type: str | None, nproc: int) -> str:
    parts = ([f"TP {tp}"] if tp > 1 else []) + ([f"CP {cp_comm_type}"] if cp > 1 else [])
    ranks = f"{nproc} rank{'s' if nproc > 1 else ''}"
    return f"{' + '.join(parts)}, {ranks}" if parts else ranks


# ---------------------------------------------------------------------------------------------------
# outcomes


@dataclass
class RankShard:
    """One rank's own shard of out/dq/dk/dv against the same slice of float64 and of the baselines."""

    rank: int
    tp_rank: int
    cp_rank: int
    ran: str = ""
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    baseline_metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # local baseline, same slice
    vs_single: dict[str, float] = field(default_factory=dict)  # ||shard - single-process slice|| / ||slice||
    verdicts: dict[str, TensorVerdict] = field(default_factory=dict)

    @property
    def failing(self) -> list[str]:
        return [name for name, v in self.verdicts.items() if v.verdict == FAIL]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "tp_rank": self.tp_rank, "cp_rank": self.cp_rank, "ran": self.ran,
            "metrics": {n: m.to_dict() for n, m in self.metrics.items()},
            "baseline_metrics": {n: m.to_dict() for n, m in self.baseline_metrics.items()},
            "vs_single": self.vs_single,
            "verdicts": {n: v.verdict for n, v in self.verdicts.items()},
            "why": {n: v.why for n, v in self.verdicts.items() if v.verdict == FAIL},
            "failing": self.failing,
        }


@dataclass
class DistributedOutcome:
    spec: BackendSpec
    case: Case
    nproc: int
    tp: int
    cp: int
    cp_comm_type: str | None
    device: str
    status: str  # "ok", "skip" or "error"
    ran: str = ""  # e.g. "SDPA math: composite matmul + softmax + CP all_gather, 2 ranks"
    reason: str = ""  # for skip/error; an error names the rank(s) at fault
    detail: str = ""  # stderr tail of the failing rank, tracebacks
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # reassembled tensors vs float64
    baseline_metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # local baseline (rank 0, 1 process)
    single_metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # same backend, 1 process (rank 0)
    vs_single: dict[str, float] = field(default_factory=dict)  # ||reassembled - single|| / ||single||
    bitwise_single: dict[str, bool] = field(default_factory=dict)  # reassembled == single bit for bit
    ranks: list[RankShard] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def failing_ranks(self) -> list[int]:
        return [shard.rank for shard in self.ranks if shard.failing]

    @property
    def coords(self) -> dict[str, Any]:
        return {"probe": "distributed", "nproc": self.nproc, "tp": self.tp, "cp": self.cp,
                "cp_comm_type": self.cp_comm_type if self.cp > 1 else None}


def _metrics(d: dict | None) -> dict[str, TensorMetrics]:
    return {name: TensorMetrics(**m) for name, m in (d or {}).items()}


def _outcome_from_result(base: dict, result: dict) -> DistributedOutcome:
    outcome = DistributedOutcome(**base, status=result.get("status", "error"), ran=result.get("ran", ""),
                                 reason=result.get("reason", ""), detail=result.get("detail", ""),
                                 metrics=_metrics(result.get("metrics")),
                                 baseline_metrics=_metrics(result.get("baseline_metrics")),
                                 single_metrics=_metrics(result.get("single_metrics")),
                                 vs_single=result.get("vs_single", {}), bitwise_single=result.get("bitwise_single", {}),
                                 seconds=result.get("seconds", {}), extra=result.get("extra", {}))
    dtype = outcome.case.dtype
    for r in result.get("ranks", []):
        shard = RankShard(r["rank"], r["tp_rank"], r["cp_rank"], r.get("ran", ""), _metrics(r.get("metrics")),
                          _metrics(r.get("baseline_metrics")), r.get("vs_single", {}))
        shard.verdicts = {name: judge_tensor(name, m, shard.baseline_metrics[name], dtype)
                          for name, m in shard.metrics.items() if name in shard.baseline_metrics}
        outcome.ranks.append(shard)
    return outcome


def to_row(outcome: DistributedOutcome) -> Row:
    """The results row (not yet judged: diagnosis.judge fills its verdict against the baseline row with the
    same case key, which for coords probe "distributed" is the plain single-call baseline)."""
    verdict = {"ok": "", "skip": SKIP}.get(outcome.status, ERROR)
    extra = dict(outcome.extra)
    extra.update({
        "rank_layout": RANK_LAYOUT,
        "cp_split": CP_SPLIT if outcome.cp > 1 else None,
        "vs_single": outcome.vs_single,
        "bitwise_single": outcome.bitwise_single,
        "single_metrics": {n: m.to_dict() for n, m in outcome.single_metrics.items()},
        "baseline_metrics": {n: m.to_dict() for n, m in outcome.baseline_metrics.items()},
        "ranks": [shard.to_dict() for shard in outcome.ranks],
        "failing_ranks": outcome.failing_ranks,
    })
    return Row(backend=outcome.spec.name, family=outcome.spec.family, layout="contiguous", case=outcome.case,
               verdict=verdict, ran=outcome.ran, reason=outcome.reason, detail=outcome.detail,
               metrics=dict(outcome.metrics), seconds=dict(outcome.seconds), options=outcome.spec.options,
               coords=outcome.coords, extra=extra)


def baseline_row(outcome: DistributedOutcome) -> Row | None:
    """The local baseline as rank 0 measured it on the full tensors (a plain single-call row)."""
    if not outcome.baseline_metrics:
        return None
    return Row(BASELINE, "local", "contiguous", outcome.case, "", ran="Megatron local (rank 0, one process)",
               metrics=dict(outcome.baseline_metrics))


def apply_rank_verdicts(row: Row) -> Row:
    """After diagnosis.judge: a distributed row whose shards fail on some ranks FAILs (even when the whole
    tensor's error stays under the threshold), and its reason names those ranks and tensors."""
    if row.coords.get("probe") != "distributed" or row.verdict not in (PASS, FAIL):
        return row
    bad = [r for r in row.extra.get("ranks", []) if r.get("failing")]
    if not bad:
        return row
    where = "; ".join(f"rank {r['rank']} (tp_rank {r['tp_rank']}, cp_rank {r['cp_rank']}): "
                      + ", ".join(f"{n} {r['why'].get(n, '')}".strip() for n in r["failing"]) for r in bad)
    ok = [r["rank"] for r in row.extra.get("ranks", []) if not r.get("failing")]
    passing = f"; shards of rank{'s' if len(ok) > 1 else ''} {', '.join(map(str, ok))} pass" if ok else ""
    if row.verdict == PASS:
        row.verdict = FAIL
        row.reason = f"the whole tensors pass, but shards fail on {where}{passing}"
    else:
        row.reason = f"{row.reason}; shards fail on {where}{passing}"
    return row


def judge_outcome(outcome: DistributedOutcome) -> Row:
    """The outcome's row judged against the local baseline rank 0 measured (standalone use and tests)."""
    from attn_doctor.verdict.diagnosis import judge

    row = to_row(outcome)
    base = baseline_row(outcome)
    if base is None or outcome.status != "ok":
        return row
    judge([base, row])
    return apply_rank_verdicts(row)


# ---------------------------------------------------------------------------------------------------
# launching


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
    validate_grid(nproc, tp, cp, cp_comm_type, device)
    comm = cp_comm_type if cp > 1 else None
    bases = [dict(spec=spec, case=case, nproc=nproc, tp=tp, cp=cp, cp_comm_type=comm, device=device)
             for spec, case in requests]
    outcomes: list[DistributedOutcome | None] = [None] * len(requests)
    pending = []
    for index, (spec, case) in enumerate(requests):
        why = case_unsupported(spec, case, tp, cp, comm, device)
        if why is not None:
            outcomes[index] = DistributedOutcome(**bases[index], status="skip", reason=why)
        else:
            pending.append(index)
    while pending:
        started = time.perf_counter()
        results, failure = _launch_once([requests[i] for i in pending], nproc=nproc, tp=tp, cp=cp,
                                        cp_comm_type=comm, device=device, timeout_s=timeout_s)
        wall = time.perf_counter() - started
        for index, result in zip(pending, results):
            outcomes[index] = _outcome_from_result(bases[index], result)
            outcomes[index].seconds["launch (wall)"] = wall
        done = len(results)
        if failure is None:
            for index in pending[done:]:  # torchrun ended cleanly without answering (should not happen)
                outcomes[index] = DistributedOutcome(**bases[index], status="error",
                                                     reason="the ranks ended without reporting this probe")
            break
        failed_at, reason, detail = failure
        if failed_at is None:  # the launch failed before any probe started: nothing would go better again
            for index in pending[done:]:
                outcomes[index] = DistributedOutcome(**bases[index], status="error", reason=reason, detail=detail)
            break
        index = pending[failed_at]
        outcomes[index] = DistributedOutcome(**bases[index], status="error", reason=reason, detail=detail)
        pending = pending[failed_at + 1:]
    return outcomes  # type: ignore[return-value]


def _signal_text(code: int) -> str:
    if code > 128:  # a shell-style report of a signal
        try:
            return f"exit code {code} (signal {signal.Signals(code - 128).name}?)"
        except ValueError:
            pass
    return describe_exit(code)


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

    def kill(self) -> None:
        """SIGTERM torchrun's process group (torchrun then stops its ranks), then SIGKILL torchrun's and every
        rank's process group (torchrun starts each rank in its own session)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            _killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGKILL)
        for state in self.progress().values():
            pid = state.get("pid")
            if isinstance(pid, int) and pid > 1 and pid != os.getpid():
                _killpg(pid, signal.SIGKILL, only_if_leader=True)
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass


def _killpg(pgid: int, sig: int, only_if_leader: bool = False) -> None:
    try:
        if only_if_leader and os.getpgid(pgid) != pgid:
            return  # that pid is no longer the leader of its own group: not one of our ranks
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _env() -> dict[str, str]:
    env = child_env()
    env["NCCL_NVLS_ENABLE"] = "0"  # the lent multi-GPU machines require NVLink multicast off
    return env


def _launch_once(requests: list[tuple[BackendSpec, Case]], *, nproc: int, tp: int, cp: int,
                 cp_comm_type: str | None, device: str,
                 timeout_s: float) -> tuple[list[dict], tuple[int | None, str, str] | None]:
    """(results of the probes rank 0 finished, in order; None or (index of the failed probe, or None when
    no probe had started, reason, detail))."""
    with tempfile.TemporaryDirectory(prefix="attn-doctor-ranks-") as tmp:
        folder = Path(tmp)
        output = folder / "results.json"
        job = {
            "probes": [{"backend": spec.to_dict(), "case": case.to_dict()} for spec, case in requests],
            "nproc": nproc, "tp": tp, "cp": cp, "cp_comm_type": cp_comm_type, "device": device,
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
                launch.proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                               env=_env(), start_new_session=True)
                hung = _watch(launch, timeout_s)
            finally:  # also on KeyboardInterrupt: never leave ranks behind
                if launch.proc is not None and (hung is not None or launch.proc.poll() is None):
                    launch.kill()
        results = _read_results(output)
        if len(results) >= len(requests):
            return results[:len(requests)], None  # every probe answered; anything after them does not matter
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
            f"died ({_signal_text(codes[r])})" if r in codes else "failed"
        where = f" in {_where(state)}" if state else " before reporting any progress"
        parts.append(f"rank {r} {how}{where}")
    others = [r for r in sorted(set(codes) | set(errors)) if r not in culprits]
    tail = f"; torchrun then stopped rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}" if others else ""
    if not parts:
        last = report.strip().splitlines()[-1] if report.strip() else ""
        return f"torchrun failed ({_signal_text(code) if code is not None else 'no exit code'}): {last}", []
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
