"""`bisect`: from a failing probe to the smallest one that still fails and the conditions it needs.

A minimizer in the style of delta debugging and PyTorch's compiler bisector: categorical knobs are moved
to their plainest value (one at a time, then all that kept the failure together), integer knobs are
binary-searched down to the smallest value that still fails. A knob whose simplification makes the
failure disappear is a necessary condition, recorded with the values on both sides of the boundary.
The knobs are a table (`knobs.py`).

Each step must reproduce the *same* failure as the start (`Signature`): the same pass (forward or
backward), the start's worst tensor failing the same way (error, systematic bias or NaN/Inf), its error
within a factor of ERROR_SPAN of the start's, and not on a tensor that cancels where the
start's did not. A step that fails differently counts as passing for that knob: shrinking a case must not
trade the user's fault for another one (or for a degenerate case every kernel is noisy on).

The engine is pure: it only sees a `probe(coords) -> Outcome` callable, so it is tested with fake
predicates and driven by real kernels by the driver (`driver.py`). An Outcome that is attn-doctor's own
error (`internal`) never counts as a failure of the kernel.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from attn_doctor.bisect import knobs
from attn_doctor.core.coords import Coords
from attn_doctor.results.bisect_record import NOTE_CHARS, Condition, Step


# A step's error may differ from the start's by this factor either way and still be the same failure: one
# order of magnitude. The error (against the terms' scale) is compared, not its ratio to the yardstick: a 5%
# fault is 5% in every dtype, while the yardstick moves with the dtype's epsilon (12x in bf16, 1e5x in fp32).
ERROR_SPAN = 10.0

# A probe's note keeps this many characters of its row's reason (`report` reads older documents' numbers
# from them: a clause that reaches this length may have been cut).


@dataclass(frozen=True)
class TensorFailure:
    """How one tensor fails: its kind ("error", "bias" or "nonfinite"), its ratio to the yardstick, its
    error against the terms' scale, and whether the exact tensor cancels there."""

    kind: str
    ratio: float
    error: float = math.nan
    cancelled: bool = False


@dataclass(frozen=True)
class Outcome:
    verdict: str  # PASS / FAIL / SKIP / ERROR
    reason: str = ""
    tensors: tuple[str, ...] = ()  # the failing tensors
    extra: dict = field(default_factory=dict)
    internal: bool = False  # an ERROR that is attn-doctor's own, not the kernel's
    failures: dict[str, TensorFailure] = field(default_factory=dict)  # per failing tensor, when known
    measured: tuple[str, ...] | None = None  # every tensor judged (None: not known)

    def lead(self, among: tuple[str, ...] | None = None) -> str | None:
        """The failing tensor that fails worst (NaN/Inf first, then by ratio), among `among` if given: a
        tensor another probe does not have (the sink's gradient, once the sink is simplified away) cannot
        be what it fails the same way on."""
        failures = {n: f for n, f in self.failures.items() if among is None or n in among}
        if not failures:
            names = [n for n in self.tensors if among is None or n in among]
            return names[0] if names else None
        return max(failures, key=lambda n: (failures[n].kind == "nonfinite", failures[n].ratio))

    def differs_from(self, start: Outcome) -> str | None:
        """Why this FAIL is not the start's failure (see the module docstring), or None when it is."""
        if ("out" in self.tensors) != ("out" in start.tensors):
            where = "forward" if "out" in self.tensors else "backward only"
            return f"fails in the {where}, the start did not"
        lead = start.lead(among=self.measured)
        if lead is None or not start.failures:
            return None if lead is None or lead in self.tensors else f"{lead} passes"
        if lead not in self.failures:
            return f"{lead} passes" + (f"; fails on {', '.join(self.tensors)} instead" if self.tensors else "")
        mine, theirs = self.failures[lead], start.failures[lead]
        if mine.kind != theirs.kind:
            return f"{lead} fails by {mine.kind}, the start by {theirs.kind}"
        if mine.cancelled and not theirs.cancelled:
            return f"{lead} cancels here (a degenerate case)"
        if mine.kind == "error" and not _same_magnitude(mine.error, theirs.error):
            return f"{lead}'s error is {mine.error:.3g}, the start's {theirs.error:.3g}"
        return None


