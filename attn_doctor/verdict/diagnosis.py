"""From judged rows to what a run concludes: the faulty paths, the one sentence that names them, whether
anything the user asked for was tested at all, and per-backend counts. Everything here is derived from
the rows (and the backends the user asked for); `RunReport` exposes it, nothing stores it."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from attn_doctor.backends import BASELINE, is_layer_path
from attn_doctor.verdict.depth import depth_findings, depth_lines, depth_sentence
from attn_doctor.verdict.rule import (
    BORDERLINE,
    ERROR,
    FAIL,
    INCONCLUSIVE,
    NOISE_YARDSTICK,
    NOT_RUN,
    PASS,
    SKIP,
    TOO_BIG,
    flash_style_note,
)
from attn_doctor.verdict.view import RowView


@dataclass(frozen=True)
class Faulty:
    """One kernel path that computes something wrong (or crashes), with where and what."""

    backend: str
    ran: str
    verdict: str  # FAIL or ERROR
    layouts: tuple[str, ...]
    tensors: tuple[str, ...]
    cases: tuple[str, ...]
    worst_ratio: float
    nonfinite: tuple[str, ...] = ()  # failing tensors that hold NaN or Inf
    borderline: bool = False  # every failing tensor fails within BORDERLINE of its threshold
    systematic: tuple[str, ...] = ()  # failing tensors that fail only by a systematic error (bias)
    against_noise: bool = False  # the worst ratio is to rounding noise, not to the baseline's error
    layer: bool = False  # a whole layer around the attention (`Backend.layer_path`): its yardsticks are its own

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "ran": self.ran,
            "verdict": self.verdict,
            "layouts": list(self.layouts),
            "tensors": list(self.tensors),
            "cases": list(self.cases),
            "worst_ratio": self.worst_ratio,
            "nonfinite": list(self.nonfinite),
            "borderline": self.borderline,
            "systematic": list(self.systematic),
        }


def find_faulty(rows: list[RowView]) -> list[Faulty]:
    """Group FAIL and ERROR rows by backend: which layouts, which tensors, which cases. An ERROR that is
    attn-doctor's own (`RowView.internal`) names no kernel path."""
    groups: dict[str, list[RowView]] = defaultdict(list)
    for row in rows:
        if row.verdict == FAIL or (row.verdict == ERROR and not row.internal):
            groups[row.backend].append(row)
    faulty = []
    for backend, bad in groups.items():
        tensors = list(dict.fromkeys(name for row in bad for name in row.failing_tensors))
        ratios = [t.ratio for row in bad for t in row.tensors.values() if t.verdict == FAIL and not math.isnan(t.ratio)]
        nonfinite = [name for name in tensors if any(
            (t := row.tensors.get(name)) is not None and t.verdict == FAIL and (t.nan or t.inf) for row in bad)]
        failed = [t for row in bad for t in row.tensors.values() if t.verdict == FAIL]
        systematic = [name for name in tensors if all(
            t.bias_failed for row in bad if (t := row.tensors.get(name)) is not None and t.verdict == FAIL)]
        faulty.append(
            Faulty(
                backend=backend,
                ran=next((row.ran for row in bad if row.ran), ""),
                verdict=FAIL if any(row.verdict == FAIL for row in bad) else ERROR,
                layouts=tuple(dict.fromkeys(row.coords.place() for row in bad)),
                tensors=tuple(tensors),
                cases=tuple(dict.fromkeys(row.case.short() for row in bad)),
                worst_ratio=max(ratios) if ratios else math.nan,
                nonfinite=tuple(nonfinite),
                borderline=bool(failed) and all(t.borderline for t in failed) and not any(
                    row.verdict == ERROR for row in bad),
                systematic=tuple(systematic),
                against_noise=bool(failed) and max(failed, key=lambda t: t.ratio).yardstick_kind == NOISE_YARDSTICK,
                layer=is_layer_path(bad[0].coords.backend),
            )
        )
    return faulty


def _tensor_phrase(tensors: tuple[str, ...]) -> str:
    forward = "out" in tensors
    grads = [t for t in tensors if t != "out"]
    parts = []
    if forward:
        parts.append("a wrong forward (out)")
    if grads:
        parts.append("wrong " + ", ".join(grads))
    return " and ".join(parts) or "wrong results"  # a row whose tensors were not recorded (an old bisect's)


def first_wrong(failing: list[str] | tuple[str, ...]) -> str:
    """Where a fault first shows, from the failing tensors of one call: the forward when out is wrong (the
    gradients are computed from it), else the backward."""
    if "out" in failing:
        return "forward (out is already wrong)"
    return f"backward (out is right; {', '.join(failing)} wrong)"


