"""`bisect`: from a failing probe to the smallest one that still fails and the conditions it needs.

A minimizer in the style of delta debugging and PyTorch's compiler bisector: categorical knobs are moved
to their plainest value (one at a time, then all that kept the failure together), integer knobs are
binary-searched down to the smallest value that still fails. The knobs are a table (`knobs.py`).

Every probe stands in one of three relations to the start's failure:
- SAME: it fails the way the start does (`Outcome.differs_from`): the same pass (forward or backward), the
  start's worst tensor failing the same way (error, systematic bias or NaN/Inf), not on a tensor that cancels
  where the start's did not, and doing the same to a row it touches: its worst row's error (over that row's
  own terms' scale) within a factor of ERROR_SPAN of the start's. How many rows the fault touches is free: a
  kernel wrong on the tokens past 512 is wrong on 1 row of 513 and on 512 of 1024, so its whole-tensor error
  moves 20x while each wrong row is as wrong as before. A crashing start is SAME only on the same crash.
- GONE: it passes. Only this makes a knob a necessary condition.
- CHANGED: anything else (fails differently, crashes, cannot run, or attn-doctor's own error there). Such a
  simplification is neither adopted nor a condition: it is reported as a change (`Change`), with what changed.

A knob whose values are alternatives rather than simplifications (the cuDNN build TE loads) is tried at every
value and never adopted: a value where the case passes makes a condition ("fails at cudnn 9.14.0, passes at
9.19.0"); one where it still fails is only recorded in the steps (the report's "reproduced with").

Integer boundaries of two lengths may be one relation (seq > seq_kv), not a threshold: the boundary is tried
again at another value of the other length, and a boundary that moves with it is reported as the relation.

Before the result is returned, every necessary condition is confirmed: the minimal case fails again, and with
that one knob simplified it passes again (both rerun, not read from the cache). A condition whose rerun
disagrees is reported as a change, never as necessary; one whose simplification still fails on the minimal
case was not needed there, and the simplification is adopted.

The engine is pure: it only sees a `probe(coords) -> Outcome` callable, so it is tested with fake
predicates and driven by real kernels by the driver (`driver.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from attn_doctor.bisect import knobs
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import BadInput
from attn_doctor.results.bisect_record import NOTE_CHARS, ON_MINIMAL, Change, Condition, Step

# A step's worst row may be off by this factor either way from the start's and still be the same failure: one
# order of magnitude. Errors are compared on the terms' scale, not as ratios to the yardstick: a 5% fault is 5%
# in every dtype, while the yardstick moves with the dtype's epsilon (12x in bf16, 1e5x in fp32).
ERROR_SPAN = 10.0

SAME, GONE, CHANGED = "same", "gone", "changed"


@dataclass(frozen=True)
class TensorFailure:
    """How one tensor fails: its kind ("error", "bias" or "nonfinite"), its ratio to the yardstick, its
    error against the terms' scale, whether the exact tensor cancels there, and its worst row's error over
    that row's terms' scale (what the fault does to a row it touches)."""

    kind: str
    ratio: float
    error: float = math.nan
    cancelled: bool = False
    row_error: float = math.nan


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
        if mine.kind == "error":
            by_row = not (math.isnan(mine.row_error) or math.isnan(theirs.row_error))
            a, b = (mine.row_error, theirs.row_error) if by_row else (mine.error, theirs.error)
            if not _same_magnitude(a, b):
                what = "worst row is off by" if by_row else "error is"
                return f"{lead}'s {what} {a:.3g}, the start's {b:.3g}"
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
    changes: list[Change] = field(default_factory=list)  # simplifications that changed the failure

    def outcome_at(self, config: Coords) -> Outcome:
        return self.outcomes[config]

    def to_dict(self) -> dict:
        return {
            "start_case": knobs.knob_dict(self.start),
            "minimal_case": knobs.knob_dict(self.minimal),
            "necessary": [c.to_dict() for c in self.necessary],
            "changes": [dataclasses.asdict(c) for c in self.changes],
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


@dataclass(frozen=True)
class _Probed:
    state: str  # SAME, GONE or CHANGED
    outcome: Outcome
    why: str = ""  # what changed (CHANGED only)


class Bisector:
    def __init__(self, probe: RunProbe, repeats: int = 1, valid: Callable[[Coords], bool] | None = None):
        self.probe = probe
        self.repeats = max(1, repeats)
        self.valid = valid or (lambda coords: True)
        self.steps: list[Step] = []
        self.trail: list[Coords] = []  # every configuration adopted, in order
        self.changes: list[Change] = []
        self._start: Outcome | None = None  # the failure every step must reproduce
        self._start_at: Coords | None = None  # where it started (every necessary condition holds there)
        self._start_error: str | None = None
        self._probed: dict[Coords, _Probed] = {}
        # Per necessary condition (by knob): a configuration where it was simplified, and how to simplify it on
        # another one (what the confirmation reruns).
        self._undo: dict[str, Callable[[Coords], Coords | None]] = {}
        self._tied: set[str] = set()  # integer knobs already moved by a relation

    # --- one probe, and how it stands to the start's failure ---------------------------------------------

    def _classify(self, outcome: Outcome) -> tuple[str, str]:
        if outcome.verdict == "PASS":
            return GONE, ""
        if outcome.internal:
            return CHANGED, f"attn-doctor itself failed there ({outcome.reason[:80]})"
        if self._start_error is not None:  # the start crashed: only the same crash is the same failure
            if outcome.verdict == "ERROR":
                crash = _error_class(outcome.reason)
                return (SAME, "") if crash == self._start_error else (CHANGED, f"crashes differently ({crash})")
            if outcome.verdict == "FAIL":
                return CHANGED, "runs, and computes wrong values instead of crashing"
        elif outcome.verdict == "FAIL":
            different = outcome.differs_from(self._start) if self._start is not None else None
            return (CHANGED, f"fails differently: {different}") if different else (SAME, "")
        elif outcome.verdict == "ERROR":
            return CHANGED, f"crashes instead ({_error_class(outcome.reason)})"
        return CHANGED, f"cannot run there ({outcome.reason[:80]})"

    def state(self, config: Coords, knob: str = "start", tried: str = "", fresh: bool = False) -> str:
        """SAME, GONE or CHANGED (see the module docstring). Any of --repeats runs failing the same way makes
        it SAME (a nondeterministic fault must not look fixed by luck); GONE needs every run to pass. A
        configuration is probed once unless `fresh` (a confirming rerun)."""
        if config in self._probed and not fresh:
            return self._probed[config].state
        probed = None
        for _ in range(self.repeats):
            outcome = self.probe(config)
            state, why = self._classify(outcome)
            if probed is None or state == SAME or (state == CHANGED and probed.state == GONE):
                probed = _Probed(state, outcome, why)
            if state == SAME:
                break
        self._probed[config] = probed
        note = f"{probed.why}: not the start's failure" if probed.state == CHANGED else ""
        self.steps.append(Step(knob, tried, config.describe(), probed.outcome.verdict, probed.state == SAME,
                               "; ".join(filter(None, [note, probed.outcome.reason[:NOTE_CHARS]]))))
        return probed.state

    def fails(self, config: Coords, knob: str = "start", tried: str = "", fresh: bool = False) -> bool:
        """Whether `config` fails the start's way (see `state`)."""
        return self.state(config, knob, tried, fresh) == SAME

    def outcome(self, config: Coords) -> Outcome:
        return self._probed[config].outcome

    def _why(self, config: Coords) -> str:
        probed = self._probed[config]
        return probed.why if probed.state == CHANGED else "passes"

    # --- the search ----------------------------------------------------------------------------------------

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
        self._start, self._start_at = first, start
        failing = first.verdict in ("FAIL", "ERROR")
        self.steps.append(Step("start", "", start.describe(), first.verdict, failing, first.reason[:NOTE_CHARS]))
        if not failing:
            raise NothingToBisect(f"the starting case does not fail ({first.verdict}): {start.describe()}")
        self._probed[start] = _Probed(SAME, first)
        necessary: list[Condition] = []
        config = self._categorical(start, necessary)
        config = self._integers(config, necessary)
        config = self._confirm(config, necessary)
        outcomes = {c: p.outcome for c, p in self._probed.items() if p.state == SAME}
        return BisectResult(start, first, config, self.outcome(config), necessary, self.steps, self.trail, outcomes,
                            self.changes)

    def _necessary(self, necessary: list[Condition], condition: Condition,
                   undo: Callable[[Coords], Coords | None]) -> None:
        """Record `condition`, replacing any earlier one on the same knob (an integer boundary replaces the
        categorical condition on layers or seq_kv)."""
        necessary[:] = [c for c in necessary if c.knob != condition.knob]
        necessary.append(condition)
        self._undo[condition.knob] = undo

    # --- categorical knobs -------------------------------------------------------------------------------

    def _categorical(self, config: Coords, necessary: list[Condition]) -> Coords:
        moves = [move for move in knobs.moves(config) if self.valid(move[2])]
        still_fails = [self.fails(candidate, knob, tried) for knob, tried, candidate in moves]
        kept, seen = [], set()
        for move, failing in zip(moves, still_fails):  # of several dtypes that keep failing, adopt the plainest
            if failing and move[0] not in seen and knobs.CATEGORICAL_BY_NAME[move[0]].adopt:
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
        # What is left unsimplified is necessary only if simplifying it on top of the adopted changes makes the
        # failure go away; a move that still fails there is adopted after all; one that changes the failure is
        # neither.
        gone: dict[str, list[Coords]] = {}
        changed: dict[str, list[Change]] = {}
        for knob, tried, original in moves:
            if knob in adopted:
                continue
            candidate = knobs.carry(config, knob, original)
            if candidate is None or not self.valid(candidate) or candidate == config:
                continue
            state = self.state(candidate, knob, f"{tried}{ON_MINIMAL}")
            if state == SAME and not knobs.CATEGORICAL_BY_NAME[knob].adopt:
                continue  # another value it fails with too: recorded in the steps, kept as it was
            if state == SAME:
                config = candidate
                adopted.add(knob)
                self.trail.append(config)
            elif state == GONE:
                gone.setdefault(knob, []).append(candidate)
            else:
                changed.setdefault(knob, []).append(Change(knob, tried, self._why(candidate)))
        for knob, candidates in gone.items():
            if knob not in adopted:
                passing = ", ".join(str(knobs.value(c, knob)) for c in candidates)
                self._necessary(necessary, Condition(knob, knobs.value(config, knob), passing),
                                lambda c, knob=knob, to=candidates[0]: knobs.carry(c, knob, to))
        self.changes += [change for knob, found in changed.items() if knob not in adopted for change in found]
        return config

    # --- integer knobs -----------------------------------------------------------------------------------

    def _integers(self, config: Coords, necessary: list[Condition]) -> Coords:
        for knob in knobs.INTEGER:
            if knob.name in self._tied:
                continue
            values = knob.values(config)
            if len(values) < 2:
                continue
            candidates = [v for v in values if self.valid(knob.set(config, v))]
            current = knob.value(config)
            if current not in candidates:
                continue
            candidates = [v for v in candidates if v <= current]
            lo, hi = self._smallest_failing(candidates, lambda v: knob.set(config, v), knob.name, str)
            if candidates[hi] != current:
                config = knob.set(config, candidates[hi])
                self.trail.append(config)
            if lo < 0:
                continue
            below = knob.set(config, candidates[lo])
            if self._probed[below].state != GONE:
                self.changes.append(Change(knob.name, str(candidates[lo]), self._why(below)))
                continue
            related = self._relation(config, knob.name, candidates[hi], candidates[lo], necessary)
            if related is not None:
                config = related
                continue
            self._necessary(necessary, Condition(knob.name, candidates[hi], str(candidates[lo])),
                            lambda c, knob=knob, to=candidates[lo]: knob.set(c, to))
        return config

    def _smallest_failing(self, values: list[int], at: Callable[[int], Coords], knob: str,
                          label: Callable[[int], str]) -> tuple[int, int]:
        """Binary search over `values` (ascending; the last fails the start's way): (lo, hi), values[hi] the
        smallest found failing at `at(value)`, values[lo] the one below it that does not (-1: every value fails)."""
        lo, hi = -1, len(values) - 1
        if self.fails(at(values[0]), knob, label(values[0])):
            return -1, 0
        lo = 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fails(at(values[mid]), knob, label(values[mid])):
                hi = mid
            else:
                lo = mid
        return lo, hi

    def _relation(self, config: Coords, name: str, failing: int, passing: int,
                  necessary: list[Condition]) -> Coords | None:
        """Whether the boundary of `name` (fails at `failing`, passes just below) is a relation with another
        length: it moves with that length (tried at another value of it). If so, the relation is recorded as
        the condition, both lengths are shrunk together, and the new configuration returned; else None.

        A necessary condition holds at the start. A boundary where the two lengths meet, crossed from the side
        the start is not on (the start had fewer keys than queries, the boundary says more keys fail), says
        only that they must differ: that is the condition recorded."""
        relation = knobs.RELATION_OF.get(name)
        if relation is None or not relation.applies(config):
            return None
        other = knobs.value(config, relation.other)
        offset = failing - other  # the boundary sits at other + offset
        start = self._start_at
        if knobs.value(start, name) - knobs.value(start, relation.other) < offset:
            if passing != other:
                return None
            self._record_relation(necessary, relation, f"{name} != {relation.other}", failing, other)
            return config

        def pair(y: int, x: int | None = None) -> Coords | None:
            x = y + offset if x is None else x
            if x < 1 or y < 1:
                return None
            try:
                moved = relation.set(config, x, y)
            except BadInput:
                return None
            return moved if self.valid(moved) else None

        shifted = next((y for y in (other // 2, other * 2)
                        if y != other and pair(y) is not None and pair(y, y + offset - 1) is not None), None)
        if shifted is None:
            return None
        label = f"{relation.other} {shifted}"
        if not (self.fails(pair(shifted), name, f"{shifted + offset} with {label}") and
                self.state(pair(shifted, shifted + offset - 1), name, f"{shifted + offset - 1} with {label}") == GONE):
            return None
        # A relation: the smallest `other` at which it still fails, with `name` on its boundary.
        lows = [y for y in range(max(1, 2 - offset), other + 1) if pair(y) is not None]
        _, hi = self._smallest_failing(lows, pair, relation.other, lambda y: f"{y} with {name} on the relation")
        smallest = lows[hi]
        moved = pair(smallest)
        if moved != config:
            self.trail.append(moved)
        text = (f"{name} > {relation.other}" if offset == 1 else f"{name} >= {relation.other}" if offset == 0 else
                f"{name} > {relation.other} {'+' if offset > 1 else '-'} {abs(offset - 1)}")
        self._record_relation(necessary, relation, text, smallest + offset, smallest)
        return moved

    def _record_relation(self, necessary: list[Condition], relation: knobs.Relation, text: str, x: int,
                         y: int) -> None:
        """The relation as the condition on `relation.knob` (fails at x with the other length y, passes one
        below), in place of any condition on the other length ("self-attention passes" is implied)."""
        name, other = relation.knob, relation.other
        necessary[:] = [c for c in necessary if c.knob != other]
        self._undo.pop(other, None)
        self._necessary(necessary, Condition(name, f"{name} {x}, {other} {y}", f"{name} {x - 1}, {other} {y}",
                                             relation=text), lambda c: _off_boundary(c, relation))
        self._tied.add(other)

    # --- confirming the conditions -------------------------------------------------------------------------

    def _confirm(self, config: Coords, necessary: list[Condition]) -> Coords:
        """Rerun the minimal case and, per condition, the minimal case with that one knob simplified (see the
        module docstring); returns the minimal case (plainer where a condition turned out not to be needed)."""
        while necessary:
            if not self.fails(config, "confirm", "the minimal case again", fresh=True):
                self.changes += [Change(c.knob, str(c.passing_value), "not confirmed: the minimal case did not fail "
                                        "the same way when rerun (an intermittent fault? bisect with --repeats)")
                                 for c in necessary]
                necessary.clear()
                return config
            for condition in list(necessary):
                simplified = self._undo[condition.knob](config)
                if simplified is None or not self.valid(simplified):
                    necessary.remove(condition)
                    self.changes.append(Change(condition.knob, str(condition.passing_value),
                                               "not confirmed: it cannot be simplified on the minimal case"))
                    continue
                passing = condition.passing_value
                tried = str(passing) if condition.relation else f"{condition.knob} {passing}"
                state = self.state(simplified, "confirm", tried, fresh=True)
                if state == GONE:
                    necessary[necessary.index(condition)] = _on(condition, config, simplified)
                    continue
                necessary.remove(condition)
                if state == SAME:  # not needed on the minimal case after all: adopt it, and confirm again
                    config = simplified
                    self.trail.append(config)
                    break
                self.changes.append(Change(condition.knob, str(condition.passing_value),
                                           f"not confirmed: rerun on the minimal case, it {self._why(simplified)}"))
            else:
                return config
        return config


def _on(condition: Condition, minimal: Coords, simplified: Coords) -> Condition:
    """The condition with the values it has on the minimal case (lengths found early shrink later); a relation
    names its values itself, and a list of passing values (every plainer dtype) stays as found."""
    if condition.relation:
        return condition
    passing = condition.passing_value
    if ", " not in str(passing):
        passing = str(knobs.value(simplified, condition.knob))
    return dataclasses.replace(condition, failing_value=knobs.value(minimal, condition.knob), passing_value=passing)


def _off_boundary(coords: Coords, relation: knobs.Relation) -> Coords | None:
    """`coords` one step below the relation's boundary: the related length one shorter."""
    try:
        return relation.set(coords, knobs.value(coords, relation.knob) - 1, knobs.value(coords, relation.other))
    except BadInput:
        return None


def valid_config(coords: Coords) -> bool:
    return knobs.valid(coords)
