"""Running probes: coordinates in, judged rows out, on worker processes kept across groups of probes.

One pool of workers per backend family (`workers_per_family` each: a sweep may ask for more than one; None: the
cores shared among the families, `attn_doctor.execution.concurrency`, and a worker whose family has no unit left in
a phase goes on as a worker of the family with the most work left: `attn_doctor.execution.handover`).
Families, and the workers of a family, run concurrently; a family's probes go to its workers one (group,
case) at a time, so a worker builds each case's inputs and maps its shared reference once. Each case's float64
reference (a depth stack's too) is computed once, here in the parent, and mapped by the workers
(`shared_reference`). Probes that cannot run here are SKIP rows without starting anything.

Memory: each call of `run_groups` runs by the plan `attn_doctor.execution.memory_plan.plan_memory` makes for
its probes within the session's budget: as many workers per family as fit, else the families taking turns (a
depth run always does: one depth at a time, the families in turn, one worker each), each process's allocator
held to its share. A probe that runs out of memory all the same is put aside and retried once everything else
is done, alone (every other worker closed, its cap the whole budget less the processes' fixed parts); if it
still does not fit, its row says so (TOO-BIG: "does not fit in N GiB (needs about M GiB)"), neither a kernel's
fault nor attn-doctor's.

Ctrl-C (KeyboardInterrupt in the calling thread) kills every worker at once and starts nothing more: the
groups already judged stay judged (and already handed to `on_group`), and the KeyboardInterrupt carries
every row that finished, judged, as `finished_rows`.
"""

from __future__ import annotations

import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from attn_doctor.backends import BASELINE, BackendSpec, process_of
from attn_doctor.core.case import Case
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import first_line
from attn_doctor.execution.budget import MemoryBudget, size
from attn_doctor.execution.handover import Handover
from attn_doctor.execution.memory_plan import MemoryPlan, plan_phases, probe_need
from attn_doctor.execution.pool import Worker
from attn_doctor.execution.progress import ProgressSink
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.probes.plan import static_skip
from attn_doctor.results.row import Row
from attn_doctor.verdict.judge import judge
from attn_doctor.verdict.rule import ERROR, SKIP, TOO_BIG

DEFAULT_TIMEOUT_S = 300.0
INTERNAL = "attn-doctor internal error (not the kernel's)"


def row_from_reply(coords: Coords, reply: dict) -> Row:
    """A worker's reply as an unjudged row."""
    status = reply.get("status", "error")
    internal = bool(reply.get("internal"))
    reason = reply.get("reason", "")
    return Row(
        coords=coords,
        verdict={"ok": "", "skip": SKIP}.get(status, ERROR),
        ran=reply.get("ran", ""),
        reason=f"{INTERNAL}: {reason}" if internal else reason,
        detail=reply.get("detail", ""),
        metrics={name: TensorMetrics(**m) for name, m in reply.get("metrics", {}).items()},
        flash_style={name: TensorMetrics(**m) for name, m in reply.get("flash_style", {}).items()},
        seconds=reply.get("seconds", {}),
        extra=reply.get("extra", {}),
        internal=internal,
    )


def internal_row(coords: Coords, exc: BaseException) -> Row:
    """The row of a probe that attn-doctor itself failed to run or judge (its own bug, never the kernel's): an
    ERROR that says so, with the traceback as its detail."""
    return row_from_reply(coords, {"status": "error", "internal": True,
                                   "reason": f"{type(exc).__name__}: {first_line(exc)}",
                                   "detail": "".join(traceback.format_exception(exc))[-4000:]})


def repeats_of(coords: Coords, repeats: int) -> int:
    """How many times a probe runs: --repeats where its kind takes them (single calls), else once."""
    return repeats if coords.kind_rules.repeats else 1


def cpu_threads(device: str, processes: int) -> dict[str, str]:
    """On the CPU, the cores shared among the worker processes that run at once (`OMP_NUM_THREADS`, which torch
    reads): each taking them all oversubscribes the machine (37 s for the default run on 2 cores, 19 s shared).
    Left as the user set it, and on a GPU."""
    if not device.startswith("cpu") or "OMP_NUM_THREADS" in os.environ:
        return {}
    return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(1, processes)))}


def skipped_row(coords: Coords, reason: str) -> Row:
    return Row(coords=coords, verdict=SKIP, reason=reason)


