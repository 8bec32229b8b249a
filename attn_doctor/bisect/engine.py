"""`bisect`: from a failing case to the smallest one that still fails and the conditions it needs.

A minimizer in the style of delta debugging and PyTorch's compiler bisector: categorical knobs are moved
to their plainest value (one at a time, then all that kept the failure together), integer knobs are
binary-searched down to the smallest value that still fails. A knob whose simplification makes the
failure disappear is a necessary condition, recorded with the values on both sides of the boundary.

The engine is pure: it only sees a `probe(config) -> Outcome` callable, so it is tested with fake
predicates and driven by real kernels from the CLI.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from attn_doctor.core.case import DTYPES, Case, tp_unsupported
from attn_doctor.core.errors import BadInput
from attn_doctor.core.layouts import layout_unsupported


@dataclass(frozen=True)
class Config:
    """Everything a probe varies: the case, the layout, and the depth / TP coordinates."""

    case: Case
    layout: str = "contiguous"
    tp: int = 1
    layers: int = 0  # 0: a single attention call; L > 0: an L-layer stack

    def describe(self) -> str:
        text = f"{self.case.short()} layout={self.layout}"
        if self.tp > 1:
            text += f" tp={self.tp}"
        if self.layers:
            text += f" layers={self.layers}"
        return text

    def to_dict(self) -> dict:
        return {"case": self.case.to_dict(), "layout": self.layout, "tp": self.tp, "layers": self.layers}


@dataclass(frozen=True)
class Outcome:
    verdict: str  # PASS / FAIL / SKIP / ERROR
    reason: str = ""
    tensors: tuple[str, ...] = ()  # the failing tensors
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Step:
    knob: str
    tried: str
    config: str
    verdict: str
    fails: bool
    note: str = ""


@dataclass(frozen=True)
class Condition:
    knob: str
    failing_value: object
    passing_value: object

    def sentence(self) -> str:
        return f"fails at {self.knob} {self.failing_value}, passes at {self.passing_value}"


@dataclass
class BisectResult:
    start: Config
    start_outcome: Outcome
    minimal: Config
    minimal_outcome: Outcome
    necessary: list[Condition]
    steps: list[Step]

    def to_dict(self) -> dict:
        return {
            "start_case": self.start.to_dict(),
            "minimal_case": self.minimal.to_dict(),
            "necessary": [dataclasses.asdict(c) for c in self.necessary],
            "probes": [dataclasses.asdict(s) for s in self.steps],
        }


class NothingToBisect(Exception):
    """The starting configuration does not fail."""


Probe = Callable[[Config], Outcome]


def _error_class(reason: str) -> str:
    """What kind of crash: 'hung', 'worker ... died (signal SIGSEGV)' -> 'died (signal SIGSEGV)', 'TypeError'."""
    if reason.startswith("hung"):
        return "hung"
    if "died" in reason:
        return reason[reason.index("died"):].split(":")[0]
    return reason.split(":")[0]


class Bisector:
    def __init__(self, probe: Probe, repeats: int = 1, valid: Callable[[Config], bool] | None = None):
        self.probe = probe
        self.repeats = max(1, repeats)
        self.valid = valid or (lambda config: True)
        self.steps: list[Step] = []
        self._start_error: str | None = None
        self._cache: dict[Config, tuple[bool, Outcome]] = {}

    def fails(self, config: Config, knob: str = "start", tried: str = "") -> bool:
        """The same verdict `run` gives; any of --repeats runs failing counts (a nondeterministic fault
        must not look fixed by luck); a crash counts only if the start crashed the same way."""
        if config in self._cache:
            return self._cache[config][0]  # already probed (and listed among the steps)
        outcome = Outcome("PASS")
        failing = False
        for _ in range(self.repeats):
            outcome = self.probe(config)
            if outcome.verdict == "FAIL" and self._start_error is None:
                failing = True
            elif outcome.verdict == "ERROR":
                failing = self._start_error is not None and _error_class(outcome.reason) == self._start_error
            if failing:
                break
        self._cache[config] = (failing, outcome)
        self.steps.append(Step(knob, tried, config.describe(), outcome.verdict, failing, outcome.reason[:200]))
        return failing

    def outcome(self, config: Config) -> Outcome:
        return self._cache[config][1]

    def run(self, start: Config) -> BisectResult:
        for _ in range(self.repeats):  # the start gets --repeats too: a flaky fault must not look absent
            first = self.probe(start)
            if first.verdict in ("FAIL", "ERROR"):
                break
        if first.verdict == "ERROR":
            self._start_error = _error_class(first.reason)
        failing = first.verdict in ("FAIL", "ERROR")
        self.steps.append(Step("start", "", start.describe(), first.verdict, failing, first.reason[:200]))
        if not failing:
            raise NothingToBisect(f"the starting case does not fail ({first.verdict}): {start.describe()}")
        self._cache[start] = (True, first)
        necessary: list[Condition] = []
        config = self._categorical(start, necessary)
        config = self._integers(config, necessary)
        return BisectResult(start, first, config, self.outcome(config), necessary, self.steps)

    # --- categorical knobs -------------------------------------------------------------------------------

    def _categorical(self, config: Config, necessary: list[Condition]) -> Config:
        moves = [move for move in _categorical_moves(config) if self.valid(move[2])]
        still_fails = [self.fails(candidate, knob, tried) for knob, tried, candidate in moves]
        kept, seen = [], set()
        for move, failing in zip(moves, still_fails):  # of several dtypes that keep failing, adopt the plainest
            if failing and move[0] not in seen:
                kept.append(move)
                seen.add(move[0])
        adopted = set()
        together = config
        for knob, _, candidate in kept:
            together = _apply(together, knob, candidate) if together is not None else None
        if len(kept) > 1 and together is not None and self.valid(together) and self.fails(
                together, "+".join(k for k, _, _ in kept), "together"):
            config, adopted = together, {k for k, _, _ in kept}
        else:
            for knob, _, candidate in kept:  # one at a time, when they do not all combine
                step = _apply(config, knob, candidate)
                if step is not None and self.valid(step) and (len(kept) == 1 or self.fails(step, knob, "+ earlier")):
                    config = step
                    adopted.add(knob)
        # What is left unsimplified is necessary only if simplifying it on top of the adopted changes
        # passes; a move that still fails there is adopted after all.
        passing: dict[str, list] = {}
        for knob, tried, original in moves:
            if knob in adopted:
                continue
            candidate = _apply(config, knob, original)
            if candidate is None or not self.valid(candidate) or candidate == config:
                continue
            if self.fails(candidate, knob, f"{tried} on the minimal case"):
                config = candidate
                adopted.add(knob)
                passing.pop(knob, None)
            else:
                passing.setdefault(knob, []).append(self._passing_value(candidate, knob))
        for knob, values in passing.items():
            if knob not in adopted:
                necessary.append(Condition(knob, _value(config, knob), ", ".join(map(str, values))))
        return config

    def _passing_value(self, candidate: Config, knob: str) -> str:
        outcome = self.outcome(candidate)
        value = _value(candidate, knob)
        return f"{value}" if outcome.verdict == "PASS" else f"{value} ({outcome.verdict.lower()}: {outcome.reason[:80]})"

    # --- integer knobs -----------------------------------------------------------------------------------

    def _integers(self, config: Config, necessary: list[Condition]) -> Config:
        for knob in INTEGER_KNOBS:
            values = _integer_values(config, knob)
            if len(values) < 2:
                continue
            candidates = [v for v in values if self.valid(_with_int(config, knob, v))]
            current = _value(config, knob)
            if current not in candidates:
                continue
            candidates = [v for v in candidates if v <= current]
            lo, hi = -1, candidates.index(current)  # candidates[hi] fails; candidates[lo] passes (if lo >= 0)
            if self.fails(_with_int(config, knob, candidates[0]), knob, str(candidates[0])):
                hi = 0
            else:
                lo = 0
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if self.fails(_with_int(config, knob, candidates[mid]), knob, str(candidates[mid])):
                        hi = mid
                    else:
                        lo = mid
            if lo >= 0:
                # The exact boundary replaces a categorical condition on the same knob (layers, seq_kv).
                necessary[:] = [c for c in necessary if c.knob != knob]
                necessary.append(Condition(knob, candidates[hi], self._passing_value(
                    _with_int(config, knob, candidates[lo]), knob)))
            config = _with_int(config, knob, candidates[hi])
        return config


INTEGER_KNOBS = ("layers", "batch", "seq", "seq_kv", "heads", "head_dim")


def _value(config: Config, knob: str):
    if knob in ("layout", "tp", "layers"):
        return getattr(config, knob)
    return getattr(config.case, knob)


def _apply(config: Config, knob: str, candidate: Config) -> Config | None:
    value = _value(candidate, knob)
    try:
        if knob in ("layout", "tp", "layers"):
            return dataclasses.replace(config, **{knob: value})
        fields = config.case.to_dict()
        fields[knob] = value
        if knob == "kv_heads":
            fields["kv_heads"] = fields["heads"]
        if knob == "seq_kv":
            fields["seq_kv"] = fields["seq"]
        return dataclasses.replace(config, case=Case.from_dict(fields))
    except BadInput:
        return None


def _categorical_moves(config: Config) -> list[tuple[str, str, Config]]:
    """(knob, plainer value, config with only that knob simplified)."""
    case = config.case
    moves: list[tuple[str, str, Config]] = []

    def add(knob: str, tried: str, **case_changes) -> None:
        try:
            moves.append((knob, tried, dataclasses.replace(config, case=Case.from_dict({**case.to_dict(), **case_changes}))))
        except BadInput:
            pass

    if config.layout != "contiguous":
        moves.append(("layout", "contiguous", dataclasses.replace(config, layout="contiguous")))
    if case.mask != "none":
        add("mask", "none", mask="none")
    if case.num_kv_heads != case.heads:
        add("kv_heads", str(case.heads), kv_heads=case.heads)
    if case.window is not None:
        add("window", "none", window=None)
    if case.seq_k != case.seq:
        add("seq_kv", str(case.seq), seq_kv=case.seq)
    if config.tp != 1:
        moves.append(("tp", "1", dataclasses.replace(config, tp=1)))
    if config.layers > 1:
        moves.append(("layers", "1", dataclasses.replace(config, layers=1)))
    for dtype in ("fp32", "fp16", "bf16"):  # plainest first
        if dtype != case.dtype and dtype in DTYPES:
            add("dtype", dtype, dtype=dtype)
    return moves


def _integer_values(config: Config, knob: str) -> list[int]:
    """The values a knob may take, smallest first, respecting what the case allows."""
    case = config.case
    current = _value(config, knob)
    if knob == "layers":
        return list(range(1, current + 1)) if current > 1 else []
    if knob == "seq_kv" and case.seq_k == case.seq:
        return []  # self-attention: seq_kv follows seq
    if knob == "heads":
        group = case.heads // case.num_kv_heads
        unit = group * config.tp  # heads must stay a multiple of the group size and of the TP degree
        return [n for n in range(unit, current + 1, unit) if (n // group) % config.tp == 0]
    if knob == "head_dim":
        step = 8 if current % 8 == 0 else 1  # the fused kernels take head dims in multiples of 8
        return list(range(step, current + 1, step))
    return list(range(1, current + 1))


def _with_int(config: Config, knob: str, value: int) -> Config:
    if knob == "layers":
        return dataclasses.replace(config, layers=value)
    case = config.case
    fields = case.to_dict()
    if knob == "heads":
        group = case.heads // case.num_kv_heads
        fields["heads"], fields["kv_heads"] = value, value // group
    elif knob == "seq":
        self_attention = case.seq_k == case.seq
        fields["seq"] = value
        if self_attention:
            fields["seq_kv"] = value
    else:
        fields[knob] = value
    return dataclasses.replace(config, case=Case.from_dict(fields))


def valid_config(config: Config) -> bool:
    case = config.case
    if layout_unsupported(config.layout, case.seq, case.seq_k, case.heads, case.num_kv_heads):
        return False
    return tp_unsupported(case, config.tp) is None
