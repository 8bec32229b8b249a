"""What users read about known defects: a rule's label ("TE#1195"), the line for a machine-level match
(`attn-doctor env`), the line for a finding of a run, and a run's lines in order. The reports, issue bodies
and the terminal show these lines as they are."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from attn_doctor.known_defects.matching import Finding, Match, find_known_bugs, match_environment

if TYPE_CHECKING:
    from attn_doctor.known_defects.facts import Probe
    from attn_doctor.known_defects.loading import KnownBug
    from attn_doctor.machine.fingerprint import EnvReport


def _fix_and_workaround(bug: KnownBug) -> str:
    fixed = f"fixed in {bug.fixed_in}" if bug.fixed_in else "no fixed version known"
    return f"{fixed}; workaround: {bug.workaround}" if bug.workaround else fixed


def _headline(bug: KnownBug) -> str:
    symptom = f" ({bug.symptom})" if bug.symptom else ""
    return f"{bug.label}: {bug.title}{symptom}"


def describe(match: Match) -> str:
    """One machine-level line: the defect, the facts that matched, the fix and the workaround, where to read."""
    bug = match.bug
    return f"{_headline(bug)} — matches {match.evidence}; {_fix_and_workaround(bug)}. See {bug.reference}"


def _where(probes: Sequence[Probe], most: int = 6) -> str:
    """'te.fused, te.fused.det on transposed (b4 s1024 ...)': the paths by the layouts they share, then the case."""
    layouts: dict[str, list[str]] = {}
    for p in probes:
        places = layouts.setdefault(p.context.backend or "?", [])
        if (p.context.layout or "?") not in places:
            places.append(p.context.layout or "?")
    groups: dict[tuple[str, ...], list[str]] = {}
    for backend, places in layouts.items():
        groups.setdefault(tuple(places), []).append(backend)
    parts = []
    for places, backends in groups.items():
        shown = ", ".join(places[:most]) + (f" and {len(places) - most} more" if len(places) > most else "")
        parts.append(f"{', '.join(backends)} on {shown}")
    cases = list(dict.fromkeys(p.case.short() for p in probes))
    text = "; ".join(parts)
    return f"{text} ({cases[0]})" if len(cases) == 1 else f"{text} (in {len(cases)} cases, e.g. {cases[0]})"


def _absence(bug: KnownBug, probes: Sequence[Probe]) -> str:
    if bug.symptom == "backend disabled":
        ran = next((p.ran for p in probes if p.ran), "")
        return f"the backend ran ({ran})" if ran else "the backend ran"
    verdicts = sorted({p.verdict for p in probes})
    return "it passed" if verdicts == ["PASS"] else f"the symptom did not show ({', '.join(verdicts)})"


def describe_finding(finding: Finding) -> str:
    """One line for a run: "<paths> (<case>): this matches TE#NNNN: ..., fixed in X; workaround: Y" with the
    code line the rule names (what `report --format issue` shows as the suspected location), or "not
    reproduced here: TE#NNNN: ... — its conditions hold for <paths>, but it passed"."""
    bug = finding.bug
    if finding.reproduced:
        said = next((p.reason for p in finding.shown if p.reason), "") if bug.symptom == "backend disabled" else ""
        read = (f"Code: {bug.source}; see {bug.reference}" if bug.source and bug.source != bug.reference
                else f"See {bug.reference}")
        line = (f"{_where(finding.shown)}: this matches {_headline(bug)}; {_fix_and_workaround(bug)}. "
                f"Conditions: {finding.evidence}.{f' Skipped: {said}.' if said else ''} {read}")
        if finding.quiet:
            line += f" (Its conditions also hold for {_where(finding.quiet)}, where it did not show.)"
        return line
    return (f"not reproduced here: {_headline(bug)} — its conditions hold for {_where(finding.quiet)} "
            f"({finding.evidence}), but {_absence(bug, finding.quiet)}. See {bug.reference}")


def describe_run(bugs: Sequence[KnownBug], env: EnvReport, probes: Sequence[Probe]) -> list[str]:
    """The lines for a run: each finding on its probes (reproduced first), then the machine-level rules that
    match the machine but none of the probes (e.g. a path the run did not include)."""
    findings = find_known_bugs(bugs, env, probes)
    found = {f.bug.id for f in findings}
    machine = [m for m in match_environment(bugs, env) if m.bug.id not in found]
    return [describe_finding(f) for f in findings] + [describe(m) for m in machine]