def too_big_row(coords: Coords, room: int | None, where: str, needs: int, reply: dict) -> Row:
    """A probe that ran out of memory alone: it does not fit here. `room`: the bytes it had, all processes together
    (None: the device's, whatever they were); `needs`: about what it needs, counted the same way. Where that is no
    more than it had, its own allocation was larger than planned, and the row says so with torch's words."""
    within = f"in {size(room)}" if room is not None else f"in the memory of {where}"
    if room is not None and needs <= room:
        reason = (f"does not fit {within}, though planned at about {size(needs)}: it asked for more than planned "
                  f"({reply.get('reason', 'out of memory')})")
    else:
        reason = f"does not fit {within} (needs about {size(needs)})"
    return Row(coords=coords, verdict=TOO_BIG, reason=reason, detail=reply.get("reason", ""))


@dataclass
class _Batch:
    """Groups of coordinates being run: rows arrive in any order, each group is judged once complete."""

    groups: list[list[Coords]]
    on_row: Callable[[Row], None] | None
    on_group: Callable[[int, list[Row]], None] | None
    stopped: threading.Event = field(default_factory=threading.Event)
    results: list[dict[int, Row]] = field(init=False)
    judged: list[list[Row] | None] = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # probes that ran out of memory, to retry alone: (group, index)
    deferred: list[tuple[int, int]] = field(default_factory=list)
    failure: BaseException | None = None  # attn-doctor's own error that stopped the batch (re-raised by the session)

    def __post_init__(self) -> None:
        self.results = [{} for _ in self.groups]
        self.judged = [None] * len(self.groups)

    def finished(self) -> list[Row]:
        """Every row that finished, judged: complete groups as they were; of an incomplete group, the rows
        whose baseline finished (the others cannot be judged)."""
        rows = []
        with self.lock:
            for group, judged in enumerate(self.judged):
                if judged is not None:
                    rows += judged
                    continue
                done = [self.results[group][i] for i in sorted(self.results[group])]
                baselines = {r.coords.baseline_key() for r in done if r.metrics and r.coords.is_baseline(BASELINE)}
                rows += judge([r for r in done if not r.metrics or r.coords.baseline_key() in baselines])
        return rows

    def finish(self, group: int, index: int, row: Row) -> None:
        with self.lock:
            if self.stopped.is_set():
                return  # interrupted: what a killed worker answered is not a result
            self.results[group][index] = row
            if self.on_row:
                self.on_row(row)
            if len(self.results[group]) == len(self.groups[group]):
                rows = [self.results[group][i] for i in range(len(self.groups[group]))]
                try:
                    self.judged[group] = judge(rows)
                except Exception as exc:  # noqa: BLE001 - attn-doctor's own bug: these rows say so, the rest go on
                    self.judged[group] = [internal_row(r.coords, exc) if r.metrics else r for r in rows]
                if self.on_group:
                    self.on_group(group, self.judged[group])


