"""Memory, before anything starts: what a request's probes need at their peak, against what the device
has free, and a refusal that says how much would be needed and what would fit.

The estimate adds the float64 references the parent keeps (`reference_bytes`; a depth stack's per-layer dQ)
to the larger of computing one (its tiles; a depth stack's float64 replica) and what the workers hold at once:
per backend family the largest probe one worker runs (its inputs, the layout's buffers, outputs and gradients,
with --repeats the copy of the first repeat's, the comparison's chunks and the path's own working memory,
`Backend.memory`: a path that materialises the scores grows with seq x seq_kv; the local baseline always runs,
and always does). Families run concurrently, so their peaks add up, but depth stacks run one family at a
time. On a GPU the parent and the workers share the one device, on the CPU the machine's RAM.
It is an estimate of the large allocations, not of the allocator's slack: it refuses what cannot fit, so
that a request too large fails in a second with a reason instead of after minutes, blaming a kernel.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from attn_doctor import backends
from attn_doctor.core.case import DTYPE_BYTES, Case, tp_shard
from attn_doctor.core.coords import Coords, ProbeKind
from attn_doctor.core.errors import BadInput
from attn_doctor.numerics.metrics import CHUNK_ELEMENTS

GIB = 1 << 30


@dataclass
class Need:
    total: int
    parts: dict[str, int] = field(default_factory=dict)  # what needs it -> bytes, for the refusal's message


def _elements(case: Case) -> tuple[int, int]:
    return case.batch * case.seq * case.heads * case.head_dim, case.batch * case.seq_kv * case.kv_heads * case.head_dim


def _call_bytes(coords: Coords, case: Case, repeats: int = 1) -> tuple[int, int]:
    """(tensors, path): one call's inputs, layout buffers, outputs, gradients and comparison; the path's own.
    A call repeated (--repeats) keeps a copy of its first repeat's outputs and gradients to compare with."""
    item = DTYPE_BYTES[case.dtype]
    q, kv = _elements(case)
    views = 2 if coords.layout == "head_slice" else 1  # the head_slice layout's wider buffers
    tensors = (2 * q + 2 * kv) * item * 3 + (q + 2 * kv) * item * (views - 1) + min(max(q, kv), CHUNK_ELEMENTS) * 8 * 5
    if repeats > 1 and coords.kind_rules.repeats:
        tensors += (2 * q + 2 * kv) * item
    path = backends.memory(coords.backend, case)
    return tensors, path.saved + path.transient


def _reference(case: Case, device: str) -> tuple[int, int]:
    import torch

    from attn_doctor.numerics.reference import reference_bytes

    return reference_bytes(case.batch, case.seq, case.seq_kv, case.heads, case.kv_heads, case.head_dim,
                           torch.device(device.split(":")[0]))


def probe_need(coords: Coords, repeats: int = 1) -> tuple[int, int]:
    """(tensors, path) bytes one worker needs at the probe's peak (`repeats`: --repeats, which only single
    calls honour)."""
    from attn_doctor.probes.stack import stack_bytes

    case = coords.case
    tensors, path = _call_bytes(coords, case, repeats)
    if coords.kind is ProbeKind.TP:
        return tensors * 2, path  # the unsharded run is kept while the shards run
    if coords.kind is ProbeKind.DEPTH:
        item = DTYPE_BYTES[case.dtype]
        saved = backends.memory(coords.backend, tp_shard(case, coords.tp)).saved * coords.tp
        local = backends.memory(backends.BASELINE, case).saved
        # The baseline's stack ran first in this worker; its per-layer dQ stays while the backend's runs.
        stack = max(stack_bytes(case, coords.layers, item, saved), stack_bytes(case, coords.layers, item, local))
        return stack + coords.layers * _elements(case)[0] * item, path
    return tensors, path


def parent_need(coords: Coords, device: str) -> tuple[int, int]:
    """(kept, scratch): bytes of the float64 reference the parent holds while the probe runs, and the peak
    of computing it (freed before the workers use it)."""
    from attn_doctor.probes.stack import stack_bytes

    case = coords.case
    if coords.kind is ProbeKind.DEPTH:
        q, kv = _elements(case)
        saved = (2 * q + 2 * kv + case.batch * case.heads * case.seq) * 8  # what float64 attention keeps per layer
        return coords.layers * q * 8, stack_bytes(case, coords.layers, 8, saved) + sum(_reference(case, device))
    return _reference(case, device)


