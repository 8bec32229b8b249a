"""Memory: what a request's processes need at their peak, against one budget for all of them together
(`attn_doctor.execution.budget`), and the plan that keeps them inside it, made before anything starts.

The plan (`plan_memory`) counts every process attn-doctor starts:
- each process's fixed part, outside torch's caching allocator: a CUDA context with its libraries' modules and
  handles (`PROCESS_BYTES`, per family: TE's is larger), or on the CPU the interpreter with torch loaded;
- the parent: the float64 references it keeps while jobs use them, at most `live_references` at once (a family
  that runs ahead waits for the others: `attn_doctor.execution.shared_reference`), and the scratch of computing
  one (one at a time). As many as there are workers, and on a GPU more, as long as they take no more than half of
  what the plan leaves of the budget (`_window`; the other half stays the allocators' slack): the families do not
  start together (TE's worker waits seconds for TE's import while SDPA's and local's run), and one reference per
  worker let those run only that many cases ahead, then wait (reports/h100/issue51/lease5: SDPA's workers idle half
  the time until TE's started, then SDPA the last family to finish);
- each worker: the largest unit it runs (`probe_need`: a case's inputs, the layout's buffers, outputs, gradients,
  the comparison's chunks, the tensors kept to spot bitwise repeats, the path's own working memory
  `Backend.memory`; for a depth stack its weights, every layer's input and one layer's forward and backward,
  `attn_doctor.probes.stack.stack_bytes`).
Families run side by side, each with up to the workers asked for; where that does not fit, fewer workers run,
then families take turns (as depth stacks always do: one float64 stack is held at a time). A request whose
smallest plan does not fit is refused before anything starts (`BadInput`), naming the budget, the estimate and
the sizes that would fit. On a GPU each process's allocator is then held to its share (`MemoryPlan.caps`, set by
`attn_doctor.execution.session` through torch's per-process memory fraction), so a budget below the card's size
behaves like a smaller card, and a probe that needs more than planned fails alone instead of starving the
others (then it is retried alone: `Session`).

The estimate is of the peak the device sees, all processes together (what NVML reports for them: contexts and
the allocators' reserved memory), and it is meant to be within 1.0-1.3x of the sampled peak: the constants here
were fitted to peaks sampled on an H100 (benchmarks/bench_memory.py, benchmarks/RESULTS.md). It covers the large
allocations and each process's fixed part, not every allocator's slack: the caps share what the estimate leaves
of the budget among the processes, in proportion to their needs.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from attn_doctor import backends
from attn_doctor.core.case import DTYPE_BYTES, Case, tp_shard
from attn_doctor.core.coords import Coords, ProbeKind
from attn_doctor.core.errors import BadInput
from attn_doctor.execution.budget import MIB, MemoryBudget, size
from attn_doctor.execution.concurrency import default_workers
from attn_doctor.numerics.metrics import CHUNK_ELEMENTS, CPU_CHUNK_ELEMENTS

# Each process's fixed part: on a GPU, what NVML shows for it beyond torch's reserved memory (CUDA context,
# cuBLAS/cuDNN handles and workspaces, TE's modules), measured on an H100 with torch 2.11 and TE 2.20.2
# (benchmarks/RESULTS.md, "Memory"); on the CPU, the resident size of an interpreter with torch (and the family's
# library) imported.
PROCESS_BYTES = {
    "cuda": {"parent": 620 * MIB, "te": 1100 * MIB, "te.module": 1100 * MIB, "default": 760 * MIB},  # both import TE
    "cpu": {"parent": 450 * MIB, "default": 400 * MIB},
}
# What a worker holds between its turns when the families take turns on a GPU (its last case's tensors; it gives
# its allocator's cache back after each job then): measured 0.3 to 0.45 GiB beside its context on an H100.
IDLE_BYTES = 512 * MIB
# The tensors a worker keeps per case to spot a bitwise repeat of a compared tensor (`probes.caches.Measured`).
MEASURED_LIMIT = {"cuda": 1 << 28, "cpu": 1 << 30}
_KEPT = "the float64 references the parent keeps"  # its part of the estimate


def process_bytes(who: str, device: str) -> int:
    """A process's fixed part (`PROCESS_BYTES`): `who` is "parent" or a worker's backend family."""
    table = PROCESS_BYTES["cuda" if device.startswith("cuda") else "cpu"]
    return table.get(who, table["default"])


# -- what one unit of work needs --

def _elements(case: Case) -> tuple[int, int]:
    return case.batch * case.seq * case.heads * case.head_dim, case.batch * case.seq_kv * case.kv_heads * case.head_dim


def _chunk(device: str) -> int:
    return CPU_CHUNK_ELEMENTS if device.startswith("cpu") else CHUNK_ELEMENTS


def _comparison(elements: int, device: str) -> int:
    """A comparison's float64 temporaries over one stretch of the sequence (`numerics.metrics.compare`)."""
    return min(elements, _chunk(device)) * 8 * 5