class Session:
    """Worker processes kept across groups of probes (a sweep's points, a bisect's steps)."""

    def __init__(self, device: str, timeout_s: float = DEFAULT_TIMEOUT_S, workers_per_family: int | None = 1,
                 progress: ProgressSink | None = None, repeats: int = 1, budget: MemoryBudget | None = None,
                 hand_over: bool | None = None):
        from attn_doctor.execution.shared_reference import ReferenceStore

        self.device = device
        self.timeout_s = timeout_s
        self.workers_per_family = None if workers_per_family is None else max(1, workers_per_family)
        self.repeats = repeats  # runs of each CALL probe (--repeats); the other kinds run once
        self.progress = progress or ProgressSink()
        self.budget = budget  # for all processes together (None: not known here, nothing held to it)
        self.plans: list[MemoryPlan] = []  # the last `run_groups`' plans, one per phase
        self.turn_seconds: dict[str, float] = {}  # the wall time of each phase ("phase N") and of "retried alone"
        self._phase_plan: MemoryPlan | None = None  # the plan of the phase running now
        self.workers: dict[str, list[Worker]] = {}
        self._pools = threading.Lock()  # `workers`' lists grow from serving threads (`_serve_and_move`)
        # Workers change family where a family runs dry (`handover`): by default where the cores are shared by work
        # (no --workers) on a GPU; on the CPU each family's one worker computes with its share of the threads.
        self.hand_over = (workers_per_family is None and device.startswith("cuda")) if hand_over is None else hand_over
        self.moves: list[tuple[str, str]] = []  # every hand-over of the session, (from, to), in order
        self.references = ReferenceStore(device, on_progress=self.progress.note)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type, *exc_info) -> None:
        self.close(graceful=exc_type is None)

    def close(self, graceful: bool = True) -> None:
        with self._pools:
            workers = [worker for family in self.workers.values() for worker in family]
        if graceful:
            for worker in workers:
                worker.ask_to_quit()  # they all end at once: 16 TE workers one after another took seconds
        for worker in workers:
            worker.close(graceful=graceful)
        self.references.clear()

    @property
    def facts(self) -> dict:
        """What the workers' libraries reported when they started (e.g. {"te_facts": ...}): only workers started as
        the machine is, never one asked to load a cuDNN build or a prepared TE release (its TE reports that build or
        release, not the machine's; each row says what it ran on). None such: {} (the fingerprint probes TE in a
        process of its own)."""
        from attn_doctor.machine.cudnn_builds import WANTED_BUILD
        from attn_doctor.machine.te_installs import SITE_VARIABLE

        found: dict = {}
        for family in self.workers.values():
            for worker in family:
                if WANTED_BUILD not in worker.environment and SITE_VARIABLE not in worker.environment:
                    found.update({k: v for k, v in (worker.hello or {}).items()
                                  if k not in ("family", "pid", "forked")})
        return found

    @property
    def server_starts(self) -> dict[str, dict]:
        """Per process key whose workers were forked, what its fork server's start took (`fork_server`: seconds to
        its imports' end, of them on a CPU, the pages read from disk)."""
        found: dict[str, dict] = {}
        for key, workers in self.workers.items():
            for worker in workers:
                forked = (worker.hello or {}).get("forked")
                if forked and "ready_s" in forked:
                    found.setdefault(key, forked)
        return found

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Per family, the slowest worker's start-up (they start in parallel), restarts included."""
        return {family: max(w.startup_seconds for w in workers) for family, workers in self.workers.items()}

    def run(self, coords: list[Coords], on_row: Callable[[Row], None] | None = None) -> list[Row]:
        """Run every probe and return judged rows in the order of `coords`."""
        return self.run_groups([coords], on_row=on_row)[0]

    def run_groups(self, groups: list[list[Coords]], on_row: Callable[[Row], None] | None = None,
                   on_group: Callable[[int, list[Row]], None] | None = None) -> list[list[Row]]:
        """Run groups of probes (each judged on its own, e.g. one sweep point) without waiting for one
        group to finish before the next starts. `on_group(index, rows)` is called as each group completes;
        callbacks run one at a time. Returns each group's judged rows, in order."""
        batch = _Batch(groups, on_row, on_group)
        units = self._assign(batch)
        runnable = [[] for _ in groups]
        for family_units in units.values():
            for group, indices in family_units:
                runnable[group] += [groups[group][i] for i in indices]
        # refused up front by the command where it had to be (its largest request); here whatever fits least runs,
        # the small groups first where the large ones would cut the workers of all (`plan_phases`)
        phases = plan_phases(runnable, self.device, self.budget, self.workers_per_family, self.repeats)
        self.plans = [plan for _, plan in phases]
        self.turn_seconds = {}
        for number, (chosen, plan) in enumerate(phases):
            if batch.failure is not None or batch.stopped.is_set():
                break
            members = set(chosen)
            phase_units = {process: [unit for unit in family_units if unit[0] in members]
                           for process, family_units in units.items()}
            start = time.perf_counter()
            self._run_phase(batch, {p: u for p, u in phase_units.items() if u}, plan, closing=number > 0)
            self.turn_seconds[f"phase {number + 1}"] = time.perf_counter() - start
        if batch.deferred and batch.failure is None:
            start = time.perf_counter()
            self._wait(batch, [lambda: self._retry_alone(batch)])
            self.turn_seconds["retried alone"] = time.perf_counter() - start
        if batch.failure is not None:
            raise batch.failure
        if self.device.startswith("cuda"):
            import torch

            peak = torch.cuda.max_memory_reserved(torch.device(self.device))
            for plan in self.plans:
                plan.parent_peak = peak
        return [rows if rows is not None else [] for rows in batch.judged]

    @property
    def plan(self) -> MemoryPlan | None:
        """The plan of the last `run_groups`' first phase (its smallest groups; `plans` has every phase's), None
        before any."""
        return self.plans[0] if self.plans else None

    def _run_phase(self, batch: _Batch, units: dict[str, list[tuple[int, list[int]]]], plan: MemoryPlan,
                   closing: bool) -> None:
        """Serve `units` on `plan`: its workers started, its caps held. `closing`: a later phase of one request,
        whose plan counts fewer workers than are running: the others are closed (they hold memory it does not
        count)."""
        self._phase_plan = plan
        self.references.max_live = plan.live_references
        self.references.admit_in(serving_order(batch.groups, units))
        self._hold_parent(plan)
        starting = {process: min(plan.workers.get(process, 1), len(family_units))
                    for process, family_units in units.items()}
        if closing:
            for process, pool in self.workers.items():
                for worker in pool[starting.get(process, 0):]:
                    worker.close()
                del pool[starting.get(process, 0):]
        threads = cpu_threads(self.device, sum(starting.values()))
        kinds: dict[str, tuple[str, dict[str, str]]] = {}  # process key -> (family, environment) of its workers
        for process, family_units in units.items():
            pool = self.workers.setdefault(process, [])
            spec = batch.groups[family_units[0][0]][family_units[0][1][0]].backend
            kinds[process] = (spec.family, {**process_of(spec)[1], **threads})
            family, environment = kinds[process]
            while len(pool) < starting[process]:
                pool.append(Worker(family, self.device, self.timeout_s, environment))
        if plan.serial:
            self._wait(batch, [lambda: self._serve_in_turn(batch, units)])
            return
        todos = {process: _queue_of(family_units) for process, family_units in units.items()}
        handover = self._handover(batch, units, starting, plan) if self.hand_over else None
        self._wait(batch, [lambda p=p, w=w: self._serve_and_move(batch, w, p, todos, handover, kinds)
                           for p in units for w in self.workers[p][:starting[p]]])
        if handover is not None:
            self.moves += handover.moves

    def _handover(self, batch: _Batch, units: dict[str, list[tuple[int, list[int]]]], starting: dict[str, int],
                  plan: MemoryPlan) -> Handover:
        """The phase's hand-over bookkeeping: each key's units and their seconds, its workers, and the memory the
        plan holds for one of them."""
        return Handover(left_s={p: sum(unit_seconds(batch.groups, *unit) for unit in u) for p, u in units.items()},
                        left_units={p: len(u) for p, u in units.items()}, live=dict(starting),
                        footprint={p: plan.fixed.get(p, 0) + plan.worker_caps.get(p, 0) for p in units},
                        budgeted=plan.budget is not None)

    def _hold_parent(self, plan: MemoryPlan) -> None:
        """Hold this process's allocator (the float64 references) to its share of the budget."""
        if plan.budget is None or not self.device.startswith("cuda"):
            return
        import torch

        device = torch.device(self.device)
        index = device.index if device.index is not None else torch.cuda.current_device()
        total = torch.cuda.get_device_properties(index).total_memory  # what torch's fraction is of
        torch.cuda.set_per_process_memory_fraction(min(1.0, plan.parent_cap / total), index)

    # -- planning --

    def _assign(self, batch: _Batch) -> dict[str, list[tuple[int, list[int]]]]:
        """Static skips become rows at once; the rest is assigned to worker processes (a family's, or one with
        the variables a spec needs: `backends.process_of`) as (group, indices) units."""
        units: dict[str, list[tuple[int, list[int]]]] = {}
        for group, coords_list in enumerate(batch.groups):
            for index, coords in enumerate(coords_list):
                reason = static_skip(coords, self.device)
                if reason is not None:
                    batch.finish(group, index, skipped_row(coords, reason))
                    continue
                family_units = units.setdefault(process_of(coords.backend)[0], [])
                if not family_units or family_units[-1][0] != group:
                    family_units.append((group, []))
                family_units[-1][1].append(index)
                self.references.expect(coords.case, coords.reference_layers)
        return units

    # -- serving --

    def _start(self, worker: Worker) -> threading.Thread:
        # The worker starts (TE import: seconds) while the parent computes the reference.
        thread = threading.Thread(target=worker.ensure_started, daemon=True)
        thread.start()
        return thread

    def _probe(self, batch: _Batch, worker: Worker, group: int, index: int, starting: threading.Thread,
               alone: bool = False) -> None:
        coords = batch.groups[group][index]
        spec: BackendSpec = coords.backend
        key = process_of(spec)[0]
        reference = self.references.handle(coords.case, coords.reference_layers)
        try:  # the job is done with the reference whatever happens: a kept one never freed would stall the others
            room = self._room(key, alone)
            # families taking turns: each worker gives its allocator's cache back after each job, so that the next
            # family's turn finds the memory free (a worker that measured a long case would otherwise keep it all)
            message = {"op": "run", "coords": coords.to_dict(), "reference": reference,
                       "repeats": repeats_of(coords, self.repeats), "memory_cap": room,
                       "release": bool(self._phase_plan and self._phase_plan.serial)}
            starting.join()
            reply = worker.request(message, on_progress=lambda text: self.progress.note(f"{spec.name}: {text}"))
        finally:
            self.references.done(coords.case, coords.reference_layers)
        if reply.get("status") != "oom":
            batch.finish(group, index, row_from_reply(coords, reply))
        elif not alone:
            with batch.lock:
                batch.deferred.append((group, index))
        else:
            batch.finish(group, index, self._too_big(coords, key, reply))

    def _room(self, key: str, alone: bool) -> int | None:
        """The allocator cap of a worker of process `key` for its next job: its share of the plan, or alone the
        whole budget less the processes' fixed parts and the references kept. None: no cap."""
        plan = self._phase_plan
        if plan is None or plan.budget is None or not self.device.startswith("cuda"):
            return None
        if alone:
            return plan.alone_cap(key, self.references.kept_bytes())
        return plan.worker_caps.get(key)

    def _too_big(self, coords: Coords, key: str, reply: dict) -> Row:
        """The row of a probe that ran out of memory alone, with about what it needs: the plan's estimate of it, or
        what its worker held when it failed and the allocation that failed, if more."""
        plan = self._phase_plan
        fixed = plan.fixed.get("parent", 0) + plan.fixed.get(key, 0) if plan else 0
        planned = probe_need(coords, self.device, repeats_of(coords, self.repeats))
        held = int(reply.get("reserved", 0)) + int(reply.get("tried", 0))
        needs = fixed + self.references.kept_bytes() + max(planned, held)
        room = plan.budget.bytes if plan and plan.budget else None
        return too_big_row(coords, room, self.device, needs, reply)

    def _retry_alone(self, batch: _Batch) -> None:
        """Each probe that ran out of memory, again, with every other worker closed and the whole budget: one
        process's probes after another, so that each worker starts once (taken in the order they were asked, the
        families alternated and every probe started a worker anew: te-tests' last 115 probes took 170 s on the
        H100, reports/h100/issue51/lease4)."""
        self.references.admit_in([])  # one probe at a time: each waits only for room
        by_process: dict[str, list[tuple[int, int]]] = {}
        for group, index in sorted(batch.deferred):
            by_process.setdefault(process_of(batch.groups[group][index].backend)[0], []).append((group, index))
        for key, group, index in ((key, *unit) for key, units in by_process.items() for unit in units):
            if batch.stopped.is_set():
                return
            coords = batch.groups[group][index]
            for other_key, pool in self.workers.items():
                for number, worker in enumerate(pool):
                    if other_key != key or number > 0:
                        worker.close()
            self.references.expect(coords.case, coords.reference_layers)
            self.progress.note(f"{coords.backend.name}: ran out of memory beside the others; again alone")
            self._probe(batch, self.workers[key][0], group, index, self._start(self.workers[key][0]), alone=True)

    def _serve(self, batch: _Batch, worker: Worker, todo: queue.Queue,
               starting: threading.Thread | None = None, on_take: Callable[[int, list[int]], None] | None = None
               ) -> None:
        while not batch.stopped.is_set():
            try:
                group, indices = todo.get_nowait()
            except queue.Empty:
                return
            if on_take is not None:
                on_take(group, indices)
            starting = starting or self._start(worker)
            for index in indices:
                if batch.stopped.is_set():
                    return
                try:
                    self._probe(batch, worker, group, index, starting)
                except Exception as exc:  # noqa: BLE001 - attn-doctor's own bug in this probe: its row says so,
                    # and this family serves on (a family of one worker that stopped would stall every other
                    # family waiting for room to keep references: issue 51's sweeps on the H100)
                    try:
                        batch.finish(group, index, internal_row(batch.groups[group][index], exc))
                    except Exception as failure:  # noqa: BLE001 - not even that: stop everything, say why
                        batch.failure = failure
                        batch.stopped.set()
                        self.references.clear()  # releases every job waiting for room
                        return

    def _serve_and_move(self, batch: _Batch, worker: Worker, key: str, todos: dict[str, queue.Queue],
                        handover: Handover | None, kinds: dict[str, tuple[str, dict[str, str]]]) -> None:
        """Serve `key`'s units on `worker` until none is left; then, with `handover`, go on as a new worker of the
        key it names (the old one closed first: its memory is the new one's), and so on."""
        while True:
            def took(group: int, indices: list[int], key: str = key) -> None:
                if handover is not None:
                    handover.took(key, unit_seconds(batch.groups, group, indices))

            self._serve(batch, worker, todos[key], on_take=took)
            if handover is None or batch.stopped.is_set():
                return
            with self._pools:  # a family is forked once any worker of it said so (TE's, once TE is imported)
                forked = [k for k, pool in self.workers.items() if any((w.hello or {}).get("forked") for w in pool)]
            for other in forked:
                handover.is_forked(other)
            closing, key = handover.drained(key, worker)
            for idle in closing:  # this worker first, then any other idle one whose memory the new one needs
                idle.close()
            if key is None:
                return
            worker = Worker(kinds[key][0], self.device, self.timeout_s, kinds[key][1])
            with self._pools:
                self.workers[key].append(worker)
            if batch.stopped.is_set():  # Ctrl-C while it was made: `close` may have missed it
                worker.close(graceful=False)
                return

    def _serve_in_turn(self, batch: _Batch, units: dict[str, list[tuple[int, list[int]]]]) -> None:
        # One reference at a time: every family measures a case (a depth) before the next one is built.
        starting = {family: self._start(self.workers[family][0]) for family in units}
        for family, unit in turns(batch.groups, units):
            todo: queue.Queue = queue.Queue()
            todo.put(unit)
            self._serve(batch, self.workers[family][0], todo, starting[family])

    def _wait(self, batch: _Batch, jobs: list[Callable[[], None]]) -> None:
        """Run `jobs` in threads and wait in this thread, where Ctrl-C arrives: it stops the batch and kills
        every worker at once, so the interrupt is answered in well under a second."""
        threads = [_Thread(job) for job in jobs]
        try:
            for thread in threads:
                thread.join_and_raise()
        except BaseException as exc:
            batch.stopped.set()
            self.close(graceful=False)
            if isinstance(exc, KeyboardInterrupt):
                exc.finished_rows = batch.finished()  # what the caller may keep
            raise


