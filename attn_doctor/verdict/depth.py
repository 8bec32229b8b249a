"""What the depth question needs from the rows of depth probes: dQ error at the first and last layer per
backend, TP degree and depth; how it grows with depth against the baseline's growth; the first failing
depth; and the sentence that says so."""

from __future__ import annotations

import math
from dataclasses import dataclass

from attn_doctor.core.coords import ProbeKind
from attn_doctor.verdict.view import RowView


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


def depth_lines(rows: list[RowView]) -> list[DepthLine]:
    """The depth rows' numbers, by backend, TP degree and depth."""
    lines = []
    for row in rows:
        if row.coords.kind is not ProbeKind.DEPTH or "dq_first" not in row.tensors:
            continue
        first, last = row.tensors["dq_first"], row.tensors.get("dq_last")
        lines.append(DepthLine(
            backend=row.backend, layers=row.coords.layers, tp=row.coords.tp,
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