def _reference(case: Case, device: str) -> tuple[int, int]:
    import torch

    from attn_doctor.numerics.reference import reference_bytes

    return reference_bytes(case.batch, case.seq, case.seq_kv, case.heads, case.kv_heads, case.head_dim,
                           torch.device(device.split(":")[0]))


def _call_need(coords: Coords, device: str, repeats: int, probes_in_unit: int) -> int:
    """One call's inputs, layout buffers, outputs and gradients, its comparison and the path's own working memory;
    a repeated call (--repeats) keeps its first repeat's outputs and gradients to compare with; the tensors kept
    to spot bitwise repeats (at most `MEASURED_LIMIT`, over the unit's probes); the baseline's probe computes the
    case's flash-style part (an exact attention's scratch and a few float64 tensors)."""
    case = coords.case
    item = DTYPE_BYTES[case.dtype]
    q, kv = _elements(case)
    views = 2 if coords.layout == "head_slice" else 1  # the head_slice layout's wider buffers
    need = (2 * q + 2 * kv) * item * 3 + (q + 2 * kv) * item * (views - 1) + _comparison(max(q, kv), device)
    if repeats > 1 and coords.kind_rules.repeats:
        need += (2 * q + 2 * kv) * item
    path = backends.memory(coords.backend, case)
    need += path.saved + path.transient
    need += min(MEASURED_LIMIT["cpu" if device.startswith("cpu") else "cuda"], probes_in_unit * (2 * q + 2 * kv) * item)
    if coords.is_baseline(backends.BASELINE):
        need += sum(_reference(case, device)) + 6 * q * 8
    return need


def _depth_need(coords: Coords, device: str) -> int:
    """A depth probe's worker: the baseline's stack measured first (its first and last dQ kept), then the backend's
    (`stack_bytes`), each layer's dQ compared as it comes."""
    from attn_doctor.probes.stack import stack_bytes

    case = coords.case
    item = DTYPE_BYTES[case.dtype]
    shard = tp_shard(case, coords.tp)
    own = backends.memory(coords.backend, shard)
    local = backends.memory(backends.BASELINE, case)
    attention = max((own.saved + own.transient) * coords.tp, local.saved + local.transient)
    q, _ = _elements(case)
    return stack_bytes(case, coords.layers, item, item, attention, all_dq=False) + 2 * q * item + _comparison(q, device)


def probe_need(coords: Coords, device: str, repeats: int = 1, probes_in_unit: int = 1) -> int:
    """Bytes a worker's allocator holds at the probe's peak (`repeats`: --repeats, which only single calls honour;
    `probes_in_unit`: how many probes of its family run on the case, for the tensors kept between them)."""
    if coords.kind is ProbeKind.DEPTH:
        return _depth_need(coords, device)
    need = _call_need(coords, device, repeats, probes_in_unit)
    if coords.kind is ProbeKind.TP:
        case = coords.case
        q, kv = _elements(case)
        need += (2 * q + 2 * kv) * DTYPE_BYTES[case.dtype] * 3  # the unsharded run is kept while the shards run
    return need


def reference_need(coords: Coords, device: str) -> tuple[int, int]:
    """(kept, scratch): bytes of the float64 reference the parent keeps while the probe's jobs run, and what
    computing it takes on top (freed before any worker uses it)."""
    from attn_doctor.probes.stack import stack_bytes

    case = coords.case
    if coords.kind is ProbeKind.DEPTH:
        q, kv = _elements(case)
        # every layer's dQ; the parent held 1.23 times their size beside its context at the 128-layer stack on an
        # H100 (the allocator's blocks around them)
        kept = coords.layers * q * 8 * 5 // 4
        # the replica's own stack: every layer's input and the dQ so far take turns (a layer's input is dropped
        # as its dQ arrives), one layer's float64 attention (the exact reference's tiles, out, lse and gradients)
        attention = _reference(case, device)[1] + (2 * q + 2 * kv) * 8
        model_item = DTYPE_BYTES[case.dtype]
        whole = stack_bytes(case, coords.layers, 8, model_item, attention, all_dq=True)
        return kept, whole - kept
    return _reference(case, device)


