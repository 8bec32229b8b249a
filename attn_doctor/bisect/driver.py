"""Drives the bisect engine with real kernels: a bisect Config becomes runner jobs on live workers."""

from __future__ import annotations

from attn_doctor.backends import BASELINE, BackendSpec
from attn_doctor.bisect.engine import BisectResult, Config, Outcome, Probe
from attn_doctor.verdict.diagnosis import BASELINE_LAYOUT
from attn_doctor.results.document import Row
from attn_doctor.execution.session import Job, Session, plan_depth_jobs, plan_jobs
from attn_doctor.verdict.rule import MULTIPLE


def config_jobs(config: Config, spec: BackendSpec) -> list[Job]:
    """The baseline job the verdict needs, then the job that probes `spec` at `config` (last)."""
    case = config.case
    if config.layers:
        return plan_depth_jobs(case, [spec], [config.layers], [config.tp])
    if config.tp > 1:
        shards_as = "views" if config.layout == "head_slice" else "copies"
        return [Job(BackendSpec(BASELINE, "local"), case, BASELINE_LAYOUT),
                Job(spec, case, config.layout, "tp", {"tp": config.tp, "shards_as": shards_as})]
    return plan_jobs([case], [spec], [config.layout])


def probe_row(session: Session, spec: BackendSpec, config: Config) -> Row:
    return session.run(config_jobs(config, spec))[-1]


def bisect_probe(session: Session, spec: BackendSpec) -> Probe:
    def probe(config: Config) -> Outcome:
        row = probe_row(session, spec, config)
        return Outcome(row.verdict, row.reason, tuple(row.failing_tensors), row.extra)

    return probe


def depth_diagnosis(session: Session, spec: BackendSpec, result: BisectResult) -> dict:
    """Where the fault first shows: the forward or the backward, and for a depth failure the first layer
    (in backward order, from the deepest) whose dQ leaves the baseline's band."""
    minimal = result.minimal
    if minimal.layers:  # the stack's minimal case, as one call
        single = probe_row(session, spec, Config(minimal.case, "contiguous", 1))
        single_verdict, failing = single.verdict, single.failing_tensors
    else:  # the minimal case is one call already, and the bisector probed it
        single_verdict, failing = result.minimal_outcome.verdict, list(result.minimal_outcome.tensors)
    if "out" in failing:
        first_wrong = "forward (out is already wrong)"
    elif failing:
        first_wrong = f"backward (out is right; {', '.join(failing)} wrong)"
    else:
        first_wrong = "neither in one call: the fault shows only through the stack"
    diagnosis = {"first_wrong": first_wrong, "single_call_verdict": single_verdict}
    if minimal.layers:
        errors = result.minimal_outcome.extra.get("dq_rel_err_by_layer", [])
        baseline = result.minimal_outcome.extra.get("baseline_dq_rel_err_by_layer", [])
        band = MULTIPLE["dq"]
        out_of_band = [i + 1 for i, (e, b) in enumerate(zip(errors, baseline)) if e > band * b]
        diagnosis["first_layer_out_of_band"] = max(out_of_band) if out_of_band else None
        diagnosis["dq_ratio_by_layer"] = [e / b if b else None for e, b in zip(errors, baseline)]
    return diagnosis