def requested_rows(rows: list[RowView], requested: list[str] | None) -> list[RowView]:
    """The rows of the backends the user asked for (all rows when that is not recorded)."""
    if requested is None:
        return rows
    wanted = set(requested)
    return [row for row in rows if row.backend in wanted]


def untested(rows: list[RowView], requested: list[str] | None) -> str | None:
    """Why nothing the user asked for was tested (every requested probe skipped, or too big for the memory budget),
    or None when something was. One line: the reasons, most common first."""
    asked = requested_rows(rows, requested)
    if any(row.verdict not in NOT_RUN for row in asked):
        return None
    if not asked:
        return "nothing was tested: no probe of the requested backends was planned"
    reasons: dict[str, list[str]] = {}
    for row in asked:
        reasons.setdefault(row.reason or "skipped", [])
        if row.backend not in reasons[row.reason or "skipped"]:
            reasons[row.reason or "skipped"].append(row.backend)
    ordered = sorted(reasons.items(), key=lambda item: -len(item[1]))
    first, backends = ordered[0]
    more = f" (and {len(ordered) - 1} other reason{'s' if len(ordered) > 2 else ''}; see the table)" if len(ordered) > 1 else ""
    did = "skipped" if all(row.verdict == SKIP for row in asked) else "skipped or too big for the memory budget"
    return f"nothing was tested: every requested path was {did} here; {', '.join(backends)}: {first}{more}"


def summarize(rows: list[RowView], requested: list[str] | None = None) -> str:
    """The run's conclusion in one paragraph: the faulty paths (or that all agree), attn-doctor's own
    errors, and for depth probes how the error grows with depth."""
    tested = [row for row in rows if row.verdict in (PASS, FAIL, ERROR, INCONCLUSIVE)]
    faulty = find_faulty(rows)
    undecided = undecided_text(rows)
    if untested(rows, requested) is not None:
        how = "skipped or did not fit in the memory budget" if any(r.verdict == TOO_BIG for r in rows) else "skipped"
        text = f"No requested path could run here: every one was {how}." if tested else \
            f"No backend could run here: every row was {how}."
    elif not faulty and undecided:
        text = undecided
    elif not faulty:
        text = f"All {len(tested)} tested paths agree with float64 as closely as a correct implementation in this dtype."
        close = borderline_passes(rows)
        if close:
            layers = any(is_layer_path(row.coords.backend) for row in _borderline_rows(rows))
            text += (f" Borderline: {', '.join(close)} pass{'es' if len(close) == 1 else ''} within "
                     f"{BORDERLINE:g}x of the threshold; {confirm_advice(layers)}.")
    else:
        sentences = []
        for f in faulty:
            ran = f" [{f.ran}]" if f.ran and f.ran != f.backend else ""
            where = ", ".join(f.layouts)
            if f.verdict == FAIL:
                if f.nonfinite:
                    how = f" (NaN/Inf in {', '.join(f.nonfinite)})"
                elif f.systematic and set(f.systematic) == set(f.tensors):
                    how = " (a systematic error below the noise threshold)"
                elif not math.isnan(f.worst_ratio):
                    yardstick = ("rounding noise" if f.against_noise else "its yardsticks" if f.layer
                                 else "the baseline's error")
                    how = f" (up to {f.worst_ratio:.1f}x {yardstick})"
                else:
                    how = ""
                label = "borderline: " if f.borderline else ""
                sentences.append(f"{label}{f.backend}{ran} computes {_tensor_phrase(f.tensors)}{how} on layout {where}")
            else:
                sentences.append(f"{f.backend}{ran} crashed or hung on layout {where}")
        text = "Faulty: " + "; ".join(sentences) + "."
        if any(f.borderline for f in faulty):
            layers = any(f.layer for f in faulty if f.borderline)
            text += (f" A borderline failure is within {BORDERLINE:g}x of the threshold: {confirm_advice(layers)} "
                     "before calling it a fault.")
        if undecided:
            text += f" {undecided}"
    too_big = [row for row in rows if row.verdict == TOO_BIG]
    if too_big and untested(rows, requested) is None:
        names = ", ".join(dict.fromkeys(row.backend for row in too_big))
        text += (f" Not judged: {len(too_big)} probe{'s' if len(too_big) > 1 else ''} of {names} "
                 f"{too_big[0].reason}{' (and more; see the rows)' if len(too_big) > 1 else ''}.")
    internal = [row for row in rows if row.verdict == ERROR and row.internal]
    if internal:
        names = ", ".join(dict.fromkeys(row.backend for row in internal))
        text += (f" attn-doctor itself failed while probing {names} ({len(internal)} probe"
                 f"{'s' if len(internal) > 1 else ''}): a bug in attn-doctor, not in the kernel; see the ERROR rows.")
    depth = depth_sentence(depth_findings(depth_lines(rows)))
    return f"{text} {depth}" if depth else text


