"""Known TE/cuDNN defects beside a command's output: wiring the known-defect table to a report or a machine."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from attn_doctor.machine.fingerprint import EnvReport
    from attn_doctor.results.report import RunReport


def known_defects(report: RunReport) -> list[str]:
    """Descriptions of the known defects that match the report's machine and cases (each case matched with
    the qkv formats of the paths that ran it, as the rules are written for, and the context a path sets
    itself: TE's deterministic path is matched as deterministic whatever the environment says)."""
    from attn_doctor.backends import match_context, match_format
    from attn_doctor.machine.known_bugs import case_descriptions

    if report.env is None:
        return []
    cases: dict[tuple, tuple] = {}
    for row in report.rows:
        _, contexts = cases.setdefault(row.case.key(), (row.case, set()))
        spec = row.coords.backend
        contexts.add((match_format(spec, row.case), tuple(sorted(match_context(spec).items()))))
    return case_descriptions(report.env, [
        (case, [{"qkv_format": fmt, **dict(extra)} if extra else fmt for fmt, extra in sorted(contexts, key=str)])
        for case, contexts in cases.values()])


def machine_defects(env: EnvReport) -> list[str]:
    from attn_doctor.machine.known_bugs import describe, load_known_bugs, match_environment

    return [describe(match) for match in match_environment(load_known_bugs(), env)]


def print_defects(console: Console, report: RunReport, heading: str) -> None:
    lines = known_defects(report)
    if lines:
        console.print(heading, style="bold yellow")
        for line in lines:
            console.print(f"  - {line}")
