"""What a distributed probe comes back as: rank 0's measurements of the reassembled tensors and of every
rank's shard (each shard judged by the same rule as a whole tensor), and the results row they make."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from attn_doctor.backends import BASELINE
from attn_doctor.core.coords import Coords
from attn_doctor.distributed.grid import CP_SPLIT, RANK_LAYOUT
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.results.row import Row
from attn_doctor.verdict.rule import ERROR, FAIL, SKIP, TensorVerdict, judge_tensor


@dataclass
class RankShard:
    """One rank's own shard of out/dq/dk/dv against the same slice of float64 and of the baselines."""

    rank: int
    tp_rank: int
    cp_rank: int
    ran: str = ""
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    baseline_metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # local baseline, same slice
    vs_single: dict[str, float] = field(default_factory=dict)  # ||shard - single-process slice|| / ||slice||
    verdicts: dict[str, TensorVerdict] = field(default_factory=dict)

    @property
    def failing(self) -> list[str]:
        return [name for name, v in self.verdicts.items() if v.verdict == FAIL]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "tp_rank": self.tp_rank, "cp_rank": self.cp_rank, "ran": self.ran,
            "metrics": {n: m.to_dict() for n, m in self.metrics.items()},
            "baseline_metrics": {n: m.to_dict() for n, m in self.baseline_metrics.items()},
            "vs_single": self.vs_single,
            "verdicts": {n: v.verdict for n, v in self.verdicts.items()},
            "why": {n: v.why for n, v in self.verdicts.items() if v.verdict == FAIL},
            "failing": self.failing,
        }


@dataclass
class DistributedOutcome:
    coords: Coords
    device: str
    status: str  # "ok", "skip" or "error"
    ran: str = ""  # e.g. "SDPA math: composite matmul + softmax + CP all_gather, 2 ranks"
    reason: str = ""  # for skip/error; an error names the rank(s) at fault
    detail: str = ""  # stderr tail of the failing rank, tracebacks
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # reassembled tensors vs float64
    baseline_metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # local baseline (rank 0, 1 process)
    single_metrics: dict[str, TensorMetrics] = field(default_factory=dict)  # same backend, 1 process (rank 0)
    vs_single: dict[str, float] = field(default_factory=dict)  # ||reassembled - single|| / ||single||
    bitwise_single: dict[str, bool] = field(default_factory=dict)  # reassembled == single bit for bit
    ranks: list[RankShard] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    spec = property(lambda self: self.coords.backend)
    case = property(lambda self: self.coords.case)
    nproc = property(lambda self: self.coords.nproc)
    tp = property(lambda self: self.coords.tp)
    cp = property(lambda self: self.coords.cp)
    cp_comm_type = property(lambda self: self.coords.cp_comm_type)

    @property
    def failing_ranks(self) -> list[int]:
        return [shard.rank for shard in self.ranks if shard.failing]


def _metrics(d: dict | None) -> dict[str, TensorMetrics]:
    return {name: TensorMetrics(**m) for name, m in (d or {}).items()}


def outcome_from_result(coords: Coords, device: str, result: dict) -> DistributedOutcome:
    """Rank 0's result JSON as an outcome, each rank's shard judged against the baseline's same slice."""
    outcome = DistributedOutcome(coords, device, status=result.get("status", "error"), ran=result.get("ran", ""),
                                 reason=result.get("reason", ""), detail=result.get("detail", ""),
                                 metrics=_metrics(result.get("metrics")),
                                 baseline_metrics=_metrics(result.get("baseline_metrics")),
                                 single_metrics=_metrics(result.get("single_metrics")),
                                 vs_single=result.get("vs_single", {}), bitwise_single=result.get("bitwise_single", {}),
                                 seconds=result.get("seconds", {}), extra=result.get("extra", {}))
    dtype = coords.case.dtype
    for r in result.get("ranks", []):
        shard = RankShard(r["rank"], r["tp_rank"], r["cp_rank"], r.get("ran", ""), _metrics(r.get("metrics")),
                          _metrics(r.get("baseline_metrics")), r.get("vs_single", {}))
        shard.verdicts = {name: judge_tensor(name, m, shard.baseline_metrics[name], dtype)
                          for name, m in shard.metrics.items() if name in shard.baseline_metrics}
        outcome.ranks.append(shard)
    return outcome


def to_row(outcome: DistributedOutcome) -> Row:
    """The results row, not yet judged: `verdict.judge` judges it against the baseline row with its baseline
    key (for a distributed probe, the plain single-call baseline) and names the ranks whose shards fail."""
    verdict = {"ok": "", "skip": SKIP}.get(outcome.status, ERROR)
    extra = dict(outcome.extra)
    extra.update({
        "rank_layout": RANK_LAYOUT,
        "cp_split": CP_SPLIT if outcome.cp > 1 else None,
        "vs_single": outcome.vs_single,
        "bitwise_single": outcome.bitwise_single,
        "single_metrics": {n: m.to_dict() for n, m in outcome.single_metrics.items()},
        "baseline_metrics": {n: m.to_dict() for n, m in outcome.baseline_metrics.items()},
        "ranks": [shard.to_dict() for shard in outcome.ranks],
        "failing_ranks": outcome.failing_ranks,
    })
    return Row(coords=outcome.coords, verdict=verdict, ran=outcome.ran, reason=outcome.reason, detail=outcome.detail,
               metrics=dict(outcome.metrics), seconds=dict(outcome.seconds), extra=extra)


def baseline_row(outcome: DistributedOutcome) -> Row | None:
    """The local baseline as rank 0 measured it on the full tensors (a plain single-call row)."""
    if not outcome.baseline_metrics:
        return None
    return Row(coords=Coords.call(outcome.case, BASELINE), verdict="", ran="Megatron local (rank 0, one process)",
               metrics=dict(outcome.baseline_metrics))


def judged_rows(outcomes: list[DistributedOutcome]) -> list[Row]:
    """The outcomes' rows, judged, after the baseline rows rank 0 measured (one per case)."""
    from attn_doctor.verdict.judge import judge

    baselines = {row.coords.baseline_key(): row for row in map(baseline_row, outcomes) if row is not None}
    return judge([*baselines.values(), *(to_row(outcome) for outcome in outcomes)])