# -- the plan --

@dataclass
class MemoryPlan:
    """How a request runs within its budget: workers at once per worker process key, whether families take turns,
    how many references the parent keeps at once, each process's allocator cap, and the estimated peak by part."""

    budget: MemoryBudget | None
    device: str
    workers: dict[str, int]  # process key (`backends.process_of`) -> workers at once
    serial: bool  # families take turns (one unit at a time, all families' workers started)
    live_references: int
    parent_cap: int
    worker_caps: dict[str, int]  # process key -> each worker's allocator cap
    estimate: int  # the peak, all processes together
    needs: dict[str, int] = field(default_factory=dict)  # process key -> its largest unit's need
    parts: dict[str, int] = field(default_factory=dict)  # what needs it -> bytes, largest first
    fixed: dict[str, int] = field(default_factory=dict)  # process key ("parent" too) -> its fixed part
    fewer: str = ""  # what the plan ran with less than asked, and why ("" when nothing)
    # What the parent's allocator reserved at its peak while the plan ran (the float64 references), measured on a
    # GPU by the session (None before, and on the CPU): with each row's "allocator_peak_bytes", the plan checked
    parent_peak: int | None = None
    groups: int = 0  # the groups (sweep points) run on this plan, where a request ran in phases (`plan_phases`)

    def alone_cap(self, key: str, kept: int = 0) -> int | None:
        """The cap of a worker of process `key` running alone (every other worker closed; the parent keeping `kept`
        bytes of references): the whole budget less the parent's and its own fixed parts. None without a budget."""
        if self.budget is None:
            return None
        return max(0, self.budget.bytes - self.fixed.get("parent", 0) - self.fixed.get(key, 0) - kept)

    def to_dict(self) -> dict:
        return {"budget": self.budget.to_dict() if self.budget else None, "estimate": self.estimate,
                "parts": dict(self.parts), "workers": dict(self.workers), "serial": self.serial,
                "live_references": self.live_references, "parent_cap": self.parent_cap,
                "worker_caps": dict(self.worker_caps), "needs": dict(self.needs), "fixed": dict(self.fixed),
                "device": self.device, "fewer": self.fewer, "parent_allocator_peak_bytes": self.parent_peak,
                **({"groups": self.groups} if self.groups else {})}


@dataclass
class _Demand:
    """What the plan weighs: per process key its probes' largest need and its units; the references."""

    needs: dict[str, int]
    names: dict[str, str]  # process key -> the backend whose probe needs the most
    families: dict[str, str]  # process key -> backend family
    units: dict[str, int]
    references: list[tuple[int, int]]  # (kept, scratch) per distinct reference
    depth: bool
    work: dict[str, float] = field(default_factory=dict)  # process key -> its probes' seconds (`probe_seconds`)

    @property
    def kept_sizes(self) -> list[int]:
        """Each reference's kept bytes, largest first (the plan counts the largest that may be kept at once)."""
        return sorted((kept for kept, _ in self.references), reverse=True)


def _demand(coords_list: list[Coords], device: str, repeats: int) -> _Demand:
    per_unit: dict[tuple[str, tuple], list[Coords]] = defaultdict(list)
    references: dict[tuple, tuple[int, int]] = {}
    families: dict[str, str] = {}
    for coords in coords_list:
        key = backends.process_of(coords.backend)[0]
        families[key] = coords.backend.family
        per_unit[(key, coords.baseline_key())].append(coords)
        ref_key = (coords.case.key(), coords.reference_layers)
        if ref_key not in references:
            references[ref_key] = reference_need(coords, device)
    needs: dict[str, int] = {}
    names: dict[str, str] = {}
    units: dict[str, int] = defaultdict(int)
    work: dict[str, float] = defaultdict(float)
    for (key, _), unit in per_unit.items():
        units[key] += 1
        work[key] += sum(backends.probe_seconds(c.backend) for c in unit)
        need, name = max((probe_need(c, device, repeats, len(unit)), c.backend.name) for c in unit)
        if need > needs.get(key, -1):
            needs[key], names[key] = need, name
    return _Demand(needs, names, families, dict(units), list(references.values()),
                   any(c.kind is ProbeKind.DEPTH for c in coords_list), dict(work))


