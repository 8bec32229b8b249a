"""From measured rows to verdicts and to the one sentence that names the faulty kernel paths."""

from __future__ import annotations

from collections import defaultdict

from attn_doctor.backends import BASELINE
from attn_doctor.results.document import Faulty, Row
from attn_doctor.verdict.rule import ERROR, FAIL, PASS, combine, judge_tensor

BASELINE_LAYOUT = "contiguous"


def baseline_key(row: Row) -> tuple:
    """Rows with equal keys are judged against the same baseline row (same inputs, same probe)."""
    if row.coords.get("probe") == "depth":
        return (row.case.key(), "depth", row.coords["layers"])
    return (row.case.key(), "single call")


def is_baseline(row: Row) -> bool:
    if row.backend != BASELINE or not row.metrics:
        return False
    if row.coords.get("probe") == "depth":
        return row.coords.get("tp", 1) == 1
    return row.layout == BASELINE_LAYOUT and not row.coords


def judge(rows: list[Row]) -> list[Row]:
    """Fill each measured row's per-tensor verdicts against the baseline row of the same inputs."""
    baselines = {baseline_key(row): row for row in rows if is_baseline(row)}
    for row in rows:
        if not row.metrics:
            continue  # SKIP and ERROR rows keep the verdict the worker gave them
        baseline = baselines.get(baseline_key(row))
        if baseline is None:
            row.verdict = ERROR
            row.reason = "no baseline: the local baseline did not run on these inputs"
            continue
        row.tensors = {
            name: judge_tensor(name, metrics, baseline.metrics[name], row.case.dtype)
            for name, metrics in row.metrics.items()
            if name in baseline.metrics
        }
        row.verdict = combine([t.verdict for t in row.tensors.values()])
        if row.verdict == FAIL:
            row.reason = "; ".join(f"{name}: {t.why}" for name, t in row.tensors.items() if t.verdict == FAIL)
    return rows


def find_faulty(rows: list[Row]) -> list[Faulty]:
    """Group FAIL and ERROR rows by backend: which layouts, which tensors, which cases."""
    groups: dict[str, list[Row]] = defaultdict(list)
    for row in rows:
        if row.verdict in (FAIL, ERROR):
            groups[row.backend].append(row)
    faulty = []
    for backend, bad in groups.items():
        tensors = list(dict.fromkeys(name for row in bad for name in row.failing_tensors))
        ratios = [t.ratio for row in bad for t in row.tensors.values() if t.verdict == FAIL]
        nonfinite = [name for name in tensors if any(
            (t := row.tensors.get(name)) is not None and t.verdict == FAIL and (t.nan or t.inf) for row in bad)]
        faulty.append(
            Faulty(
                backend=backend,
                ran=next((row.ran for row in bad if row.ran), ""),
                verdict=FAIL if any(row.verdict == FAIL for row in bad) else ERROR,
                layouts=tuple(dict.fromkeys(_place(row) for row in bad)),
                tensors=tuple(tensors),
                cases=tuple(dict.fromkeys(row.case.short() for row in bad)),
                worst_ratio=max(ratios) if ratios else float("nan"),
                nonfinite=tuple(nonfinite),
            )
        )
    return faulty


def _place(row: Row) -> str:
    """Where a row ran: its layout, plus the rank grid of a distributed probe."""
    if row.coords.get("probe") == "distributed":
        c = row.coords
        cp = f" x CP={c['cp']} {c.get('cp_comm_type') or ''}".rstrip() if c.get("cp", 1) > 1 else ""
        return f"{row.layout} (TP={c.get('tp', 1)}{cp}, {c.get('nproc')} ranks)"
    return row.layout


def _tensor_phrase(tensors: tuple[str, ...]) -> str:
    forward = "out" in tensors
    grads = [t for t in tensors if t != "out"]
    parts = []
    if forward:
        parts.append("a wrong forward (out)")
    if grads:
        parts.append("wrong " + ", ".join(grads))
    return " and ".join(parts)


def summarize(rows: list[Row], faulty: list[Faulty]) -> str:
    tested = [row for row in rows if row.verdict in (PASS, FAIL, ERROR)]
    if not tested:
        return "No backend could run here: every row was skipped."
    if not faulty:
        return f"All {len(tested)} tested paths agree with float64 as closely as a correct implementation in this dtype."
    sentences = []
    for f in faulty:
        ran = f" [{f.ran}]" if f.ran and f.ran != f.backend else ""
        where = ", ".join(f.layouts)
        if f.verdict == FAIL:
            if f.nonfinite:
                how = f" (NaN/Inf in {', '.join(f.nonfinite)})"
            elif f.worst_ratio == f.worst_ratio:
                how = f" (up to {f.worst_ratio:.1f}x the baseline's error)"
            else:
                how = ""
            sentences.append(f"{f.backend}{ran} computes {_tensor_phrase(f.tensors)}{how} on layout {where}")
        else:
            sentences.append(f"{f.backend}{ran} crashed or hung on layout {where}")
    return "Faulty: " + "; ".join(sentences) + "."
