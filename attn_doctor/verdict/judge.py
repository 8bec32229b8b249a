"""Measured rows -> per-tensor verdicts, each row against the baseline row of the same inputs."""

from __future__ import annotations

from attn_doctor.backends import BASELINE
from attn_doctor.core.coords import ProbeKind
from attn_doctor.verdict.rule import ERROR, FAIL, PASS, combine, judge_tensor
from attn_doctor.verdict.view import RowView


def judge(rows: list[RowView]) -> list[RowView]:
    """Fill each measured row's per-tensor verdicts against the baseline row with its baseline key (see
    `Coords.baseline_key`); a measured row without one is an ERROR (never judged against nothing)."""
    baselines = {row.coords.baseline_key(): row for row in rows if row.metrics and row.coords.is_baseline(BASELINE)}
    for row in rows:
        if not row.metrics:
            continue  # SKIP and ERROR rows keep the verdict the probe gave them
        base = baselines.get(row.coords.baseline_key())
        if base is None:
            row.verdict = ERROR
            row.reason = "no baseline: the local baseline did not run on these inputs"
            continue
        row.tensors = {
            name: judge_tensor(name, metrics, base.metrics[name], row.case.dtype)
            for name, metrics in row.metrics.items()
            if name in base.metrics
        }
        row.verdict = combine([t.verdict for t in row.tensors.values()])
        if row.verdict == FAIL:
            row.reason = "; ".join(f"{name}: {t.why}" for name, t in row.tensors.items() if t.verdict == FAIL)
        if row.coords.kind is ProbeKind.DISTRIBUTED:
            apply_rank_verdicts(row)
    return rows


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
