"""Known TE/cuDNN defects beside a command's output: wiring the known-defect table to a report or a machine.

The recognition itself is `attn_doctor.known_defects` (dataclasses in, dataclasses out); here a report's rows
become its probes, with the one fact only a capture on this machine holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from attn_doctor.known_defects import Probe
    from attn_doctor.machine.fingerprint import EnvReport
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


def probe_with_capture(row: Row, env: EnvReport) -> Probe:
    """A row as the rules read it (`attn_doctor.known_defects.row_probe`), with whether its replayed call's
    dO was strided unlike out, read from the capture where it is here."""
    from attn_doctor.known_defects import row_probe

    return row_probe(row, env, dout_strided=_replayed_dout_unlike_out(row))


def known_defects(report: RunReport) -> list[str]:
    """One line per known defect whose conditions hold for the report's probes — "this matches ..." where a
    probe shows its symptom, "not reproduced here: ..." where none does — then the machine-level defects
    that match the machine but no probe."""
    from attn_doctor.known_defects import describe_run, load_known_bugs

    if report.env is None:
        return []
    return describe_run(load_known_bugs(), report.env, [probe_with_capture(row, report.env) for row in report.rows])


def machine_defects(env: EnvReport) -> list[str]:
    from attn_doctor.known_defects import describe, load_known_bugs, match_environment

    return [describe(match) for match in match_environment(load_known_bugs(), env)]


def print_defects(console: Console, report: RunReport, heading: str) -> None:
    lines = known_defects(report)
    if lines:
        console.print(heading, style="bold yellow")
        for line in lines:
            console.print(f"  - {line}")
