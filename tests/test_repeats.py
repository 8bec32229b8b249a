"""`--repeats N`: each single call run N times on the same inputs and views, whether the repeats are bitwise
identical, their spread, and the verdict on the worst repeat (CPU, real torch kernels and worker processes).

The nondeterministic kernels are in tests/kernels/nondeterministic.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from attn_doctor.render.format import REPEATS_MARK
from cli_checks import wrapped_lines, one_line_error

KERNELS = Path(__file__).resolve().parent / "kernels" / "nondeterministic.py"
NOISY = f"{KERNELS}:noisy"
SECOND_CALL = f"{KERNELS}:wrong_on_second_call"
TINY = ["--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu"]
SMALL = ["--batch", "2", "--seq", "64", "--heads", "4", "--head-dim", "16", "--device", "cpu"]
TENSORS = ("out", "dq", "dk", "dv")


def _run(run_cli, tmp_path, args):
    """(click result, results document) of `attn-doctor run ARGS --json`."""
    path = tmp_path / "r.json"
    result = run_cli(["run", *args, "--json", path])
    return result, json.loads(path.read_text())


def _measured(doc):
    return {(r["backend"], r["layout"]): r for r in doc["results"] if r["tensors"]}


# --- torch's own kernels are reproducible -------------------------------------------------------------------

@pytest.mark.slow
def test_torch_kernels_are_bitwise_identical_over_repeats(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result, doc = _run(run_cli, tmp_path, [*TINY, "--backend", "sdpa.math", "--layout", "contiguous",
                                           "--layout", "transposed", "--repeats", "3"])
    assert result.exit_code == 0, result.output
    rows = _measured(doc)
    assert set(rows) == {("local", "contiguous"), ("sdpa.math", "contiguous"), ("sdpa.math", "transposed")}
    for row in rows.values():
        repeats = row["extra"]["repeats"]
        assert repeats["n"] == 3
        assert repeats["identical"] == {name: True for name in TENSORS}
        assert repeats["spread"] == {name: 0.0 for name in TENSORS}
        for name in TENSORS:  # the same error on every call, and the row's is that one
            assert len(set(repeats["rel_err"][name])) == 1
            assert row["tensors"][name]["rel_err"] == repeats["rel_err"][name][0]
    out = result.stdout
    assert "bitwise identical over 3 calls: local, sdpa.math" in out
    assert REPEATS_MARK not in out


def test_a_single_call_adds_nothing(run_cli, tmp_path, monkeypatch):
    """--repeats 1 (the default) writes and prints what attn-doctor always did: no repeats anywhere."""
    monkeypatch.chdir(tmp_path)
    result, doc = _run(run_cli, tmp_path, [*TINY, "--backend", "local", "--layout", "contiguous", "--repeats", "1"])
    assert result.exit_code == 0, result.output
    assert all("repeats" not in r["extra"] for r in doc["results"])
    assert "bitwise" not in result.stdout and REPEATS_MARK not in result.stdout
    report = run_cli(["report", tmp_path / "r.json"]).stdout
    assert "| repeats |" not in report and "Repeats:" not in report
    assert "repeat" not in run_cli(["report", tmp_path / "r.json", "--format", "csv"]).stdout.splitlines()[0]


# --- a nondeterministic kernel ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def noisy_run(tmp_path_factory):
    """The noisy kernel and the one wrong on its second call, 3 repeats, at 80 columns in a pipe."""
    from attn_doctor.cli import cli

    workdir = tmp_path_factory.mktemp("noisy")
    path = workdir / "r.json"
    runner = CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1"})
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        result = runner.invoke(cli, ["run", *SMALL, "--kernel", NOISY, "--kernel", SECOND_CALL, "--layout",
                                     "contiguous", "--repeats", "3", "--json", str(path)], catch_exceptions=False)
    return result, path, json.loads(path.read_text())


@pytest.mark.slow
def test_a_nondeterministic_kernel_is_reported_not_reproducible(noisy_run):
    result, _, doc = noisy_run
    row = _measured(doc)[("noisy", "contiguous")]
    repeats = row["extra"]["repeats"]
    assert repeats["n"] == 3
    assert not any(repeats["identical"].values())  # out, dq, dk and dv all differ between calls
    assert all(0 < repeats["spread"][name] < 1e-2 for name in TENSORS), repeats["spread"]
    assert row["verdict"] == "PASS"  # tiny noise: reproducibility is reported, not judged
    baseline = _measured(doc)[("local", "contiguous")]["extra"]["repeats"]
    assert all(baseline["identical"].values())
    out = result.stdout
    assert max(len(line) for line in wrapped_lines(out)) <= 80
    flat = " ".join(out.split())
    assert "bitwise identical over 3 calls: local" in flat
    assert f"{REPEATS_MARK} noisy: not bitwise reproducible over 3 calls on contiguous" in flat
    table = [line for line in out.splitlines() if line.startswith(" ") and line.strip().startswith(REPEATS_MARK)]
    assert len(table) == 2  # under the layout of each differing row (noisy, wrong_on_second_call)


@pytest.mark.slow
def test_the_verdict_is_on_the_worst_repeat(noisy_run, run_cli, tmp_path, monkeypatch):
    """A kernel wrong on one call of three FAILs with --repeats 3, on that call's numbers; it passes a
    single call."""
    from attn_doctor.results.report import RunReport

    result, _, doc = noisy_run
    assert result.exit_code == 1
    row = _measured(doc)[("wrong_on_second_call", "contiguous")]
    repeats = row["extra"]["repeats"]
    assert row["verdict"] == "FAIL"
    assert "--repeats 3" in RunReport.from_dict(doc).rows[-1].repro_command()  # the failure needs the repeats
    for name in TENSORS:
        errors = repeats["rel_err"][name]
        assert errors[1] > 10 * max(errors[0], errors[2]), errors
        assert repeats["worst"][name] == 1
        assert row["tensors"][name]["rel_err"] == errors[1]
        assert row["tensors"][name]["verdict"] == "FAIL"
        assert not repeats["identical"][name]
    monkeypatch.chdir(tmp_path)
    once, single = _run(run_cli, tmp_path, [*SMALL, "--kernel", SECOND_CALL, "--layout", "contiguous"])
    assert once.exit_code == 0, once.output
    assert _measured(single)[("wrong_on_second_call", "contiguous")]["verdict"] == "PASS"


def test_reports_show_the_repeats(noisy_run, run_cli):
    _, path, doc = noisy_run
    markdown = run_cli(["report", path]).stdout
    assert "| repeats |" in markdown and "Repeats: each call ran N times" in markdown
    assert "**3 calls differ: out " in markdown and "3 calls, bitwise identical" in markdown
    html = run_cli(["report", path, "--format", "html"]).stdout
    assert "<th>repeats</th>" in html and "3 calls differ: out " in html
    csv_text = run_cli(["report", path, "--format", "csv"]).stdout
    header = csv_text.splitlines()[0].split(",")
    assert {"repeats", "bitwise_identical", "repeat_spread"} <= set(header)
    from attn_doctor.results.report import RunReport

    again = RunReport.from_dict(json.loads(json.dumps(RunReport.from_dict(doc).to_dict())))
    assert [r.extra for r in again.rows] == [r["extra"] for r in doc["results"]]  # round-trips
    assert [r.differing_tensors for r in again.rows if r.backend == "noisy"] == [list(TENSORS)]


@pytest.mark.parametrize("view, width", [("sweep", 80), ("wide", 200)])
def test_sweep_and_wide_views_show_the_repeats(noisy_run, view, width):
    import io

    from rich.console import Console

    from attn_doctor.render.terminal import run_view, sweep_view
    from attn_doctor.results.report import read_report

    report = read_report(noisy_run[1])
    console = Console(file=io.StringIO(), width=width, highlight=False, markup=False, force_terminal=False)
    for renderable in sweep_view(report) if view == "sweep" else run_view(report, title="t", wide=True):
        console.print(renderable)
    text = console.file.getvalue()
    assert max(len(line) for line in text.splitlines()) <= width
    flat = " ".join(text.split())
    assert f"{REPEATS_MARK} noisy: not bitwise reproducible over 3 calls" in flat
    assert "bitwise identical over 3 calls: local" in flat
    if view == "wide":
        assert sum(line.strip() == REPEATS_MARK for line in text.splitlines()) == 2  # under the layouts


# --- bad input ----------------------------------------------------------------------------------------------

BAD = {
    "run-zero": (["run", *TINY, "--repeats", "0"], "--repeats"),
    "run-negative": (["run", *TINY, "--repeats", "-2"], "--repeats"),
    "run-fraction": (["run", *TINY, "--repeats", "1.5"], "--repeats"),
    "run-word": (["run", *TINY, "--repeats", "three"], "--repeats"),
    "sweep-zero": (["sweep", *TINY, "--repeats", "0"], "--repeats"),
    "run-tp": (["run", *TINY, "--tp", "2", "--repeats", "2"], "--repeats applies to single calls"),
    "run-nproc": (["run", *TINY, "--nproc", "2", "--tp", "2", "--repeats", "2"], "--repeats applies to single calls"),
    "sweep-layers": (["sweep", *TINY, "--layers", "2", "--repeats", "2"], "--repeats applies to single calls"),
    "sweep-tp": (["sweep", *TINY, "--tp", "2", "--repeats", "3"], "--repeats applies to single calls"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_repeats_exit_2_with_one_line(name, run_cli, tmp_path, monkeypatch):
    args, message = BAD[name]
    monkeypatch.chdir(tmp_path)
    line = one_line_error(run_cli(args))
    assert message in line, line
    assert not (tmp_path / "attn-doctor-results").exists()


@pytest.mark.parametrize("repeats", [0, -1, 1.5, True, "2"])
def test_requests_refuse_bad_repeats_without_the_command_line(repeats, small_case, tmp_path):
    from attn_doctor.backends import select
    from attn_doctor.core.errors import BadInput
    from attn_doctor.workflows.run import RunRequest
    from attn_doctor.workflows.sweep import SweepRequest, prepare

    with pytest.raises(BadInput, match="--repeats"):
        RunRequest(small_case, select(["local"]), ["contiguous"], "cpu", repeats=repeats).check()
    with pytest.raises(BadInput, match="--repeats"):
        prepare(SweepRequest([small_case], select(["local"]), ["contiguous"], "cpu", tmp_path / "s", repeats=repeats))


@pytest.mark.slow
def test_a_sweep_repeats_and_resumes_only_with_the_same_repeats(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["sweep", *TINY, "--seq", "16,24", "--backend", "sdpa.math", "--layout", "contiguous"]
    result = run_cli([*args, "--repeats", "2", "--out", tmp_path / "s"])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "s" / "results.json").read_text())["results"]
    assert len(rows) == 4 and all(r["extra"]["repeats"]["n"] == 2 for r in rows)
    assert "bitwise identical over 2 calls: local, sdpa.math" in " ".join(result.stdout.split())
    line = one_line_error(run_cli([*args, "--repeats", "3", "--resume", tmp_path / "s"]))
    assert "--repeats 3" in line and "2 time(s)" in line
    assert run_cli([*args, "--repeats", "2", "--resume", tmp_path / "s"]).exit_code == 0


# --- where the count goes: the workers' jobs, the memory estimate -------------------------------------------

def test_the_workers_jobs_carry_the_repeat_count(small_case, monkeypatch):
    """A single call's job asks for --repeats runs; TP shards' jobs for one (they run once)."""
    from attn_doctor.backends import select
    from attn_doctor.execution import session as session_module
    from attn_doctor.probes.plan import plan_calls, plan_tp

    jobs = []

    class Recorder:
        def __init__(self, family, device, timeout_s, environment=None):
            self.family, self.hello, self.startup_seconds, self.environment = family, {}, 0.0, environment or {}

        def ensure_started(self):
            return None

        def request(self, job, on_progress=None):
            jobs.append(job)
            return {"status": "skip", "reason": "recorded"}

        def ask_to_quit(self):
            return None

        def close(self, graceful=True):
            pass

    monkeypatch.setattr(session_module, "Worker", Recorder)
    specs = select(["sdpa.math"])
    with session_module.Session("cpu", repeats=4) as session:
        session.run(plan_calls(small_case, specs, ["contiguous", "transposed"]))
        session.run(plan_tp(small_case, specs, [2]))
    calls = [j for j in jobs if j["coords"]["kind"] == "layout"]
    shards = [j for j in jobs if j["coords"]["kind"] == "tp"]
    assert len(calls) == 4 and len(shards) == 2
    assert all(j["repeats"] == 4 for j in calls) and all(j["repeats"] == 1 for j in shards)


def test_the_memory_estimate_counts_the_first_repeats_copy():
    from attn_doctor.backends import select
    from attn_doctor.core.case import DTYPE_BYTES, make_case
    from attn_doctor.core.errors import BadInput
    from attn_doctor.execution.budget import MemoryBudget
    from attn_doctor.execution.memory_plan import plan_memory
    from attn_doctor.probes.plan import plan_calls, plan_tp

    case = make_case(batch=4, seq=4096, heads=16, head_dim=64)
    specs = select(["sdpa.math"])
    calls = plan_calls(case, specs, ["contiguous"])
    once, thrice = plan_memory(calls, "cpu", None), plan_memory(calls, "cpu", None, repeats=3)
    q = case.batch * case.seq * case.heads * case.head_dim
    kv = case.batch * case.seq_kv * case.kv_heads * case.head_dim
    copy = (2 * q + 2 * kv) * DTYPE_BYTES[case.dtype]
    assert thrice.estimate - once.estimate == pytest.approx(2 * copy, rel=0.01)  # both families keep one copy
    shards = plan_tp(case, specs, [2])
    assert plan_memory(shards[1:], "cpu", None, repeats=3).estimate == plan_memory(shards[1:], "cpu", None).estimate
    # on a GPU, below what the families side by side need, they take turns; below that with the copy, it is refused
    gpu = plan_memory(calls, "cuda", None)
    in_turn = plan_memory(calls, "cuda", MemoryBudget(gpu.estimate - 1, "cuda:0", "a test budget", 80 << 30))
    assert in_turn.serial and in_turn.estimate < gpu.estimate
    budget = MemoryBudget(in_turn.estimate + copy // 2, "cuda:0", "a test budget", 80 << 30)
    plan_memory(calls, "cuda", budget)
    with pytest.raises(BadInput, match="needs about"):
        plan_memory(calls, "cuda", budget, repeats=3)


# --- the repeats' arithmetic ----------------------------------------------------------------------------------

def test_bitwise_equality_and_distance():
    from attn_doctor.probes.repeats import bitwise_equal, relative_distance

    a = torch.randn(2, 5, 3, 4, dtype=torch.bfloat16)
    assert bitwise_equal(a, a.clone()) and bitwise_equal(a.transpose(1, 2), a.clone().transpose(1, 2))
    assert relative_distance(a, a.clone()) == 0.0
    signed = a.clone()
    signed[0, 0, 0, 0] = 0.0
    negative = signed.clone()
    negative[0, 0, 0, 0] = -0.0
    assert not bitwise_equal(signed, negative) and relative_distance(signed, negative) == 0.0  # bits, not values
    nan = a.clone()
    nan[1, 1, 1, 1] = float("nan")
    assert bitwise_equal(nan, nan.clone())  # the same NaN is the same bits
    assert not bitwise_equal(a, a.float())
    b = a.clone()
    b[0, 1] += 0.5
    exact = (b.double() - a.double()).norm() / a.double().norm()
    assert relative_distance(b, a) == pytest.approx(float(exact), rel=1e-12)
    zero = torch.zeros(1, 2, 1, 1)
    assert relative_distance(zero, zero) == 0.0 and math.isinf(relative_distance(zero + 1, zero))


def test_the_worst_repeat_is_the_one_with_nan_first_then_the_largest_error():
    from attn_doctor.numerics.metrics import TensorMetrics
    from attn_doctor.probes.repeats import Repeats

    def metrics(rel, nan=0):
        return TensorMetrics(rel_err=rel, max_abs_err=rel, cosine=1.0, worst_head_rel_err=rel, nan=nan, inf=0,
                             ref_nonfinite=0)

    t = torch.ones(1, 2, 1, 1)
    record = Repeats(3)
    for rel, nan, scale in ((1e-3, 0, 1.0), (5e-2, 0, 1.5), (1e-4, 3, 1.0)):
        record.add({"dq": t * scale}, {"dq": metrics(rel, nan)})
    facts = record.facts()["repeats"]
    assert record.worst["dq"].nan == 3 and facts["worst"] == {"dq": 2}
    assert facts["identical"] == {"dq": False} and facts["spread"]["dq"] == pytest.approx(0.5)
    assert facts["rel_err"] == {"dq": [1e-3, 5e-2, 1e-4]}
    single = Repeats(1)
    single.add({"dq": t}, {"dq": metrics(1e-3)})
    assert single.facts() == {} and single.worst["dq"].rel_err == 1e-3
    with pytest.raises(ValueError):
        Repeats(0)
