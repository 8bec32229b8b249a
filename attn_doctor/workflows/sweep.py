"""`sweep`: grids of cases, depth stacks and TP shards, streamed to results.jsonl and resumable.

A sweep is a list of points; each point is one case with one kind of probe (layouts, TP degrees or depth
stacks) and becomes the jobs `runner` executes. Each finished point's rows are appended to
`results.jsonl` (one line per row, with the point's id) and flushed, so an interrupted sweep loses at most
the point in flight, and `--resume DIR` skips the points already there.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn_doctor.backends import BASELINE, BackendSpec
from attn_doctor.core.case import Case, make_case
from attn_doctor.core.errors import BadInput
from attn_doctor.results.document import Row, write_atomic_bytes
from attn_doctor.execution.session import Job, plan_depth_jobs, plan_jobs, plan_tp_jobs

RESULTS_FILE = "results.jsonl"
PLOT_FILE = "depth.png"
GRID_FIELDS = ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "dtype", "mask", "window", "seed")


def expand_grid(base: dict[str, Any], grid: dict[str, list[Any]]) -> list[Case]:
    """The cross product of every gridded case field over the base fields, each validated."""
    unknown = sorted(set(grid) - set(GRID_FIELDS))
    if unknown:
        raise BadInput(f"cannot sweep over {', '.join(unknown)}; case fields are {', '.join(GRID_FIELDS)}")
    names = [n for n in GRID_FIELDS if n in grid]
    cases, seen = [], set()
    for values in itertools.product(*(grid[n] for n in names)):
        case = make_case(**{**base, **dict(zip(names, values))})
        if case.key() not in seen:
            seen.add(case.key())
            cases.append(case)
    return cases


@dataclass(frozen=True)
class Point:
    case: Case
    kind: str  # "layout", "tp" or "depth"
    layouts: tuple[str, ...] = ()
    depths: tuple[int, ...] = ()
    degrees: tuple[int, ...] = (1,)

    @property
    def id(self) -> str:
        spec = {"case": self.case.to_dict(), "kind": self.kind, "layouts": list(self.layouts),
                "depths": list(self.depths), "tp": list(self.degrees)}
        return json.dumps(spec, sort_keys=True)

    def jobs(self, specs: list[BackendSpec]) -> list[Job]:
        if self.kind == "depth":
            return plan_depth_jobs(self.case, specs, list(self.depths), list(self.degrees))
        if self.kind == "tp":
            return plan_tp_jobs(self.case, specs, list(self.degrees))
        return plan_jobs([self.case], specs, list(self.layouts))


def plan_points(cases: list[Case], layouts: list[str], depths: list[int] | None, degrees: list[int] | None) -> list[Point]:
    if depths:
        return [Point(c, "depth", depths=tuple(depths), degrees=tuple(degrees or [1])) for c in cases]
    if degrees:
        return [Point(c, "tp", degrees=tuple(degrees)) for c in cases]
    return [Point(c, "layout", layouts=tuple(layouts)) for c in cases]


def check_resumable(directory: Path, done_rows: list[Row], points: list[Point], specs: list[BackendSpec]) -> None:
    """Refuse to resume a sweep with other backends: its finished points would be skipped without the new
    backends ever running on them, and the report would mix two backend sets."""
    if not done_rows or not points:
        return
    ran = sorted({row.backend for row in done_rows})
    asked = sorted({job.spec.name for job in points[0].jobs(specs)})
    if ran != asked:
        raise BadInput(f"--resume {directory}: that sweep ran {', '.join(ran)}, this command asks for "
                       f"{', '.join(asked)}; resume with the same --backend/--kernel options, or start a new "
                       "sweep with --out")


@dataclass
class Record:
    """One line of results.jsonl: a row of a point, the last of the point's lines marked complete."""

    line: bytes  # as written, without its newline
    point: str
    complete: bool
    row: Row


def read_records(path: Path, hint: str, skip_blank: bool = False) -> tuple[list[Record], bool]:
    """Every whole line of a results.jsonl, and whether the last line was torn (cut off mid-write: the sweep
    was killed while writing it). A line that is not a sweep record is bad input naming the file, the line
    and `hint` (what to do about it)."""
    lines = path.read_bytes().split(b"\n")
    torn = lines.pop() != b""  # b"" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, start=1):
        if skip_blank and not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
            records.append(Record(line, record["point"], bool(record.get("point_complete")), Row.from_dict(record)))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError,
                BadInput) as exc:
            raise BadInput(f"{path}:{number} is not an attn-doctor sweep record ({type(exc).__name__}); {hint}") from None
    return records, torn