def _same_magnitude(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return True  # not measured (an outcome built without it): nothing to compare
    if math.isinf(a) or math.isinf(b) or a <= 0 or b <= 0:
        return a == b
    return 1 / ERROR_SPAN <= a / b <= ERROR_SPAN


@dataclass
class BisectResult:
    start: Coords
    start_outcome: Outcome
    minimal: Coords
    minimal_outcome: Outcome
    necessary: list[Condition]
    steps: list[Step]
    trail: list[Coords] = field(default_factory=list)  # the simplifications adopted, in order
    outcomes: dict[Coords, Outcome] = field(default_factory=dict, repr=False)

    def outcome_at(self, config: Coords) -> Outcome:
        return self.outcomes[config]

    def to_dict(self) -> dict:
        return {
            "start_case": knobs.knob_dict(self.start),
            "minimal_case": knobs.knob_dict(self.minimal),
            "necessary": [dataclasses.asdict(c) for c in self.necessary],
            "probes": [dataclasses.asdict(s) for s in self.steps],
        }


class NothingToBisect(Exception):
    """The starting probe does not fail."""


class CannotBisect(Exception):
    """The starting probe could not be judged: attn-doctor itself failed on it."""


RunProbe = Callable[[Coords], Outcome]  # runs one probe and says how it came out


def _error_class(reason: str) -> str:
    """What kind of crash: 'hung', 'worker ... died (signal SIGSEGV)' -> 'died (signal SIGSEGV)', 'TypeError'."""
    if reason.startswith("hung"):
        return "hung"
    if "died" in reason:
        return reason[reason.index("died"):].split(":")[0]
    return reason.split(":")[0]


class Bisector:
    def __init__(self, probe: RunProbe, repeats: int = 1, valid: Callable[[Coords], bool] | None = None):
        self.probe = probe
        self.repeats = max(1, repeats)
        self.valid = valid or (lambda coords: True)
        self.steps: list[Step] = []
        self._start: Outcome | None = None  # the failure every step must reproduce
        self.trail: list[Coords] = []  # every configuration adopted, in order
        self._start_error: str | None = None
        self._cache: dict[Coords, tuple[bool, Outcome]] = {}

    def fails(self, config: Coords, knob: str = "start", tried: str = "") -> bool:
        """The same verdict `run` gives, with the start's failure (see the module docstring); any of
        --repeats runs failing so counts (a nondeterministic fault must not look fixed by luck); a crash
        counts only if the start crashed the same way; attn-doctor's own error never counts."""
        if config in self._cache:
            return self._cache[config][0]  # already probed (and listed among the steps)
        outcome = Outcome("PASS")
        failing, note = False, ""
        for _ in range(self.repeats):
            outcome = self.probe(config)
            if outcome.verdict == "FAIL" and self._start_error is None:
                different = outcome.differs_from(self._start) if self._start is not None else None
                failing = different is None
                note = f"fails differently ({different}): counted as passing" if different else ""
            elif outcome.verdict == "ERROR" and not outcome.internal:
                failing = self._start_error is not None and _error_class(outcome.reason) == self._start_error
            if failing:
                note = ""
                break
        self._cache[config] = (failing, outcome)
        self.steps.append(Step(knob, tried, config.describe(), outcome.verdict, failing,
                               "; ".join(filter(None, [note, outcome.reason[:NOTE_CHARS]]))))
        return failing

    def outcome(self, config: Coords) -> Outcome:
        return self._cache[config][1]

    def run(self, start: Coords) -> BisectResult:
        for _ in range(self.repeats):  # the start gets --repeats too: a flaky fault must not look absent
            first = self.probe(start)
            if first.verdict in ("FAIL", "ERROR"):
                break
        if first.internal:
            raise CannotBisect(f"attn-doctor itself failed on the starting case ({first.reason}); this is a bug "
                               "in attn-doctor, not in the kernel")
        if first.verdict == "ERROR":
            self._start_error = _error_class(first.reason)
        self._start = first
        failing = first.verdict in ("FAIL", "ERROR")
        self.steps.append(Step("start", "", start.describe(), first.verdict, failing, first.reason[:NOTE_CHARS]))
        if not failing:
            raise NothingToBisect(f"the starting case does not fail ({first.verdict}): {start.describe()}")
        self._cache[start] = (True, first)
        necessary: list[Condition] = []
        config = self._categorical(start, necessary)
        config = self._integers(config, necessary)
        outcomes = {c: o for c, (f, o) in self._cache.items() if f}
        return BisectResult(start, first, config, self.outcome(config), necessary, self.steps, self.trail, outcomes)

    # --- categorical knobs -------------------------------------------------------------------------------

    def _categorical(self, config: Coords, necessary: list[Condition]) -> Coords:
        moves = [move for move in knobs.moves(config) if self.valid(move[2])]
        still_fails = [self.fails(candidate, knob, tried) for knob, tried, candidate in moves]
        kept, seen = [], set()
        for move, failing in zip(moves, still_fails):  # of several dtypes that keep failing, adopt the plainest
            if failing and move[0] not in seen:
                kept.append(move)
                seen.add(move[0])
        adopted = set()
        together = config
        for knob, _, candidate in kept:
            together = knobs.carry(together, knob, candidate) if together is not None else None
        if len(kept) > 1 and together is not None and self.valid(together) and self.fails(
                together, "+".join(k for k, _, _ in kept), "together"):
            config, adopted = together, {k for k, _, _ in kept}
            self.trail.append(config)
        else:
            for knob, _, candidate in kept:  # one at a time, when they do not all combine
                step = knobs.carry(config, knob, candidate)
                if step is not None and self.valid(step) and (len(kept) == 1 or self.fails(step, knob, "+ earlier")):
                    config = step
                    adopted.add(knob)
                    self.trail.append(config)
        # What is left unsimplified is necessary only if simplifying it on top of the adopted changes
        # passes; a move that still fails there is adopted after all.
        passing: dict[str, list] = {}
        for knob, tried, original in moves:
            if knob in adopted:
                continue
            candidate = knobs.carry(config, knob, original)
            if candidate is None or not self.valid(candidate) or candidate == config:
                continue
            if self.fails(candidate, knob, f"{tried} on the minimal case"):
                config = candidate
                adopted.add(knob)
                passing.pop(knob, None)
                self.trail.append(config)
            else:
                passing.setdefault(knob, []).append(self._passing_value(candidate, knob))
        for knob, values in passing.items():
            if knob not in adopted:
                necessary.append(Condition(knob, knobs.value(config, knob), ", ".join(map(str, values))))
        return config

    def _passing_value(self, candidate: Coords, knob: str) -> str:
        outcome = self.outcome(candidate)
        value = knobs.value(candidate, knob)
        if outcome.verdict == "PASS":
            return f"{value}"
        different = outcome.differs_from(self._start) if outcome.verdict == "FAIL" and self._start else None
        if different:
            return f"{value} (fails differently: {different})"
        return f"{value} ({outcome.verdict.lower()}: {outcome.reason[:80]})"

    # --- integer knobs -----------------------------------------------------------------------------------

    def _integers(self, config: Coords, necessary: list[Condition]) -> Coords:
        for knob in knobs.INTEGER:
            values = knob.values(config)
            if len(values) < 2:
                continue
            candidates = [v for v in values if self.valid(knob.set(config, v))]
            current = knob.value(config)
            if current not in candidates:
                continue
            candidates = [v for v in candidates if v <= current]
            lo, hi = -1, candidates.index(current)  # candidates[hi] fails; candidates[lo] passes (if lo >= 0)
            if self.fails(knob.set(config, candidates[0]), knob.name, str(candidates[0])):
                hi = 0
            else:
                lo = 0
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if self.fails(knob.set(config, candidates[mid]), knob.name, str(candidates[mid])):
                        hi = mid
                    else:
                        lo = mid
            if lo >= 0:
                # The exact boundary replaces a categorical condition on the same knob (layers, seq_kv).
                necessary[:] = [c for c in necessary if c.knob != knob.name]
                necessary.append(Condition(knob.name, candidates[hi], self._passing_value(
                    knob.set(config, candidates[lo]), knob.name)))
            if candidates[hi] != current:
                config = knob.set(config, candidates[hi])
                self.trail.append(config)
        return config


def valid_config(coords: Coords) -> bool:
    return knobs.valid(coords)