CONFIRM = "confirm with --repeats 5, another --seed, or --dtype fp32"
# A layer path takes neither --repeats nor fp32 (TE's GEMMs may use TF32): another seed is what confirms it.
CONFIRM_LAYER = "confirm with another --seed (a layer path takes neither --repeats nor --dtype fp32)"


def confirm_advice(layers: bool) -> str:
    """How to confirm a borderline verdict: the checks the paths concerned can take (`layers`: a layer path is
    among them)."""
    return CONFIRM_LAYER if layers else CONFIRM


def undecided_text(rows: list[RowView]) -> str:
    """One sentence on the paths that could not be judged (INCONCLUSIVE), with why ("" when none): the
    reasons are in the rows; the sentence names the paths and the first reason's kind."""
    undecided = [row for row in rows if row.verdict == INCONCLUSIVE]
    if not undecided:
        return ""
    paths = ", ".join(dict.fromkeys(row.backend for row in undecided))
    why = next(t.why for row in undecided for t in row.tensors.values() if t.verdict == INCONCLUSIVE)
    because = why.removeprefix("cannot tell: ").split(";")[0]
    more = " (and more; see the rows)" if len(undecided) > 1 else ""
    return (f"Cannot tell for {paths}: {because}{more}. A path that could not be judged is not a pass; "
            "each row says which check would decide.")


def borderline_passes(rows: list[RowView]) -> list[str]:
    """'backend tensor' for each tensor that passes within BORDERLINE of its threshold."""
    close = [f"{row.backend} {name}" for row in _borderline_rows(rows) for name, t in row.tensors.items()
             if t.verdict == PASS and t.borderline]
    return list(dict.fromkeys(close))


def _borderline_rows(rows: list[RowView]) -> list[RowView]:
    """The rows (the baseline's left out) with a tensor that passes within BORDERLINE of its threshold."""
    return [row for row in rows if not row.coords.is_baseline(BASELINE)
            and any(t.verdict == PASS and t.borderline for t in row.tensors.values())]


def flash_style_notes(rows: list[RowView]) -> list[str]:
    """Per flash-style path whose dQ or dK passed on a yardstick that rests on a flash-style backward's own output
    rounding (`attn_doctor.verdict.rule`): the closest of its passing tensors' notes, where, and on how many other
    rows it did so, so a user sees why a kernel several times the baseline's error is right."""
    found: dict[str, list[tuple[float, str, str]]] = defaultdict(list)
    several_cases = len({row.case.key() for row in rows}) > 1
    for row in rows:
        for name, t in row.tensors.items():
            note = flash_style_note(name, t)
            if note:
                where = f"{row.layout}, {row.case.short()}" if several_cases else row.layout
                found[row.backend].append((t.ratio, where, note))
    notes = []
    for backend, passes in found.items():
        _, where, note = max(passes)
        others = len(passes) - 1
        notes.append(f"{backend} ({where}) {note}" + (f" (and {others} more like it)" if others else ""))
    return notes


def exit_code(rows: list[RowView], requested: list[str] | None = None) -> int:
    """0 every tested path passes; 1 a path FAILs or ERRORs, or could not be judged (INCONCLUSIVE); 2 nothing
    the user asked for was tested (a request that cannot run here: never 0)."""
    if any(row.verdict in (FAIL, ERROR, INCONCLUSIVE) for row in rows):
        return 1
    return 2 if untested(rows, requested) is not None else 0


@dataclass
class BackendTally:
    backend: str
    passed: int
    failed: int
    errors: int
    skipped: int
    failing_cases: list[str] = field(default_factory=list)
    inconclusive: int = 0
    too_big: int = 0  # probes that did not fit in the memory budget


def tally(rows: list[RowView]) -> list[BackendTally]:
    """Per backend: how many rows pass, and the failing ones with their knobs (pandas does the grouping)."""
    import pandas as pd

    if not rows:
        return []
    frame = pd.DataFrame([
        {"backend": r.backend, "verdict": r.verdict,
         "knobs": f"{r.case.short()} {r.layout}{r.coords.text()}"}
        for r in rows
    ])
    counts = frame.pivot_table(index="backend", columns="verdict", aggfunc="size", fill_value=0)
    out = []
    for backend in dict.fromkeys(frame["backend"]):
        row = counts.loc[backend]
        failing = frame[(frame.backend == backend) & frame.verdict.isin(["FAIL", "ERROR"])]["knobs"].tolist()
        out.append(BackendTally(backend, int(row.get("PASS", 0)), int(row.get("FAIL", 0)), int(row.get("ERROR", 0)),
                                int(row.get("SKIP", 0)), failing, int(row.get(INCONCLUSIVE, 0)),
                                int(row.get(TOO_BIG, 0))))
    return out