class _Thread(threading.Thread):
    """A daemon thread whose exception is re-raised where it is joined (an attn-doctor bug must not pass
    silently), joined in short waits so that the joining thread stays interruptible."""

    def __init__(self, target: Callable, *args) -> None:
        super().__init__(daemon=True)
        self._call = (target, args)
        self._error: BaseException | None = None
        self.start()

    def run(self) -> None:
        target, args = self._call
        try:
            target(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the joining thread
            self._error = exc

    def join_and_raise(self) -> None:
        while self.is_alive():
            self.join(0.1)
        if self._error is not None:
            raise self._error


def unit_seconds(groups: list[list[Coords]], group: int, indices: list[int]) -> float:
    """About how long a unit's probes take (`backends.probe_seconds`, summed)."""
    from attn_doctor.backends import probe_seconds

    return sum(probe_seconds(groups[group][i].backend) for i in indices)


def _queue_of(units: list) -> queue.Queue:
    todo: queue.Queue = queue.Queue()
    for unit in units:
        todo.put(unit)
    return todo


def serving_order(groups: list[list[Coords]], units: dict[str, list[tuple[int, list[int]]]]
                  ) -> list[tuple[Case, int | None]]:
    """The (case, layers) of the references `units` need, in the order the families serve them: by group; in a group
    by depth as `turns` goes (admitted out of that order, a reference would wait for ever when the families take
    turns on one thread), then as each family's worker goes through its probes, in their order."""
    indices: dict[int, set[int]] = {}
    for family_units in units.values():
        for group, unit in family_units:
            indices.setdefault(group, set()).update(unit)
    order: dict[tuple, tuple[Case, int | None]] = {}
    for group in sorted(indices):
        coords_list = groups[group]
        for layers in dict.fromkeys(c.reference_layers for c in coords_list):
            for i in sorted(indices[group]):
                coords = coords_list[i]
                if coords.reference_layers == layers:
                    order.setdefault((coords.case.key(), layers), (coords.case, layers))
    return list(order.values())


def turns(groups: list[list[Coords]], units: dict[str, list[tuple[int, list[int]]]]
          ) -> list[tuple[str, tuple[int, list[int]]]]:
    """The order when families take turns: per group (and depth), each family's probes on it, families in turn."""
    steps = []
    for group, coords_list in enumerate(groups):
        for layers in dict.fromkeys(c.reference_layers for c in coords_list):
            for family, family_units in units.items():
                indices = [i for g, unit in family_units if g == group for i in unit
                           if coords_list[i].reference_layers == layers]
                if indices:
                    steps.append((family, (group, indices)))
    return steps
