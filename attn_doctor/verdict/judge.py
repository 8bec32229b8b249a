"""Measured rows -> per-tensor verdicts, each row against the baseline row of the same inputs, and against the
other paths run on them (the baseline must not be out of line with them: `attn_doctor.verdict.rule`). A
flash-style path's dQ and dK are judged with what its output rounding makes on the case, which the baseline's row
carries (`attn_doctor.numerics.rounded_output`)."""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict

from attn_doctor.backends import BASELINE, flash_style
from attn_doctor.core.coords import ProbeKind
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.numerics.standalone import EPS, MULTIPLE, judge_figures, tensor_kind
from attn_doctor.verdict.rule import (
    ERROR,
    FAIL,
    INCONCLUSIVE,
    PASS,
    TensorVerdict,
    accumulation,
    combine,
    figures_of,
    judge_tensor,
)
from attn_doctor.verdict.layer import is_layer_row, judge_layer_row
from attn_doctor.verdict.view import RowView

# The fewest other paths (of families other than the judged one's) whose median error is a second opinion.
PEERS = 2


def judge(rows: list[RowView]) -> list[RowView]:
    """Fill each measured row's per-tensor verdicts against the baseline row with its baseline key (see
    `Coords.baseline_key`); a measured row without one is an ERROR (never judged against nothing)."""
    baselines = {row.coords.baseline_key(): row for row in rows if row.metrics and row.coords.is_baseline(BASELINE)}
    groups: dict[tuple, list[RowView]] = defaultdict(list)
    judged = []
    for row in rows:
        if not row.metrics:
            continue  # SKIP and ERROR rows keep the verdict the probe gave them
        if is_layer_row(row):  # a layer path carries its own yardsticks (`attn_doctor.verdict.layer`)
            judge_layer_row(row)
            continue
        base = baselines.get(row.coords.baseline_key())
        if base is None:
            row.verdict = ERROR
            row.reason = "no baseline: the local baseline did not run on these inputs"
            continue
        row.tensors = {
            name: judge_tensor(name, metrics, base.metrics[name], row.case.dtype, accumulation(row.case, name),
                               own_rounding(row, base, name))
            for name, metrics in row.metrics.items()
            if name in base.metrics
        }
        judged.append(row)
        if row.coords.kind is not ProbeKind.DEPTH:  # a stack's yardstick is the baseline stack, by design
            groups[row.coords.baseline_key()].append(row)
    for key, group in groups.items():
        against_peers(group, baselines[key])
    for row in judged:
        row.verdict = combine([t.verdict for t in row.tensors.values()])
        if row.verdict == FAIL:
            row.reason = "; ".join(f"{name}: {t.why}" for name, t in row.tensors.items() if t.verdict == FAIL)
        elif row.verdict == INCONCLUSIVE:
            row.reason = undecided_reason(row.tensors)
        if row.coords.kind is ProbeKind.DISTRIBUTED:
            apply_rank_verdicts(row)
    return rows


def own_rounding(row: RowView, base: RowView, name: str) -> TensorMetrics | None:
    """What a flash-style path's own output rounding makes in tensor `name` on the row's inputs (the baseline's
    row measured it), or None where it is no part of the yardstick (another path, another tensor)."""
    if name not in base.flash_style or not flash_style(row.coords.backend):
        return None
    return base.flash_style[name]


def undecided_reason(tensors: dict[str, TensorVerdict]) -> str:
    """Why a row could not be judged: the first undecided tensor's reason, naming the others (each tensor's
    own reason, with its own figures, stays on the tensor)."""
    names = [name for name, t in tensors.items() if t.verdict == INCONCLUSIVE]
    also = f" (likewise {', '.join(names[1:])}: see each tensor)" if len(names) > 1 else ""
    return f"{names[0]}: {tensors[names[0]].why}{also}"


def against_peers(group: list[RowView], base: RowView) -> None:
    """A tensor that FAILs against the baseline but passes against the median error of the other paths on the
    same inputs (other families only, one figure per path, at least PEERS of them) is INCONCLUSIVE: the baseline
    is out of line with those paths (see `attn_doctor.verdict.rule`)."""
    for row in group:
        if row is base:
            continue
        peers: dict[str, list[RowView]] = defaultdict(list)
        for other in group:
            if other is not base and other.backend != row.backend and other.family != row.family:
                peers[other.backend].append(other)
        for name, verdict in list(row.tensors.items()):
            if verdict.verdict != FAIL:
                continue
            by_path = {path: _median([figures_of(r.metrics[name])["scaled"] for r in found if name in r.metrics])
                       for path, found in peers.items()}
            by_path = {path: e for path, e in by_path.items() if not math.isnan(e)}
            if len(by_path) < PEERS:
                continue
            worst = _median([_median([figures_of(r.metrics[name])["worst"] for r in peers[path] if name in r.metrics])
                             for path in by_path])
            second = {**figures_of(base.metrics[name]), "scaled": _median(list(by_path.values())), "worst": worst}
            kind = tensor_kind(name)
            flash = own_rounding(row, base, name)
            other = judge_figures(figures_of(row.metrics[name]), second, row.case.dtype, MULTIPLE[kind],
                                  flash=figures_of(flash) if flash is not None else None)
            if not other["failed"]:
                row.tensors[name] = dataclasses.replace(verdict, verdict=INCONCLUSIVE, why=_peers_why(
                    verdict, other, second, sorted(by_path), row.case.dtype))


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def _peers_why(verdict: TensorVerdict, other: dict, second: dict, paths: list[str], dtype: str) -> str:
    eps = EPS[dtype]
    ratio = max(other["ratio"], other["head_ratio"])
    return (f"cannot tell: it fails against the local baseline ({verdict.ratio:.2g}x its yardstick, "
            f"{verdict.yardstick / eps:.2g} eps) but passes against the median error of the {len(paths)} other paths "
            f"on these inputs ({', '.join(paths)}: {second['scaled'] / eps:.2g} eps; {ratio:.2g}x): the baseline is "
            "out of line with them; check: the same paths on other seeds (--seed 1,2,3): a fault stays out of line "
            "with every correct path")


def apply_rank_verdicts(row: RowView) -> RowView:
    """A distributed row whose shards fail on some ranks FAILs (even when the whole tensor's error stays
    under the threshold), and its reason names those ranks and tensors. The shards were judged with the
    same rule where the ranks' results were read (`attn_doctor.distributed.outcome`)."""
    if row.verdict not in (PASS, FAIL):
        return row
    ranks = row.extra.get("ranks", [])
    bad = [r for r in ranks if r.get("failing")]
    if not bad:
        return row
    where = "; ".join(f"rank {r['rank']} (tp_rank {r['tp_rank']}, cp_rank {r['cp_rank']}): "
                      + ", ".join(f"{n} {r['why'].get(n, '')}".strip() for n in r["failing"]) for r in bad)
    ok = [r["rank"] for r in ranks if not r.get("failing")]
    passing = f"; shards of rank{'s' if len(ok) > 1 else ''} {', '.join(map(str, ok))} pass" if ok else ""
    if row.verdict == PASS:
        row.verdict = FAIL
        row.reason = f"the whole tensors pass, but shards fail on {where}{passing}"
    else:
        row.reason = f"{row.reason}; shards fail on {where}{passing}"
    return row
