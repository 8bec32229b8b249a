"""Known TE/cuDNN defects beside a command's output: wiring the known-defect table to a report or a machine.

The matching itself is `attn_doctor.machine.known_bugs` (dataclasses in, dataclasses out); here a results
row becomes the `Probe` the rules read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from attn_doctor.machine.fingerprint import EnvReport
    from attn_doctor.machine.known_bugs import Probe
    from attn_doctor.results.report import RunReport
    from attn_doctor.results.row import Row


def _replayed_dout_unlike_out(row: Row) -> bool:
    """A replayed call's row in its captured layout, whose backward got dO strided unlike out as in the run
    (`attn_doctor.tracing.replay_source.dout_unlike_out`); False for every other row, and when the capture is not
    here to read (a report read on another machine)."""
    from attn_doctor.core.layouts import CAPTURED

    if row.layout != CAPTURED or row.case.replay is None:
        return False
    from attn_doctor.core.errors import BadInput
    from attn_doctor.tracing.replay_source import dout_unlike_out

    try:
        return dout_unlike_out(row.case)
    except (BadInput, OSError, KeyError, ValueError):
        return False


def row_probe(row: Row, env: EnvReport) -> Probe:
    """A results row as the rules read it: the case, the context its path ran in (the qkv format the rules
    are written for, what the path sets itself — TE's deterministic path is deterministic whatever the
    environment says —, the sub-backend TE reported, CP), and what it showed."""
    from attn_doctor.backends import match_context, match_format
    from attn_doctor.machine.known_bugs import MatchContext, Probe, sub_backend_from_ran

    spec, coords = row.coords.backend, row.coords
    context = MatchContext.for_case(
        env, row.case,
        qkv_format=match_format(spec, row.case),
        backend=row.backend,
        sub_backend=sub_backend_from_ran(row.ran),
        layout=row.layout,
        context_parallel=coords.cp > 1,
        cp_size=coords.cp,
        cp_comm_type=coords.cp_comm_type,
        dout_strided=_replayed_dout_unlike_out(row),
        **match_context(spec),
    )
    return Probe(
        case=row.case,
        context=context,
        verdict=row.verdict,
        ran=row.ran,
        reason=row.reason,
        failing=frozenset(row.failing_tensors),
        nonfinite=frozenset(name for name, t in row.tensors.items() if t.nan or t.inf),
        nondeterministic=bool(row.differing_tensors),
        internal=row.internal,
    )


def known_defects(report: RunReport) -> list[str]:
    """One line per known defect whose conditions hold for the report's probes — "this matches ..." where a
    probe shows its symptom, "not reproduced here: ..." where none does — then the machine-level defects
    that match the machine but no probe."""
    from attn_doctor.machine.known_bugs import describe_run, load_known_bugs

    if report.env is None:
        return []
    return describe_run(load_known_bugs(), report.env, [row_probe(row, report.env) for row in report.rows])


def machine_defects(env: EnvReport) -> list[str]:
    from attn_doctor.machine.known_bugs import (
        describe,
        load_known_bugs,
        match_environment,
    )

    return [describe(match) for match in match_environment(load_known_bugs(), env)]


def print_defects(console: Console, report: RunReport, heading: str) -> None:
    lines = known_defects(report)
    if lines:
        console.print(heading, style="bold yellow")
        for line in lines:
            console.print(f"  - {line}")