class ResultsLog:
    """results.jsonl: rows appended point by point, each line flushed to disk before the next point runs."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / RESULTS_FILE

    def load(self) -> tuple[list[Row], set[str]]:
        """Rows and finished point ids already there. Lines of a point that never finished (the sweep was
        killed while writing it, possibly mid-line) are dropped from the file, so its rerun is the only copy."""
        if not self.path.exists():
            return [], set()
        records, torn = read_records(self.path, "move the file away to start over")
        by_point: dict[str, list[Record]] = {}
        for record in records:
            by_point.setdefault(record.point, []).append(record)
        complete = [record.point for record in records if record.complete]
        if set(by_point) - set(complete) or torn:
            kept = b"".join(record.line + b"\n" for point in complete for record in by_point[point])
            write_atomic_bytes(self.path, kept)
        rows = [record.row for point in complete for record in by_point[point]]
        return rows, set(complete)

    def append(self, point: Point, rows: list[Row]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        lines = []
        for index, row in enumerate(rows):
            record = {"point": point.id, **row.to_dict()}
            if index == len(rows) - 1:
                record["point_complete"] = True
            lines.append(json.dumps(record, allow_nan=True))
        with open(self.path, "a") as handle:
            handle.write("\n".join(lines) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


@dataclass
class DepthLine:
    """One backend at one depth (and TP degree): the numbers the depth question needs."""

    backend: str
    layers: int
    tp: int
    dq_first: float
    dq_last: float
    baseline_dq_first: float
    ratio: float
    verdict: str
    vs_baseline: float  # ||dQ - dQ_local|| / ||dQ_local|| at layer 1: what the bug reports measured
    vs_tp1: float | None


def depth_lines(rows: list[Row]) -> list[DepthLine]:
    """The depth rows' numbers, by backend, TP degree and depth."""
    lines = []
    for row in rows:
        if row.coords.get("probe") != "depth" or "dq_first" not in row.tensors:
            continue
        first, last = row.tensors["dq_first"], row.tensors.get("dq_last")
        lines.append(DepthLine(
            backend=row.backend, layers=row.coords["layers"], tp=row.coords.get("tp", 1),
            dq_first=first.rel_err, dq_last=last.rel_err if last else math.nan,
            baseline_dq_first=first.baseline_rel_err, ratio=first.ratio, verdict=row.verdict,
            vs_baseline=row.extra.get("dq_first_vs_baseline", math.nan), vs_tp1=row.extra.get("dq_first_vs_tp1"),
        ))
    return sorted(lines, key=lambda line: (line.backend, line.tp, line.layers))


@dataclass
class DepthFinding:
    backend: str
    tp: int
    depths: list[int]
    growth: float  # dQ error at the deepest / at the shallowest depth
    baseline_growth: float
    first_failing_depth: int | None


def depth_findings(lines: list[DepthLine]) -> list[DepthFinding]:
    findings = []
    keyed: dict[tuple[str, int], list[DepthLine]] = {}
    for line in lines:
        keyed.setdefault((line.backend, line.tp), []).append(line)
    for (backend, tp), group in keyed.items():
        group.sort(key=lambda line: line.layers)
        shallow, deep = group[0], group[-1]
        failing = [line.layers for line in group if line.verdict == "FAIL"]
        findings.append(DepthFinding(
            backend=backend, tp=tp, depths=[line.layers for line in group],
            growth=deep.dq_first / shallow.dq_first if shallow.dq_first else math.inf,
            baseline_growth=(deep.baseline_dq_first / shallow.baseline_dq_first
                             if shallow.baseline_dq_first else math.inf),
            first_failing_depth=failing[0] if failing else None,
        ))
    return findings


def depth_sentence(findings: list[DepthFinding]) -> str:
    if not findings:
        return ""
    bad = [f for f in findings if f.first_failing_depth is not None]
    if not bad:
        return ("dQ error grows with depth like the local baseline's for every backend: "
                "the growth is bf16 rounding amplified by the stack, not a kernel fault.")
    parts = [f"{f.backend}{f' (TP={f.tp})' if f.tp > 1 else ''} first fails at {f.first_failing_depth} layers "
             f"(its dQ error grows {f.growth:.1f}x over depths {f.depths[0]}..{f.depths[-1]}, "
             f"the baseline's {f.baseline_growth:.1f}x)" for f in bad]
    return "Depth: " + "; ".join(parts) + "."


@dataclass
class BackendTally:
    backend: str
    passed: int
    failed: int
    errors: int
    skipped: int
    failing_cases: list[str] = field(default_factory=list)


def tally(rows: list[Row]) -> list[BackendTally]:
    """Per backend: how many rows pass, and the failing ones with their knobs (pandas does the grouping)."""
    import pandas as pd

    if not rows:
        return []
    frame = pd.DataFrame([
        {"backend": r.backend, "verdict": r.verdict,
         "knobs": f"{r.case.short()} {r.layout}{r.coords_text()}"}
        for r in rows
    ])
    counts = frame.pivot_table(index="backend", columns="verdict", aggfunc="size", fill_value=0)
    out = []
    for backend in dict.fromkeys(frame["backend"]):
        row = counts.loc[backend]
        failing = frame[(frame.backend == backend) & frame.verdict.isin(["FAIL", "ERROR"])]["knobs"].tolist()
        out.append(BackendTally(backend, int(row.get("PASS", 0)), int(row.get("FAIL", 0)), int(row.get("ERROR", 0)),
                                int(row.get("SKIP", 0)), failing))
    return out


def plot_depth(lines: list[DepthLine], path: Path) -> Path | None:
    """dQ error (first layer) against depth, one line per backend, the local baseline dashed."""
    if not lines or len({line.layers for line in lines}) < 1:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    series: dict[str, list[DepthLine]] = {}
    for line in lines:
        label = line.backend + (f" TP={line.tp}" if line.tp > 1 else "")
        series.setdefault(label, []).append(line)
    for label, group in sorted(series.items()):
        group.sort(key=lambda line: line.layers)
        style = {"linestyle": "--", "color": "black", "linewidth": 2} if label == BASELINE else {"marker": "o"}
        ax.plot([g.layers for g in group], [g.dq_first for g in group], label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel("dQ relative error vs float64 (layer 1)")
    ax.set_title("dQ error against depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