def estimate(coords_list: list[Coords], device: str, workers_per_family: int = 1, repeats: int = 1) -> Need:
    """The peak of running these probes: the references the parent keeps, plus the larger of computing one
    and what the workers hold at once. Families run concurrently (their largest probes add up, times the
    workers of a family); depth stacks run one family at a time (the largest stack counts). With `repeats`
    (--repeats) > 1 a single call also keeps its first repeat's outputs and gradients."""
    parts: dict[str, int] = {}
    per_family: dict[str, list[Coords]] = defaultdict(list)
    references: dict[tuple, tuple[int, int]] = {}
    for coords in coords_list:
        per_family[coords.backend.family].append(coords)
        key = (coords.case.key(), coords.reference_layers)
        if key not in references:
            references[key] = parent_need(coords, device)
    depth = any(c.kind is ProbeKind.DEPTH for c in coords_list)
    concurrent = 1 if depth else max(1, workers_per_family)
    kept = sum(sorted((k for k, _ in references.values()), reverse=True)[:concurrent])
    scratch = max(s for _, s in references.values())
    workers: dict[str, int] = {}
    for family, family_coords in per_family.items():
        tensors, path, name = max((*probe_need(c, repeats), c.backend.name) for c in family_coords)
        if path > tensors:
            workers[f"{name}'s working memory (its scores)"] = path * concurrent
            workers[f"the {family} worker's tensors"] = tensors * concurrent
        else:
            workers[f"the {family} worker's tensors"] = (tensors + path) * concurrent
    at_once = max(workers.values()) if depth else sum(workers.values())
    parts["the float64 reference"] = kept + (scratch if scratch > at_once else 0)
    if at_once >= scratch:
        parts.update(sorted(workers.items(), key=lambda item: -item[1])[:1] if depth else workers)
    return Need(kept + max(scratch, at_once), parts)


def available_bytes(device: str) -> tuple[int | None, str]:
    """Bytes free where the probes will run, and how to say where; (None, "") when it cannot be known."""
    if device.startswith("cuda"):
        try:
            import torch

            index = int(device.split(":")[1]) if ":" in device else torch.cuda.current_device()
            free, _total = torch.cuda.mem_get_info(index)
            return int(free), f"free on {device}"
        except Exception:  # noqa: BLE001 - no estimate is better than a wrong refusal
            return None, ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "of RAM available"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of RAM free"
    except (ValueError, OSError, AttributeError):
        return None, ""


def size(n: float) -> str:
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", GIB), ("MiB", 1 << 20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _with_seq(coords: Coords, seq: int) -> Coords:
    """The same probe on a case whose sequence is `seq` (the key/value length scaled with it)."""
    case = coords.case
    seq_kv = seq if case.seq_kv == case.seq else max(1, round(case.seq_kv * seq / case.seq))
    return coords.replace(case=dataclasses.replace(case, seq=seq, seq_kv=seq_kv))


def largest_seq(coords_list: list[Coords], device: str, workers_per_family: int, available: int,
                repeats: int = 1) -> int:
    """The largest seq (the others as given) whose estimate fits `available`; 0 when not even 1 does."""
    def fits(seq: int) -> bool:
        return estimate([_with_seq(c, seq) for c in coords_list], device, workers_per_family,
                        repeats).total <= available

    longest = max(c.case.seq for c in coords_list)
    lo, hi = 0, longest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def check_fits(coords_list: list[Coords], device: str, workers_per_family: int = 1,
               available: tuple[int | None, str] | None = None, repeats: int = 1) -> None:
    """BadInput, before any work, when the probes' estimate exceeds the memory free on the device."""
    if not coords_list:
        return
    free, where = available if available is not None else available_bytes(device)
    if free is None:
        return
    need = estimate(coords_list, device, workers_per_family, repeats)
    if need.total <= free:
        return
    worst = sorted(need.parts.items(), key=lambda item: -item[1])[:2]
    why = ", ".join(f"{what} {size(n)}" for what, n in worst)
    cases = {c.case.key(): c.case for c in coords_list}
    biggest = max(cases.values(), key=lambda case: estimate([c for c in coords_list if c.case == case], device,
                                                            workers_per_family, repeats).total)
    fit = largest_seq([c for c in coords_list if c.case == biggest], device, workers_per_family, free, repeats)
    hint = (f"at batch {biggest.batch}, {biggest.heads} heads, head dim {biggest.head_dim}, the longest --seq that "
            f"fits is about {fit}" if fit else "not even seq 1 fits: lower --batch or --heads")
    raise BadInput(f"{biggest.short()} needs about {size(need.total)} of memory ({why}), but {size(free)} {where}; "
                   f"{hint}")
