"""Workers that change family: when a family has no unit left to take in a phase, each of its workers, as it finishes
its last one, gives its core and its memory to the family with the most work left per worker.

Why: the cores are shared among the families by their planned work (`concurrency.default_workers`), but the
families do not run as planned: TE's workers start seconds after SDPA's and local's (TE's import), the weights are
averages, and whichever family ends first would leave its cores idle while the last one runs on with the workers
it was given. On an H100 (reports/h100/issue51/lease6, te-coverage from a cold start) local ran dry about 30 s
into a 58 s sweep and SDPA about 40 s in, and their 7 workers went on as TE's (16 at once). A worker forked from
its family's fork server starts in about a second, so moving a core is cheap where the receiving family's workers
are forked, and worth it where its share of what is left takes several times that (`WORTH_S`). Workers of a
family that is not forked (its server refused) never receive one: each would import its library anew.

Memory: a worker that hands over is closed first, and what its plan held for it (`MemoryPlan.fixed` and its cap)
goes to a pool, with as many idle workers of drained families as the new worker needs; it takes its own
family's share from that pool, so the plan's estimate is never exceeded. A drained worker that nobody needs stays
as it is (its caches warm for a later phase). Pure bookkeeping here; `execution.session` closes and starts the
processes.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

# A forked worker's start is about a second (the fork 0.2 s, then its CUDA context and first kernel: 0.7-0.9 s for
# SDPA's and local's on the H100, lease5). A new worker is worth it when its share of the family's remaining work is
# at least three starts: then the start costs a third of what it brings at most, and the estimate's error (the
# weights are averages, `Backend.probe_seconds`) is smaller than the gain.
WORTH_S = 3.0


def receiver(left_s: dict[str, float], left_units: dict[str, int], live: dict[str, int], forked: set[str],
             footprint: dict[str, int], room: int | None) -> str | None:
    """The family (process key) a freed worker should go to: of those whose workers are forked and that have more
    units left than workers serving them, the one with the most seconds left per worker, if a new worker's share
    (`left_s / (live + 1)`) is worth its start (`WORTH_S`) and its memory (`footprint`) fits `room` (None: no
    budget). None when no family qualifies."""
    best, best_share = None, WORTH_S
    for key, seconds in left_s.items():
        if key not in forked or left_units.get(key, 0) <= live.get(key, 0):
            continue
        if room is not None and footprint.get(key, 0) > room:
            continue
        share = seconds / (live.get(key, 0) + 1)
        if share >= best_share:
            best, best_share = key, share
    return best


@dataclass
class Handover:
    """One phase's bookkeeping: per process key the units not yet taken (and their seconds), the workers serving it,
    and the memory given up by workers that were closed."""

    left_s: dict[str, float]
    left_units: dict[str, int]
    live: dict[str, int]
    footprint: dict[str, int]  # bytes the plan holds for one worker of the key (its fixed part and its cap)
    budgeted: bool  # False: no memory budget (nothing to hold the pool to)
    forked: set[str] = field(default_factory=set)  # keys with a worker known to be forked from a fork server
    room: int = 0  # bytes given up by closed workers, not yet taken by new ones
    idle: list[tuple[str, Any]] = field(default_factory=list)  # (key, worker) drained and kept, longest idle first
    moves: list[tuple[str, str]] = field(default_factory=list)  # (from, to), in order: the phase's record
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def took(self, key: str, seconds: float) -> None:
        """A worker of `key` took a unit of `seconds` (`Backend.probe_seconds`, summed)."""
        with self._lock:
            self.left_units[key] -= 1
            self.left_s[key] = max(0.0, self.left_s[key] - seconds)

    def is_forked(self, key: str) -> None:
        """A worker of `key` said it was forked: new ones of that key start in about a second."""
        with self._lock:
            self.forked.add(key)

    def drained(self, key: str, worker: Any) -> tuple[list[Any], str | None]:
        """`worker`, of `key`, found no unit left: (the workers to close, the key it serves next). Where a key
        qualifies (`receiver`, counting the memory of every idle worker as free), `worker` is closed, and as many
        other idle ones as the new worker's memory needs (the longest idle first); else `worker` stays as it is,
        idle (a later phase of its family finds its caches warm: closed at once, te-tests' workers each built their
        kernels again in its next phase, lease6), its memory counted by later hand-overs. A worker of a family that
        is not forked neither moves nor is closed (a later phase would import its library anew)."""
        with self._lock:
            self.live[key] -= 1
            if key not in self.forked:
                return [], None
            self.idle.append((key, worker))
            reclaimable = self.room + sum(self.footprint.get(k, 0) for k, _ in self.idle)
            chosen = receiver(self.left_s, self.left_units, self.live, self.forked, self.footprint,
                              reclaimable if self.budgeted else None)
            if chosen is None:
                return [], None
            closing = [self.idle.pop()]  # this worker first: its thread goes on with the new one
            self.room += self.footprint.get(key, 0)
            while self.budgeted and self.room < self.footprint.get(chosen, 0) and self.idle:
                closing.append(self.idle.pop(0))
                self.room += self.footprint.get(closing[-1][0], 0)
            self.room -= self.footprint.get(chosen, 0)
            self.live[chosen] += 1
            self.moves.append((key, chosen))
            return [w for _, w in closing], chosen
