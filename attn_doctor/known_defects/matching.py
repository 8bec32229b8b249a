"""Matching rules against the machine and a run's probes: which rules hold (with the facts that matched),
whether a probe shows a rule's symptom, and the findings of a run ("reproduced" or "not reproduced here")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from attn_doctor.known_defects.facts import Facts, MatchContext, Probe

if TYPE_CHECKING:
    from attn_doctor.core.case import Case
    from attn_doctor.known_defects.loading import KnownBug
    from attn_doctor.machine.fingerprint import EnvReport


@dataclass(frozen=True)
class Match:
    """A known bug that matches; evidence names the facts that matched."""

    bug: KnownBug
    scope: str  # "environment" or "case"
    evidence: str


@dataclass(frozen=True)
class Finding:
    """A known bug whose conditions hold for some probes of a run: reproduced where a probe shows its
    symptom, else "not reproduced here"."""

    bug: KnownBug
    reproduced: bool
    shown: tuple[Probe, ...]  # the probes that show the symptom (empty when not reproduced)
    quiet: tuple[Probe, ...]  # the probes whose conditions hold and that do not show it
    evidence: str  # the facts that matched, on the first probe named


def _evaluate(bug: KnownBug, env: EnvReport, case: Case | None, context: MatchContext) -> Match | None:
    """The match of one rule, or None. Without a case, only a machine-level rule can match, and the path
    it names is what it affects rather than a condition."""
    if case is None and bug.scope != "environment":
        return None
    facts = Facts(env, context, rule=bug.when, probed=case)
    labels: list[str] = []
    for condition, value in bug.conditions:
        if case is None and condition.scope == "path":
            continue
        outcome = condition.check(value, facts)
        if not outcome.matched:
            return None
        if outcome.label:
            labels.append(outcome.label)
    evidence = " + ".join(labels)
    if case is None and "backend" in bug.when:
        evidence += f"; affects {'/'.join(bug.when['backend'])}"
    return Match(bug=bug, scope=bug.scope, evidence=evidence)


def match_environment(
    bugs: Iterable[KnownBug], env: EnvReport, context: MatchContext | None = None
) -> list[Match]:
    """Bugs whose conditions are all about the machine (TE, cuDNN, sm, ...) and the run (default context).

    For `attn-doctor env`. ``context`` defaults to :meth:`MatchContext.from_env`.
    """
    context = context if context is not None else MatchContext.from_env(env)
    return [m for bug in bugs if (m := _evaluate(bug, env, None, context)) is not None]


def match_case(
    bugs: Iterable[KnownBug], env: EnvReport, case: Case, context: MatchContext | None = None
) -> list[Match]:
    """Every bug whose conditions hold on this machine, run, path and case, machine-level rules included
    (their path conditions are checked here: the context says which path ran)."""
    context = context if context is not None else MatchContext.from_env(env)
    return [m for bug in bugs if (m := _evaluate(bug, env, case, context)) is not None]


# --------------------------------------------------------------------------- symptoms and findings


def shows_symptom(symptom: str | None, probe: Probe) -> bool:
    """Whether a probe shows a defect's symptom: the backend did not run (SKIP) for "backend disabled", the
    kernel's own ERROR for an illegal memory access, NaN/Inf (or the kernel's ERROR) for NaN, differing
    repeats for nondeterminism, a failing out or gradient for wrong numbers. A FAIL without per-tensor
    verdicts (older documents) counts for every numerical symptom."""
    kernel_error = probe.verdict == "ERROR" and not probe.internal
    failed_whole = probe.verdict == "FAIL" and not probe.failing
    if symptom == "backend disabled":
        return probe.verdict == "SKIP"
    if symptom == "illegal memory access":
        return kernel_error
    if symptom == "NaN":
        return bool(probe.nonfinite) or kernel_error or failed_whole
    if symptom == "nondeterministic":
        return probe.nondeterministic
    if symptom == "wrong output":
        return "out" in probe.failing or failed_whole
    if symptom == "wrong gradient":
        return any(name != "out" for name in probe.failing) or failed_whole
    return probe.verdict == "FAIL" or kernel_error  # "mask leak", or a rule without a symptom


def _tells(symptom: str | None, probe: Probe) -> bool:
    """Whether a probe can show the symptom or its absence: one that did not run (SKIP) says nothing about
    wrong numbers, and attn-doctor's own ERROR nothing about anything."""
    if probe.internal:
        return False
    return symptom == "backend disabled" or probe.verdict != "SKIP"


def find_known_bugs(bugs: Iterable[KnownBug], env: EnvReport, probes: Sequence[Probe]) -> list[Finding]:
    """Every bug whose conditions hold for some probe that can tell: reproduced when one of them shows its
    symptom, "not reproduced here" when none does. Reproduced findings first, each in the data file's order."""
    findings: list[Finding] = []
    for bug in bugs:
        held = [(probe, m) for probe in probes
                if _tells(bug.symptom, probe) and (m := _evaluate(bug, env, probe.case, probe.context)) is not None]
        if not held:
            continue
        shown = [(p, m) for p, m in held if shows_symptom(bug.symptom, p)]
        quiet = tuple(p for p, _ in held if not shows_symptom(bug.symptom, p))
        first = (shown or held)[0][1]
        findings.append(Finding(bug, bool(shown), tuple(p for p, _ in shown), quiet, first.evidence))
    return sorted(findings, key=lambda f: not f.reproduced)
