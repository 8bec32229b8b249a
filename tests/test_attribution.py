"""Whose error is it: what the kernel under test raises is its ERROR; what fails inside attn-doctor is
attn-doctor's, said so, never counted as the kernel's fault (not in the faulty list, not a bisect failure).
And what a report concludes is derived from its rows: an interrupted sweep reports what a finished one does."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from attn_doctor.backends import BASELINE, Backend, BackendSpec
from attn_doctor.core.case import make_case
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import KernelError
from attn_doctor.execution.session import row_from_reply
from attn_doctor.probes import Caches, run_probe
from attn_doctor.verdict.diagnosis import exit_code, find_faulty, summarize
from attn_doctor.verdict.judge import judge

CASE = make_case(batch=1, seq=8, heads=2, head_dim=8, dtype="fp32", mask="causal", seed=2)
SPEC = BackendSpec("raising", "kernel", {"target": "x.py", "func": "f"})


class Raising(Backend):
    family = "kernel"

    def forward(self, q, k, v, case, semantics=None):
        raise RuntimeError("the kernel's own bug")

    @classmethod
    def repro_source(cls, spec):  # pragma: no cover - not needed here
        return ""


def test_what_the_kernel_raises_is_the_kernels_error():
    with pytest.raises(KernelError, match="RuntimeError: the kernel's own bug"):
        run_probe(Raising(SPEC), Coords.call(CASE, SPEC), Caches(torch.device("cpu")))


def test_what_fails_in_attn_doctor_is_not_the_kernels(monkeypatch):
    from attn_doctor.numerics import views

    def broken_build(*args, **kwargs):
        raise IndexError("list index out of range")

    monkeypatch.setattr(views, "build", broken_build)
    with pytest.raises(IndexError) as caught:
        run_probe(Raising(SPEC), Coords.call(CASE, SPEC), Caches(torch.device("cpu")))
    assert not isinstance(caught.value, KernelError)


def _internal_rows():
    from attn_doctor.numerics.metrics import TensorMetrics

    metrics = {name: TensorMetrics(1e-3, 1e-3, 1.0, 1e-3, 0, 0, 0).to_dict() for name in ("out", "dq", "dk", "dv")}
    baseline = row_from_reply(Coords.call(CASE, BASELINE), {"status": "ok", "metrics": metrics})
    internal = row_from_reply(Coords.call(CASE, SPEC, "transposed"),
                              {"status": "error", "reason": "IndexError: list index out of range", "internal": True})
    return judge([baseline, internal])


def test_attn_doctors_own_error_is_reported_as_such_and_blames_no_kernel():
    rows = _internal_rows()
    internal = rows[1]
    assert internal.verdict == "ERROR" and internal.internal
    assert internal.reason.startswith("attn-doctor internal error (not the kernel's)")
    assert find_faulty(rows) == []
    text = summarize(rows)
    assert "attn-doctor itself failed while probing raising" in text and "crashed" not in text
    assert exit_code(rows) == 1  # a path could not be judged: never a silent pass
    from attn_doctor.results.row import Row

    assert Row.from_dict(internal.to_dict()).internal  # it survives the results JSON


def test_bisect_never_counts_attn_doctors_own_error_as_a_failure():
    from attn_doctor.bisect.engine import Bisector, CannotBisect, Outcome
    from attn_doctor.bisect.knobs import coords_at

    start = coords_at(make_case(batch=2, seq=64, heads=2, head_dim=16, dtype="fp32", mask="none"))

    def probe(coords):
        if coords.case.seq < 10:  # attn-doctor breaks on tiny cases: that is not the kernel's boundary
            return Outcome("ERROR", "IndexError: boom", internal=True)
        return Outcome("FAIL", "dq: error 0.05") if coords.case.batch >= 2 else Outcome("PASS")

    result = Bisector(probe).run(start)
    assert result.minimal.case.seq >= 10 and result.minimal_outcome.verdict == "FAIL"
    assert {c.knob for c in result.necessary} >= {"batch"}
    with pytest.raises(CannotBisect, match="attn-doctor itself failed"):
        Bisector(lambda coords: Outcome("ERROR", "IndexError: boom", internal=True)).run(start)


@pytest.mark.slow
def test_an_interrupted_sweep_reports_what_a_finished_one_does(tmp_path, run_cli, monkeypatch):
    """results.jsonl and the sweep's header, without results.json (the sweep was killed), render the same
    report as the finished sweep, summary and depth sentence included."""
    monkeypatch.chdir(tmp_path)
    result = run_cli(["sweep", "--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu",
                      "--layers", "1,2", "--backend", "sdpa.math", "--out", tmp_path / "done"])
    assert result.exit_code == 0, result.output
    shutil.copytree(tmp_path / "done", tmp_path / "cut")
    (tmp_path / "cut" / "results.json").unlink()
    finished = run_cli(["report", tmp_path / "done", "--format", "json"]).stdout
    interrupted = run_cli(["report", tmp_path / "cut", "--format", "json"]).stdout
    a, b = json.loads(finished), json.loads(interrupted)
    assert b["summary"] == a["summary"] and "dQ error grows with depth" in a["summary"]
    assert b["faulty"] == a["faulty"] and b["results"] == a["results"] and b["requested"] == a["requested"]
    assert b["command"] == a["command"] and b["env"]["torch"] == a["env"]["torch"]


def test_a_kernel_module_that_fails_to_import_is_the_kernels_error(tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "broken_module.py").write_text(
        'raise ImportError("the kernel module is broken")\n\ndef attn(q, k, v, *, causal, softmax_scale):\n    return q\n')
    result = run_cli(["run", "--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu",
                      "--layout", "contiguous", "--kernel", "broken_module.py:attn", "--json", "r.json"])
    assert result.exit_code == 1, result.output
    row = next(r for r in json.loads((tmp_path / "r.json").read_text())["results"] if r["backend"] == "attn")
    assert row["verdict"] == "ERROR" and row["reason"] == "ImportError: the kernel module is broken"
    assert "internal" not in row