def _peak(demand: _Demand, device: str, workers: dict[str, int], serial: bool, window: int | None = None
          ) -> tuple[int, dict[str, int], int]:
    """(peak, parts, live references) of running with `workers` per key, side by side or taking turns; `window`:
    the references kept at once (default one per worker)."""
    fixed = "the processes' CUDA contexts" if device.startswith("cuda") else "the processes' interpreters"
    parts: dict[str, int] = {fixed: process_bytes("parent", device)}
    for key, count in workers.items():
        parts[fixed] += count * process_bytes(demand.families[key], device)
    kept_sizes = demand.kept_sizes
    scratch = max((s for _, s in demand.references), default=0)
    live = 1 if serial else min(len(kept_sizes), window or max(1, sum(workers.values())))
    kept = sum(kept_sizes[:live])
    # On the CPU what a process frees mostly stays with it (glibc keeps freed heap pages for the next allocation),
    # so a family that had its turn still holds its peak, and the parent its reference's scratch: measured, the
    # 24-layer depth sweep held 4.5 GiB where its families' turns alone would have counted 3.5.
    retained = not device.startswith("cuda")
    if serial and not retained:
        at_once = max(demand.needs.values(), default=0)
        key = max(demand.needs, key=demand.needs.get) if demand.needs else ""
        idle = sum(min(IDLE_BYTES, demand.needs[other]) for other in workers if other != key)
        running = {f"{demand.names[key]}'s worker (families take turns)": at_once} if key else {}
        if idle:
            running["the other families' workers between their turns"] = idle
        at_once += idle
    else:
        running = {f"the {key} workers ({count} at once, {demand.names[key]}'s probe the largest)"
                   if count > 1 else f"the {key} worker ({demand.names[key]}'s probe the largest)":
                   count * demand.needs[key] for key, count in workers.items()}
        at_once = sum(running.values())
    # One reference (a run): it is computed before any worker measures. Several: later ones are computed while
    # workers measure earlier ones.
    overlap = retained or (not serial and len(demand.references) > 1)
    parts[_KEPT] = kept
    if overlap or scratch > at_once:
        parts["computing a float64 reference"] = scratch
    if overlap or at_once >= scratch:
        parts.update(running)
    total = sum(parts.values())
    return total, dict(sorted(parts.items(), key=lambda item: -item[1])), live


def _asked(demand: _Demand, device: str, workers_per_family: int | dict[str, int] | None) -> dict[str, int]:
    """Workers per process key asked for, at most one per unit."""
    if workers_per_family is None:
        return default_workers(demand.work, demand.units, device)
    per_key = workers_per_family if isinstance(workers_per_family, dict) else {}
    return {key: max(1, min(per_key.get(key, workers_per_family if isinstance(workers_per_family, int) else 1),
                            demand.units[key])) for key in demand.needs}


def plan_memory(coords_list: list[Coords], device: str, budget: MemoryBudget | None,
                workers_per_family: int | dict[str, int] | None = 1, repeats: int = 1, refuse: bool = True
                ) -> MemoryPlan:
    """The plan for running `coords_list` (the probes that will run) within `budget`: as many of the asked workers
    per family as fit (None asked: `concurrency.default_workers`' share of the cores; a dict: per process key),
    else families taking turns; BadInput when even that does not fit (see the module). With
    `refuse` False the smallest plan is returned all the same: a session's later groups (a bisect's steps, one of
    which may try a wider dtype than the start it was planned on) run, and what does not fit is TOO-BIG."""
    demand = _demand(coords_list, device, repeats)
    asked = _asked(demand, device, workers_per_family)
    serial = demand.depth  # one float64 stack at a time, by design
    workers = {key: 1 for key in asked} if serial else dict(asked)
    total, parts, live = _peak(demand, device, workers, serial)
    fewer = ""
    if budget is not None and not serial:
        # The family with the most workers for its work gives one up first, so that the families keep pace (they
        # wait for one another through the references they share); of equals, the one whose worker costs more.
        while total > budget.bytes and any(count > 1 for count in workers.values()):
            key = max((k for k, c in workers.items() if c > 1),
                      key=lambda k: (workers[k] / max(demand.work[k], 1e-9),
                                     process_bytes(demand.families[k], device) + demand.needs[k]))
            workers[key] -= 1
            total, parts, live = _peak(demand, device, workers, serial)
        if total > budget.bytes:
            serial = True
            total, parts, live = _peak(demand, device, workers, serial)
        cut = [f"{key} {workers[key]} of {asked[key]}" for key in asked if workers[key] < asked[key]]
        said = ([f"workers at once: {', '.join(cut)}"] if cut else []) + (["families take turns"] if serial else [])
        if said:
            fewer = f"{'; '.join(said)}: side by side they would need more than {budget.source}"
    if refuse and budget is not None and total > budget.bytes:
        raise BadInput(_refusal(coords_list, device, budget, total, parts, repeats))
    if budget is not None and not serial and device.startswith("cuda") and total <= budget.bytes:
        wider = _window(demand, live, budget.bytes - total)
        if wider > live:
            total, parts, live = _peak(demand, device, workers, serial, wider)
    fixed = {"parent": process_bytes("parent", device)}
    fixed.update({key: process_bytes(demand.families[key], device) for key in workers})
    kept = parts.get(_KEPT, 0)
    parent_need = kept + max((s for _, s in demand.references), default=0)
    spare = max(0, budget.bytes - total) if budget is not None else 0
    needs_sum = parent_need + sum(workers[key] * demand.needs[key] for key in workers) or 1
    return MemoryPlan(
        budget=budget, device=device, workers=workers, serial=serial, live_references=live,
        parent_cap=parent_need + spare * parent_need // needs_sum,
        worker_caps={key: demand.needs[key] + spare * demand.needs[key] // needs_sum for key in workers},
        estimate=total, needs=dict(demand.needs), parts=parts, fixed=fixed, fewer=fewer)


def _window(demand: _Demand, live: int, spare: int) -> int:
    """The references to keep at once (`live` and more): as many of the next largest as take no more than half of
    `spare`, what the plan leaves of the budget (see the module)."""
    kept_sizes = demand.kept_sizes
    extra = 0
    while live < len(kept_sizes) and extra + kept_sizes[live] <= spare // 2:
        extra += kept_sizes[live]
        live += 1
    return live


# -- phases: the small points side by side, then the large --

def group_need(coords: list[Coords], device: str, repeats: int = 1) -> int:
    """A group's (a sweep point's) size, for ordering: its largest probe's need and its reference kept."""
    return (max(probe_need(c, device, repeats, len(coords)) for c in coords)
            + max(reference_need(c, device)[0] for c in coords))


def plan_phases(groups: list[list[Coords]], device: str, budget: MemoryBudget | None,
                workers_per_family: int | None = 1, repeats: int = 1) -> list[tuple[list[int], MemoryPlan]]:
    """The groups to run (indices into `groups`, the probes that will run of each) in phases, each on a plan of its
    own: where all of them together do not fit side by side as asked, the longest run of the smallest groups that
    does comes first, then of the rest the longest run that fits half those workers, and so on; the last phase runs
    on whatever fits (fewer workers, or families taking turns).

    A plan is made for its largest probe: every worker is held to that probe's share and the parent keeps as many
    of the largest references as there are workers. A sweep's points differ in size by orders (TE's test matrix: a
    median float64 reference of 0.22 GiB, the largest 4.0 GiB), so planned together a few large points would cut
    the workers of every point (TE's matrix on an 80 GB card: two TE workers for all 619 points). A phase ends when
    its last group does, so phases are few: the workers halve from one to the next. A depth run is one phase: its
    stacks take turns by design."""
    indices = [i for i, coords in enumerate(groups) if coords]

    def plan_of(chosen: list[int], workers: int | dict[str, int] | None) -> MemoryPlan:
        return plan_memory([c for i in chosen for c in groups[i]], device, budget, workers, repeats, refuse=False)

    whole = plan_of(indices, workers_per_family)
    if budget is None or not whole.fewer or len(indices) < 2 or any(
            c.kind is ProbeKind.DEPTH for i in indices for c in groups[i]):
        return [(indices, whole)]
    asked = _asked(_demand([c for i in indices for c in groups[i]], device, repeats), device, workers_per_family)
    rest = sorted(indices, key=lambda i: group_need(groups[i], device, repeats))
    phases: list[tuple[list[int], MemoryPlan]] = []
    while rest:
        last = plan_of(rest, asked)
        if not last.fewer or all(count == 1 for count in asked.values()):
            phases.append((rest, last))
            break
        fits, fitting = _longest_fitting(rest, lambda run: plan_of(run, asked))
        if fitting is not None:
            phases.append((rest[:fits], fitting))
            rest = rest[fits:]
        asked = {key: (count + 1) // 2 for key, count in asked.items()}
    if len(phases) > 1:
        for chosen, plan in phases:
            plan.groups = len(chosen)
    return [(sorted(chosen), plan) for chosen, plan in phases]


def _longest_fitting(order: list[int], plan_of: Callable[[list[int]], MemoryPlan]) -> tuple[int, MemoryPlan | None]:
    """The longest prefix of `order` whose plan runs every worker asked (bisected: a longer run needs no less), and
    its plan; (0, None) when not even the first group's does."""
    fits, fitting = 0, None
    low, high = 0, len(order) + 1  # order[:high] does not fit
    while high - low > 1:
        middle = (low + high) // 2
        plan = plan_of(order[:middle])
        if plan.fewer:
            high = middle
        else:
            low, fits, fitting = middle, middle, plan
    return fits, fitting


def phases_document(plans: list[MemoryPlan]) -> dict:
    """The results document's "memory": the (first) plan's, and with phases each one's."""
    if not plans:
        return {}
    return {**plans[0].to_dict(), **({"phases": [plan.to_dict() for plan in plans]} if len(plans) > 1 else {})}


def phases_notes(plans: list[MemoryPlan]) -> list[str]:
    """What ran with less than asked, for the report's notes: the phases (how many points, on how many workers), and
    what the last plan ran with less than asked and why."""
    if len(plans) < 2:
        return [plan.fewer for plan in plans if plan.fewer]
    steps = "; then ".join(f"{plan.groups} on {', '.join(f'{key} {count}' for key, count in plan.workers.items())}"
                           + (" (families taking turns)" if plan.serial else "") for plan in plans)
    notes = [f"the points ran in {len(plans)} phases by size, the workers at once fewer for the larger ones "
             f"(within {plans[0].budget.source if plans[0].budget else 'the budget'}): {steps}"]
    return notes + [plans[-1].fewer] if plans[-1].fewer else notes


# -- the refusal: what would fit --

def _smallest_peak(coords_list: list[Coords], device: str, repeats: int) -> int:
    """The peak of the smallest plan (one worker per family, families taking turns)."""
    demand = _demand(coords_list, device, repeats)
    return _peak(demand, device, {key: 1 for key in demand.needs}, True)[0]


def _with(coords: Coords, seq: int | None = None, layers: int | None = None) -> Coords:
    """The same probe on a case whose sequence is `seq` (the key/value length scaled with it), or `layers` deep."""
    if layers is not None:
        return coords.replace(layers=layers)
    case = coords.case
    seq_kv = seq if case.seq_kv == case.seq else max(1, round(case.seq_kv * seq / case.seq))
    return coords.replace(case=dataclasses.replace(case, seq=seq, seq_kv=seq_kv))


def _largest(coords_list: list[Coords], device: str, available: int, repeats: int, what: str) -> int:
    """The largest seq (or depth, `what` "layers") whose smallest plan fits `available`; 0 when not even 1 does."""
    def fits(value: int) -> bool:
        changed = [_with(c, **{what: value}) if what == "seq" or c.kind is ProbeKind.DEPTH else c for c in coords_list]
        return _smallest_peak(changed, device, repeats) <= available

    longest = max((c.layers if what == "layers" else c.case.seq) for c in coords_list)
    lo, hi = 0, longest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _refusal(coords_list: list[Coords], device: str, budget: MemoryBudget, total: int, parts: dict[str, int],
             repeats: int) -> str:
    worst = list(parts.items())[:2]
    why = ", ".join(f"{what} {size(n)}" for what, n in worst)
    cases = {c.case.key(): c.case for c in coords_list}
    biggest = max(cases.values(), key=lambda case: _smallest_peak([c for c in coords_list if c.case == case],
                                                                  device, repeats))
    mine = [c for c in coords_list if c.case == biggest]
    depth = [c for c in mine if c.kind is ProbeKind.DEPTH]
    hints = []
    if depth:
        deepest = max(c.layers for c in depth)
        layers = _largest(mine, device, budget.bytes, repeats, "layers")
        hints.append(f"the deepest --layers that fits is about {layers}" if layers else
                     f"not even 1 layer fits at {deepest}'s sizes")
    seq = _largest(mine, device, budget.bytes, repeats, "seq")
    hints.append(f"at batch {biggest.batch}, {biggest.heads} heads, head dim {biggest.head_dim}, the longest --seq "
                 f"that fits is about {seq}" if seq else "not even seq 1 fits: lower --batch or --heads")
    return (f"{biggest.short()}{' at ' + str(max(c.layers for c in depth)) + ' layers' if depth else ''} needs about "
            f"{size(total)} of memory ({why}), but the budget is {size(budget.bytes)} ({budget.source}); "
            f"{'; '.join(hints)}")
