"""The memory budget and the plan that keeps a request inside it (`execution/budget.py`, `execution/memory_plan.py`,
`machine/memory.py`), on fake device sizes; a probe that runs out of memory (retried alone, then TOO-BIG); the
bound on the references the parent keeps; --max-memory on the command line. The sampled peaks on a GPU are
benchmarks (benchmarks/bench_memory.py), not tests."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from attn_doctor.backends import select
from attn_doctor.core.case import make_case
from attn_doctor.core.errors import BadInput
from attn_doctor.execution.budget import GIB, MIB, MemoryAsk, MemoryBudget, resolve_budget
from attn_doctor.execution.memory_plan import plan_memory, process_bytes
from attn_doctor.execution.shared_reference import ReferenceStore
from attn_doctor.machine.memory import MemoryReading, read_free
from attn_doctor.probes.plan import plan_calls, plan_depth, plan_points
from cli_checks import one_line_error

KERNELS = Path(__file__).resolve().parent / "kernels"
MEMORY = KERNELS / "memory.py"
TINY = ["--batch", "1", "--seq", "64", "--heads", "2", "--head-dim", "16", "--device", "cpu"]


def _gpu(gib: float) -> MemoryBudget:
    return MemoryBudget(int(gib * GIB), "cuda:0", f"--max-memory {gib} GiB", 80 * GIB)


def _calls(case=None, specs=None):
    specs = specs if specs is not None else select([])
    return plan_calls(case or make_case(), specs, [])


def _sweep_coords(cases, specs=None):
    specs = specs if specs is not None else select([])
    return [c for point in plan_points(cases, []) for c in point.coords(specs)]


# --- the budget ------------------------------------------------------------------------------------------------

def test_the_default_budget_is_what_is_free_less_a_margin():
    reading = MemoryReading(free=30 * GIB, total=80 * GIB, where="cuda:0")
    budget = resolve_budget(reading, None)
    assert budget.bytes == 30 * GIB - int(30 * GIB * 0.05)  # beside a job holding 50 GiB of the 80
    assert budget.device_total == 80 * GIB and "30.0 GiB free on cuda:0" in budget.source
    small = resolve_budget(MemoryReading(free=4 * GIB, total=80 * GIB, where="cuda:0"), None)
    assert small.bytes == 4 * GIB - 512 * MIB  # the margin is never below 512 MiB


def test_max_memory_is_the_budget_and_never_more_than_is_free():
    reading = MemoryReading(free=70 * GIB, total=80 * GIB, where="cuda:0")
    assert resolve_budget(reading, 24 * GIB).bytes == 24 * GIB
    assert resolve_budget(reading, 24 * GIB).source == "--max-memory 24.0 GiB"
    held = resolve_budget(reading, 100 * GIB)
    assert held.bytes < 70 * GIB and "held to the" in held.source
    assert resolve_budget(None, None) is None  # nothing known: nothing planned against
    assert resolve_budget(None, 24 * GIB).bytes == 24 * GIB


def test_a_reading_of_the_ram_never_raises_and_a_budget_follows_the_device():
    ram = read_free("cpu")
    assert ram is not None and 0 < ram.free <= ram.total and ram.where == "RAM"
    gpu_reading = MemoryReading(free=70 * GIB, total=80 * GIB, where="cuda:0")
    # read for a GPU, run on the CPU (auto found no GPU for torch): the RAM is read instead
    assert MemoryAsk(None, gpu_reading).budget("cpu").where == "RAM"
    assert MemoryAsk(None, gpu_reading).budget("cuda").where == "cuda:0"


@pytest.mark.parametrize("text,expected", [("24GiB", 24 * GIB), ("48G", 48 * GIB), ("500MiB", 500 * MIB),
                                           ("1.5 TiB", int(1.5 * (1 << 40))), ("24GB", 24 * GIB),
                                           ("24gib", 24 * GIB)])
def test_max_memory_sizes(text, expected):
    from attn_doctor.cli.options import MEMORY_SIZE

    assert MEMORY_SIZE.convert(text, None, None) == expected


@pytest.mark.parametrize("text", ["24", "lots", "0GiB", "12 parsecs", "0.5MiB"])
def test_a_size_without_its_unit_or_below_a_mib_is_refused_in_one_line(text, run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(run_cli(["run", *TINY, "--max-memory", text]))
    assert line.startswith("attn-doctor: error: --max-memory") and "e.g. 24GiB" in line
    assert not (tmp_path / "attn-doctor-results").exists()


def test_every_command_that_runs_probes_takes_the_budget(run_cli):
    for command in ("run", "sweep", "bisect", "replay"):
        result = run_cli([command, "--help"])
        assert "--max-memory" in result.output, command


def test_max_memory_with_ranks_is_refused(run_cli):
    line = one_line_error(run_cli(["run", *TINY, "--nproc", "2", "--tp", "2", "--max-memory", "4GiB"]))
    assert "--max-memory" in line and "--nproc" in line


# --- the plan: every process counted, admission by memory ---------------------------------------------------------

def test_every_process_is_counted_the_parent_each_worker_and_their_contexts():
    specs = select(["local", "sdpa.math"])
    plan = plan_memory(_calls(specs=specs), "cuda", _gpu(70))
    contexts = plan.parts["the processes' CUDA contexts"]
    assert contexts == process_bytes("parent", "cuda") + 2 * process_bytes("local", "cuda")
    assert plan.workers == {"local": 1, "sdpa": 1}
    with_te = plan_memory(_calls(specs=select(["local", "sdpa.math", "te.fused"])), "cuda", _gpu(70))
    assert with_te.parts["the processes' CUDA contexts"] == contexts + process_bytes("te", "cuda")
    assert process_bytes("te", "cuda") > process_bytes("sdpa", "cuda")  # TE's modules and handles
    assert plan.estimate == sum(plan.parts.values())


def test_where_not_all_fit_the_family_with_the_most_workers_for_its_work_gives_one_up_first():
    """The families wait for one another through the references they share, so a cut keeps their workers in step
    with their work (counting workers alone, the family with the most gave one up whatever its work)."""
    cases = [make_case(seq=seq, seed=seed) for seq in (2048, 4096) for seed in range(6)]
    coords = [c for c in _sweep_coords(cases) if c.backend.name in ("sdpa.math", "local")]

    def cut_once(asked: dict[str, int]) -> dict[str, int]:
        unbounded = plan_memory(coords, "cuda", None, workers_per_family=asked)  # one reference kept per worker
        assert unbounded.workers == asked
        budget = MemoryBudget(unbounded.estimate - 1, "cuda:0", "a budget", 80 * GIB)
        return plan_memory(coords, "cuda", budget, workers_per_family=asked).workers

    # sdpa.math is 0.065 s a probe, local 0.1: 4 SDPA workers are more for their work than 6 local ones
    assert cut_once({"sdpa": 4, "local": 6}) == {"sdpa": 3, "local": 6}
    assert cut_once({"sdpa": 2, "local": 6}) == {"sdpa": 2, "local": 5}


def test_fewer_workers_run_where_all_would_not_fit_then_families_take_turns_then_it_is_refused():
    cases = [make_case(seq=seq) for seq in (2048, 3072, 4096, 5120)]
    coords = _sweep_coords(cases)
    roomy = plan_memory(coords, "cuda", _gpu(500), workers_per_family=3)
    assert set(roomy.workers.values()) == {3} and not roomy.serial and roomy.fewer == ""
    squeezed = plan_memory(coords, "cuda", MemoryBudget(roomy.estimate - 1, "cuda:0", "a budget", 80 * GIB), 3)
    assert sum(squeezed.workers.values()) < 9 and not squeezed.serial and squeezed.estimate < roomy.estimate
    assert "workers at once" in squeezed.fewer and "a budget" in squeezed.fewer
    one_each = plan_memory(coords, "cuda", None, workers_per_family=1)
    turns = plan_memory(coords, "cuda", MemoryBudget(one_each.estimate - 1, "cuda:0", "a budget", 80 * GIB), 3)
    assert turns.serial and set(turns.workers.values()) == {1} and "families take turns" in turns.fewer
    assert turns.live_references == 1
    with pytest.raises(BadInput) as refused:
        plan_memory(coords, "cuda", MemoryBudget(turns.estimate - 1, "cuda:0", "--max-memory 1.0 GiB", 80 * GIB), 3)
    line = str(refused.value)
    assert "needs about" in line and "the budget is" in line and "--max-memory 1.0 GiB" in line
    assert "the longest --seq that fits is about" in line


def test_each_process_is_held_to_a_share_that_keeps_them_all_within_the_budget():
    coords = _sweep_coords([make_case(seq=seq) for seq in (1024, 2048)])
    budget = _gpu(40)
    plan = plan_memory(coords, "cuda", budget, workers_per_family=2)
    assert not plan.serial
    held = plan.parent_cap + sum(plan.worker_caps[key] * count for key, count in plan.workers.items())
    fixed = plan.fixed["parent"] + sum(plan.fixed[key] * count for key, count in plan.workers.items())
    assert held + fixed <= budget.bytes
    assert held + fixed >= budget.bytes - 16 * MIB  # what the estimate leaves is shared out, not lost
    for key in plan.workers:  # each at least what its largest probe needs
        assert plan.worker_caps[key] >= plan.needs[key] > 0
    assert plan.alone_cap("sdpa") == budget.bytes - plan.fixed["parent"] - plan.fixed["sdpa"]


def test_the_depth_sweep_of_the_design_card_plans_within_20_gib():
    """`sweep --layers 24,128` on the default case, every path: the parent keeps 128 layers of float64 dQ (4 GiB),
    never 128 layers of float64 activations; one family's worker at a time."""
    specs = select([])
    for layers in (24, 128):
        plan = plan_memory(plan_depth(make_case(), specs, [layers], [1]), "cuda", _gpu(20))
        assert plan.serial and plan.estimate <= 20 * GIB, (layers, plan.parts)
    deep = plan_memory(plan_depth(make_case(), specs, [128], [1]), "cuda", _gpu(20))
    assert deep.parts["the float64 references the parent keeps"] == 128 * 4 * 1024 * 1024 * 8 * 5 // 4


def test_a_depth_that_does_not_fit_is_refused_with_the_deepest_that_does():
    specs = select(["sdpa.math"])
    with pytest.raises(BadInput) as refused:
        plan_memory(plan_depth(make_case(), specs, [4096], [1]), "cuda", _gpu(24))
    line = str(refused.value)
    assert "at 4096 layers needs about" in line and "--max-memory 24 GiB" in line
    deepest = int(line.split("the deepest --layers that fits is about ")[1].split(";")[0])
    assert 128 < deepest < 4096
    plan_memory(plan_depth(make_case(), specs, [deepest], [1]), "cuda", _gpu(24))


def test_the_cpu_plan_counts_the_ram_and_refuses_what_it_cannot_hold():
    plan = plan_memory(_calls(), "cpu", MemoryBudget(16 * GIB, "RAM", "16 GiB"))
    assert "the processes' interpreters" in plan.parts and plan.estimate <= 16 * GIB
    depth = plan_memory(plan_depth(make_case(), select([]), [24], [1]), "cpu", MemoryBudget(16 * GIB, "RAM", "16 GiB"))
    assert depth.estimate <= 16 * GIB
    with pytest.raises(BadInput, match="needs about"):
        plan_memory(_calls(make_case(seq=65536)), "cpu", MemoryBudget(16 * GIB, "RAM", "16 GiB"))


# --- the references the parent keeps -------------------------------------------------------------------------------

def test_a_family_running_ahead_waits_for_room_among_the_kept_references():
    from attn_doctor.execution.shared_reference import ReferenceStore

    store = ReferenceStore("cpu", max_live=1)
    store._compute = lambda case, layers: (torch.zeros(4),)  # noqa: SLF001 - the computation is not the point
    first, second = make_case(seed=1), make_case(seed=2)
    for case in (first, second):
        store.expect(case)
    store.handle(first)
    opened = threading.Event()
    threading.Thread(target=lambda: (store.handle(second), opened.set()), daemon=True).start()
    assert not opened.wait(0.6)  # the second waits while the first is kept
    store.done(first)
    assert opened.wait(5)
    store.clear()


def test_references_are_admitted_in_the_order_the_session_serves_their_cases():
    """A later case never takes a place before an earlier one: the earlier one's family, lagging, would wait for a
    place that only its own progress frees."""
    from attn_doctor.execution.shared_reference import ReferenceStore

    store = ReferenceStore("cpu", max_live=2)
    store._compute = lambda case, layers: (torch.zeros(4),)  # noqa: SLF001 - the computation is not the point
    first, second = make_case(seed=1), make_case(seed=2)
    for case in (first, second):
        store.expect(case)
    store.admit_in([(first, None), (second, None)])
    opened = threading.Event()
    threading.Thread(target=lambda: (store.handle(second), opened.set()), daemon=True).start()
    assert not opened.wait(0.6)  # room for two, but the first's turn comes first
    store.handle(first)
    assert opened.wait(5)
    store.done(first)
    again = make_case(seed=1)  # a probe retried alone: its case again, its turn gone by
    store.expect(again)
    reopened = threading.Event()
    threading.Thread(target=lambda: (store.handle(again), reopened.set()), daemon=True).start()
    assert reopened.wait(5)  # admitted by room alone
    store.clear()


@pytest.mark.parametrize("layouts", [["contiguous"], []])
def test_many_workers_per_family_never_wait_forever_for_a_place_among_the_kept_references(layouts, monkeypatch):
    """Twelve threads of one family, three of a slower one, fifteen references kept at most, some probes out of
    memory (retried alone at the end): every group finishes. Admitted in whatever order the threads asked, this
    stopped for good within seconds in four runs of five (issue 51's H100 sweeps)."""
    import random

    from attn_doctor.execution import concurrency, session as session_module
    from attn_doctor.execution.shared_reference import ReferenceStore

    class _Worker:
        def __init__(self, family, device, timeout_s, environment=None):
            self.family, self.hello, self.startup_seconds, self.environment = family, {}, 0.0, environment or {}

        def ensure_started(self):
            return None

        def request(self, job, on_progress=None):
            time.sleep(random.random() * (0.004 if self.family == "local" else 0.001))
            coords = job["coords"]
            if coords["backend"]["name"] == "sdpa.math" and coords["case"]["seed"] % 9 == 5 and \
                    job["memory_cap"] != "alone":
                return {"status": "oom", "reason": "OutOfMemoryError: CUDA out of memory", "tried": 0, "reserved": 0}
            return {"status": "skip", "reason": "stand-in"}

        def ask_to_quit(self):
            return None

        def close(self, graceful=True):
            return None

    monkeypatch.setattr(session_module, "Worker", _Worker)
    monkeypatch.setattr(session_module.Session, "_hold_parent", lambda self, plan: None)
    monkeypatch.setattr(session_module.Session, "_room", lambda self, key, alone: "alone" if alone else None)
    monkeypatch.setattr(concurrency, "cpu_cores", lambda: 16)
    monkeypatch.setattr(ReferenceStore, "_compute", lambda self, case, layers: (torch.zeros(1),))
    monkeypatch.setattr(ReferenceStore, "_release_cached_memory", lambda self: None)
    from attn_doctor.execution import shared_reference

    monkeypatch.setattr(shared_reference, "export_tensors", lambda tensors: "a handle")
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 0)
    cases = [make_case(seq=256, seed=seed) for seed in range(1, 120)]
    groups = [point.coords(select(["sdpa", "local"])) for point in plan_points(cases, layouts)]
    finished: list = []
    with session_module.Session("cuda", workers_per_family=None, budget=_gpu(75)) as session:
        runner = threading.Thread(target=lambda: finished.append(session.run_groups(groups)), daemon=True)
        runner.start()
        runner.join(60)
        assert finished, (f"stopped: {session.references._live} references kept of "  # noqa: SLF001
                          f"{session.references.max_live}, workers {session.plan.workers}")
        assert session.plan.workers == {"sdpa": 12, "local": 3}
    (judged,) = finished
    assert all(len(rows) == len(group) for rows, group in zip(judged, groups))


# --- out of memory: retried alone, then TOO-BIG ---------------------------------------------------------------------

@pytest.mark.slow
def test_a_probe_that_ran_out_of_memory_beside_others_is_retried_alone_and_judged(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["run", *TINY, "--kernel", f"{MEMORY}:fits_alone", "--layout", "contiguous",
                      "--json", "r.json"])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    assert {r["verdict"] for r in rows} == {"PASS"}
    assert "ERROR" not in result.output and "internal" not in result.output


@pytest.mark.slow
def test_a_probe_that_does_not_fit_even_alone_is_too_big_not_an_error(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["run", *TINY, "--kernel", f"{MEMORY}:never_fits", "--kernel", f"{MEMORY}:fits_alone",
                      "--layout", "contiguous", "--json", "r.json"])
    assert result.exit_code == 0, result.output  # the other path is judged and passes; nothing FAILs
    document = json.loads((tmp_path / "r.json").read_text())
    rows = {r["backend"]: r for r in document["results"]}
    assert rows["never_fits"]["verdict"] == "TOO-BIG"
    assert rows["never_fits"]["reason"].startswith("does not fit in ")
    assert "Tried to allocate 2.00 GiB" in rows["never_fits"]["reason"]
    assert not rows["never_fits"].get("internal")
    assert rows["fits_alone"]["verdict"] == "PASS"
    assert "Not judged: 1 probe of never_fits does not fit" in document["summary"]
    assert document["faulty"] == []  # no kernel is blamed, nor attn-doctor
    assert "TOO-BIG" in result.output


@pytest.mark.slow
def test_a_request_where_nothing_fits_is_exit_2_with_that_line(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(run_cli(["run", *TINY, "--kernel", f"{MEMORY}:never_fits", "--layout", "contiguous"]))
    assert "nothing was tested" in line and "never_fits: does not fit in " in line


def test_the_plan_is_recorded_and_read_back(tmp_path):
    from attn_doctor.results.report import RunReport, read_report

    plan = plan_memory(_calls(), "cuda", _gpu(24))
    report = RunReport(command="attn-doctor run", device="cuda", env=None, rows=[], memory=plan.to_dict())
    path = tmp_path / "results.json"
    path.write_text(json.dumps(report.to_dict()))
    again = read_report(path)
    assert again.memory["estimate"] == plan.estimate and again.memory["budget"]["bytes"] == 24 * GIB


def test_on_the_cpu_a_family_that_had_its_turn_still_counts():
    """glibc keeps what a process freed: on the CPU every family's peak and the parent's scratch are counted
    together even when the families take turns; on a GPU (freed memory goes back to the device) only the largest."""
    specs = select(["local", "sdpa.math"])
    coords = plan_depth(make_case(), specs, [24], [1])
    cpu = plan_memory(coords, "cpu", None)
    gpu = plan_memory(coords, "cuda", None)
    assert cpu.serial and gpu.serial
    assert cpu.estimate - sum(cpu.needs.values()) >= cpu.parts["the processes' interpreters"]
    assert gpu.estimate < gpu.parts["the processes' CUDA contexts"] + sum(gpu.needs.values()) + \
        gpu.parts["the float64 references the parent keeps"]


class _RecordingWorker:
    """A worker that records its jobs and answers each from its family's `answers` (default: a skip); by family,
    since the families' workers ask from threads of their own, in no set order."""

    jobs: list = []
    answers: dict = {}
    closed: list = []
    started: list = []  # a family each time one of its workers starts (again, after a close)

    def __init__(self, family, device, timeout_s, environment=None):
        self.family, self.hello, self.startup_seconds, self.environment = family, {}, 0.0, environment or {}
        self.running = False

    def ensure_started(self):
        if not self.running:
            type(self).started.append(self.family)
            self.running = True

    def request(self, job, on_progress=None):
        type(self).jobs.append(job)
        queue = type(self).answers.get(self.family)
        return queue.pop(0) if queue else {"status": "skip", "reason": "recorded"}

    def ask_to_quit(self):
        return None

    def close(self, graceful=True):
        type(self).closed.append(self.family)
        self.running = False


@pytest.fixture
def recorded(monkeypatch):
    from attn_doctor.execution import session as session_module

    _RecordingWorker.jobs, _RecordingWorker.answers, _RecordingWorker.closed, _RecordingWorker.started = [], {}, [], []
    monkeypatch.setattr(session_module, "Worker", _RecordingWorker)
    monkeypatch.setattr(session_module.Session, "_hold_parent", lambda self, plan: None)  # no GPU here
    monkeypatch.setattr(ReferenceStore, "handle", lambda self, case, layers=None: None)  # no reference needed
    monkeypatch.setattr(ReferenceStore, "_release_cached_memory", lambda self: None)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 0)
    return session_module


def test_families_taking_turns_give_their_cache_back_after_each_job(recorded):
    case = make_case(batch=1, seq=32, heads=2, head_dim=8)
    with recorded.Session("cpu") as session:
        session.run(plan_depth(case, select(["sdpa.math"]), [2], [1]))
    assert _RecordingWorker.jobs and all(job["release"] for job in _RecordingWorker.jobs)
    assert all(job["memory_cap"] is None for job in _RecordingWorker.jobs)  # no caps on the CPU
    _RecordingWorker.jobs.clear()
    with recorded.Session("cpu") as session:
        session.run(plan_calls(case, select(["sdpa.math"]), ["contiguous"]))
    assert _RecordingWorker.jobs and not any(job["release"] for job in _RecordingWorker.jobs)


def test_each_worker_is_held_to_its_share_and_alone_to_the_whole_budget(recorded):
    """On a GPU each job carries its worker's cap; a probe out of memory is asked again alone, every other worker
    closed, with the whole budget less the fixed parts as its cap, and becomes TOO-BIG when it fails again."""
    case = make_case(batch=1, seq=32, heads=2, head_dim=8)
    budget = _gpu(24)
    out_of_memory = {"status": "oom", "reason": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                     "tried": 2 * GIB, "reserved": 21 * GIB}
    # sdpa.math runs out of memory, beside the others and then alone (the baseline's worker answers a skip)
    _RecordingWorker.answers = {"sdpa": [out_of_memory, out_of_memory]}
    with recorded.Session("cuda", budget=budget) as session:
        rows = session.run(plan_calls(case, select(["sdpa.math"]), ["contiguous"]))
        plan = session.plan
    first, again = [job for job in _RecordingWorker.jobs if job["coords"]["backend"]["name"] == "sdpa.math"]
    assert first["memory_cap"] == plan.worker_caps["sdpa"]
    assert again["memory_cap"] == plan.alone_cap("sdpa")
    assert "local" in _RecordingWorker.closed  # the others were closed before it ran alone
    (row,) = [row for row in rows if row.backend == "sdpa.math"]
    assert row.verdict == "TOO-BIG" and not row.internal
    needs = float(row.reason.removeprefix("does not fit in 24.0 GiB (needs about ").split(" GiB)")[0])
    assert needs >= 23.0  # what its worker held and the allocation that failed, with the processes' fixed parts


def test_the_probes_retried_alone_go_one_process_after_another_each_worker_starting_once(recorded):
    """Two points whose sdpa.math and local probes all run out of memory beside the others: retried alone, one
    family's probes after the other's, so each family's worker starts once for the retries (in the order they were
    asked, point by point, the two families alternated and each retry started a worker again); every probe is
    retried, and a retry that fits is the row."""
    cases = [make_case(batch=1, seq=32, heads=2, head_dim=8, seed=seed) for seed in (1, 2, 3)]
    out_of_memory = {"status": "oom", "reason": "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
                     "tried": 2 * GIB, "reserved": 3 * GIB}
    _RecordingWorker.answers = {"sdpa": [out_of_memory] * 3, "local": [out_of_memory] * 3}
    groups = [point.coords(select(["sdpa.math"])) for point in plan_points(cases, ["contiguous"])]
    with recorded.Session("cuda", budget=_gpu(24)) as session:
        rows = session.run_groups(groups)
        turns = session.turn_seconds
    assert list(turns) == ["phase 1", "retried alone"]  # the retries' turn timed on its own
    retried = [job["coords"]["backend"]["name"] for job in _RecordingWorker.jobs[6:]]
    assert sorted(retried) == ["local"] * 3 + ["sdpa.math"] * 3
    assert retried in (["sdpa.math"] * 3 + ["local"] * 3, ["local"] * 3 + ["sdpa.math"] * 3)  # one family, the other
    assert sorted(_RecordingWorker.started[:2]) == ["local", "sdpa"]  # side by side first
    assert len(_RecordingWorker.started[2:]) <= 1  # then at most the second family's worker again (alternating: 5)
    assert all(row.verdict == "SKIP" for point in rows for row in point)  # the retries' answers (the recorder's skip)


def test_the_plan_table_the_readme_points_to_still_runs(capsys):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "plan_memory_table.py"
    spec = importlib.util.spec_from_file_location("plan_memory_table", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.main(["--budgets", "75,24"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| `")]
    assert len(rows) == 6
    deep = next(line for line in rows if "--layers 24,128" in line)
    assert "in turn" in deep and "refused" not in deep  # the design card's depth sweep fits 24 GiB
    assert "refused" in next(line for line in rows if "131072" in line)


def test_the_weights_share_te_tests_first_phase_as_its_measured_work_does(capsys):
    """benchmarks/plan_workers.py plans te-tests as on the lent H100 (16 cores, 75.2 GiB): its first phase gets TE
    10, SDPA 3 and local 2 workers, what the lease-5 run's measured work gives (9.8, 3.5, 1.7 of 15); weighed by
    seconds averaged over every row (static SKIPs among them) it gave TE 11 and SDPA 2, and SDPA was the slowest."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "plan_workers.py"
    spec = importlib.util.spec_from_file_location("plan_workers", path)
    planner = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(planner)
    assert planner.main(["--recipe", "te-tests", "--cores", "16", "--budget-gib", "75.2"]) == 0
    first_phase = capsys.readouterr().out.splitlines()[1]
    assert "points: local 2, sdpa 3, te 10;" in first_phase, first_phase


def test_a_session_runs_what_its_plan_cannot_fit_and_lets_it_be_too_big(recorded):
    """The command refuses a request too large before anything starts; a session's later groups (a bisect's steps)
    are not refused mid-way: the smallest plan runs, and a probe that does not fit becomes TOO-BIG."""
    case = make_case(batch=1, seq=32, heads=2, head_dim=8)
    tiny = MemoryBudget(1, "cuda:0", "a tiny budget", 80 * GIB)
    coords = plan_calls(case, select(["sdpa.math"]), ["contiguous"])
    with pytest.raises(BadInput):
        plan_memory(coords, "cuda", tiny)
    with recorded.Session("cuda", budget=tiny) as session:
        session.run(coords)
        assert session.plan.serial and session.plan.estimate > tiny.bytes


# --- how many workers, and phases by size ----------------------------------------------------------------------------

def test_on_a_gpu_the_cores_are_shared_among_the_families_by_their_work_and_on_the_cpu_one_each():
    from attn_doctor.execution.concurrency import FLOOR, default_workers

    work = {"te": 400 * 0.28, "sdpa": 400 * 0.12, "local": 100 * 0.1}  # te-coverage's probes, weighed
    units = {"te": 100, "sdpa": 100, "local": 100}
    shares = default_workers(work, units, "cuda", cores=16)
    assert shares == {"te": 10, "sdpa": 4, "local": 2}  # 15 slots (one core the parent's), by work; the floor
    even = default_workers({"te": 40.0, "sdpa": 40.0, "local": 10.0}, units, "cuda", cores=16)
    assert even == {"te": 7, "sdpa": 7, "local": 2}  # the same work, the same share
    assert default_workers(work, units, "cuda", cores=2) == {"te": FLOOR, "sdpa": FLOOR, "local": FLOOR}
    assert default_workers(work, {"te": 1, "sdpa": 3, "local": 100}, "cuda", cores=64)["te"] == 1  # one per unit
    assert default_workers(work, units, "cpu", cores=64) == {"te": 1, "sdpa": 1, "local": 1}


def test_a_familys_work_is_its_probes_each_weighed_by_what_a_probe_of_its_path_takes():
    from attn_doctor.execution.memory_plan import _demand

    case = make_case(seq=256)
    coords = [c for point in plan_points([case, make_case(seq=256, seed=2)], [])
              for c in point.coords(select(["sdpa.math", "sdpa.efficient", "local"]))]
    work = _demand(coords, "cuda", 1).work
    count = {name: sum(c.backend.name == name for c in coords) for name in ("sdpa.math", "sdpa.efficient", "local")}
    assert count["sdpa.math"] == count["sdpa.efficient"] == count["local"] > 0
    assert work == pytest.approx({"sdpa": count["sdpa.math"] * (0.065 + 0.05), "local": count["local"] * 0.1})


def _sized_groups(small: int, large: int, specs=None):
    cases = [make_case(seq=256, seed=seed) for seed in range(small)] + \
        [make_case(seq=4096, seed=seed) for seed in range(large)]
    specs = specs if specs is not None else select(["sdpa.math"])
    return [point.coords(specs) for point in plan_points(cases, [])]


def test_the_small_points_run_side_by_side_first_and_the_large_ones_on_fewer_workers_after():
    from attn_doctor.execution.memory_plan import phases_notes, plan_phases

    groups = _sized_groups(12, 3)
    small_alone = plan_memory([c for g in groups[:12] for c in g], "cuda", None, 3)
    budget = MemoryBudget(small_alone.estimate + 64 * MIB, "cuda:0", "a budget", 80 * GIB)
    assert plan_memory([c for g in groups for c in g], "cuda", budget, 3, refuse=False).fewer  # together: cut
    phases = plan_phases(groups, "cuda", budget, 3)
    assert len(phases) >= 2
    assert sorted(i for chosen, _ in phases for i in chosen) == list(range(15))  # each point once
    (first, first_plan), (last, last_plan) = phases[0], phases[-1]
    assert set(range(12)) <= set(first) and first_plan.workers == {"local": 3, "sdpa": 3} and not first_plan.fewer
    assert set(range(12, 15)) >= set(last) and sum(last_plan.workers.values()) < 6
    for _, plan in phases:
        assert plan.estimate <= budget.bytes or plan.serial
        assert plan.groups == len(_)
    (note, *_) = phases_notes([plan for _, plan in phases])
    assert f"{len(phases)} phases by size" in note and "12 on local 3, sdpa 3" in note and "a budget" in note


def test_one_phase_where_everything_fits_where_there_is_no_budget_and_for_depth_stacks():
    from attn_doctor.execution.memory_plan import phases_notes, plan_phases

    groups = _sized_groups(12, 3)
    ((chosen, plan),) = plan_phases(groups, "cuda", _gpu(500), 3)
    assert chosen == list(range(15)) and plan.workers == {"local": 3, "sdpa": 3} and plan.groups == 0
    assert phases_notes([plan]) == []
    assert len(plan_phases(groups, "cuda", None, 3)) == 1
    case = make_case(seq=4096)
    depth = [plan_depth(case, select(["sdpa.math"]), [2], [1]), plan_depth(make_case(seq=256), select(["sdpa.math"]),
                                                                         [2], [1])]
    one_each = plan_memory([c for g in depth for c in g], "cuda", None, 1)
    assert len(plan_phases(depth, "cuda", MemoryBudget(one_each.estimate, "cuda:0", "b", 80 * GIB), 3)) == 1


def test_a_session_in_phases_closes_the_workers_the_later_plan_does_not_count_and_judges_every_point(recorded):
    from attn_doctor.execution.memory_plan import plan_phases

    groups = _sized_groups(12, 3)
    small_alone = plan_memory([c for g in groups[:12] for c in g], "cuda", None, 3)
    budget = MemoryBudget(small_alone.estimate + 64 * MIB, "cuda:0", "a budget", 80 * GIB)
    expected = plan_phases(groups, "cuda", budget, 3)
    with recorded.Session("cuda", budget=budget, workers_per_family=3) as session:
        judged = session.run_groups(groups)
        plans, turns = session.plans, session.turn_seconds
    assert [plan.workers for plan in plans] == [plan.workers for _, plan in expected]
    assert list(turns) == [f"phase {n}" for n in range(1, len(plans) + 1)] and all(s > 0 for s in turns.values())
    assert all(len(rows) == len(group) for rows, group in zip(judged, groups))
    assert _RecordingWorker.closed  # the first phase's surplus workers, before the large points ran
    large = {groups[i][0].case.key() for i in expected[-1][0]}
    caps = {job["memory_cap"] for job in _RecordingWorker.jobs
            if job["coords"]["backend"]["name"] == "sdpa.math" and
            make_case(**{k: v for k, v in job["coords"]["case"].items() if k in ("seq", "seed")}).key() in large}
    assert caps == {expected[-1][1].worker_caps["sdpa"]}  # the large points ran on their own phase's caps


# --- the references kept at once: one per worker, more where the budget has room ----------------------------------

def test_on_a_gpu_the_parent_keeps_more_references_where_half_of_what_the_plan_leaves_holds_them():
    """The families do not start together (TE's import), and one reference per worker let the others run only that
    many cases ahead; the window widens with room, never past half the spare (the allocators' slack)."""
    cases = [make_case(seq=512, seed=seed) for seed in range(40)]
    coords = [c for c in _sweep_coords(cases) if c.backend.name in ("sdpa.math", "local")]
    one_each = plan_memory(coords, "cuda", None, workers_per_family=2)
    assert one_each.live_references == 4  # no budget: one per worker
    roomy = plan_memory(coords, "cuda", _gpu(70), workers_per_family=2)
    assert roomy.live_references == 40  # every case's reference fits in half the spare
    kept = roomy.parts["the float64 references the parent keeps"]
    assert kept == 10 * one_each.parts["the float64 references the parent keeps"]  # 40 references of one size
    assert roomy.estimate == one_each.estimate + kept - kept // 10 <= 70 * GIB
    # a budget whose spare holds about five more references than the workers' four: half of it, two or three
    tight = MemoryBudget(one_each.estimate + 5 * (kept // 40), "cuda:0", "a budget", 80 * GIB)
    plan = plan_memory(coords, "cuda", tight, workers_per_family=2)
    assert 4 < plan.live_references < 9
    assert plan.estimate - one_each.estimate <= (tight.bytes - one_each.estimate) // 2
    assert plan_memory(coords, "cpu", MemoryBudget(64 * GIB, "cpu", "RAM", 64 * GIB), 2).live_references == 4


# --- workers that change family where one runs dry (execution/handover.py) ----------------------------------------

def test_a_freed_worker_goes_to_the_forked_family_with_the_most_work_left_per_worker():
    from attn_doctor.execution.handover import receiver

    left, units, live = {"te": 60.0, "sdpa": 20.0, "local": 0.0}, {"te": 40, "sdpa": 30, "local": 0}, \
        {"te": 10, "sdpa": 2, "local": 0}
    forked = {"te", "sdpa", "local"}
    assert receiver(left, units, live, forked, {}, None) == "sdpa"  # 20/3 s a worker against TE's 60/11
    assert receiver(left, units, live, {"te", "local"}, {}, None) == "te"  # SDPA's would import SDPA anew
    assert receiver(left, units, {**live, "sdpa": 30}, forked, {}, None) == "te"  # a worker per unit already
    assert receiver({"local": 0.0}, {"local": 0}, {"local": 0}, forked, {}, None) is None


def test_no_worker_changes_family_where_its_share_is_not_worth_a_start_or_its_memory_does_not_fit():
    from attn_doctor.execution.handover import WORTH_S, receiver

    units, live = {"te": 5}, {"te": 1}
    assert receiver({"te": 2 * WORTH_S}, units, live, {"te"}, {}, None) == "te"  # a share of WORTH_S
    assert receiver({"te": 2 * WORTH_S - 0.1}, units, live, {"te"}, {}, None) is None
    assert receiver({"te": 2 * WORTH_S}, units, live, {"te"}, {"te": 10}, 10) == "te"
    assert receiver({"te": 2 * WORTH_S}, units, live, {"te"}, {"te": 10}, 9) is None


def test_a_closed_workers_memory_is_what_the_next_one_takes_and_a_worker_nobody_needs_stays_as_it_is():
    from attn_doctor.execution.handover import Handover

    handover = Handover(left_s={"te": 100.0, "sdpa": 0.0, "local": 0.0}, left_units={"te": 50, "sdpa": 0, "local": 0},
                        live={"te": 2, "sdpa": 2, "local": 1}, footprint={"te": 3, "sdpa": 2, "local": 2},
                        budgeted=True, forked={"te", "sdpa"})
    assert handover.drained("local", "local-1") == ([], None)  # not forked: neither moved nor closed
    assert handover.drained("sdpa", "sdpa-1") == ([], None)  # 2 bytes: a TE worker holds 3; kept, idle
    assert handover.drained("sdpa", "sdpa-2") == (["sdpa-2", "sdpa-1"], "te")  # both closed: 4 bytes, 1 left
    assert (handover.room, handover.live["te"], handover.moves, handover.idle) == (1, 3, [("sdpa", "te")], [])
    handover.took("te", 30.0)
    assert (handover.left_units["te"], handover.left_s["te"]) == (49, 70.0)
    unbudgeted = Handover(left_s={"te": 100.0, "sdpa": 0.0}, left_units={"te": 50, "sdpa": 0}, live={"te": 1, "sdpa": 2},
                          footprint={"te": 3, "sdpa": 2}, budgeted=False, forked={"te", "sdpa"})
    assert unbudgeted.drained("sdpa", "s") == (["s"], "te")  # no budget: only the worker that moves is closed


class _ForkedWorker(_RecordingWorker):
    """A recording worker that says it was forked, its family's answers taking `delay[family]` seconds each."""

    delay: dict = {}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.hello = {"forked": {"server_pid": 1}}

    def request(self, job, on_progress=None):
        time.sleep(type(self).delay.get(self.family, 0.0))
        return super().request(job, on_progress)


@pytest.mark.parametrize("forked", [True, False])
def test_a_drained_familys_workers_go_on_as_workers_of_the_family_with_work_left(recorded, monkeypatch, forked):
    from attn_doctor.execution import handover

    monkeypatch.setattr(handover, "WORTH_S", 0.0)
    monkeypatch.setattr(recorded, "Worker", _ForkedWorker if forked else _RecordingWorker)
    _ForkedWorker.delay = {"sdpa": 0.02}
    groups = [point.coords(select(["sdpa.math", "local"])) for point in
              plan_points([make_case(seq=64, seed=seed) for seed in range(40)], [])]
    with recorded.Session("cuda", budget=_gpu(70), workers_per_family=None) as session:
        judged = session.run_groups(groups)
        moves, pools = list(session.moves), {key: len(pool) for key, pool in session.workers.items()}
        planned = dict(session.plan.workers)
    assert all(len(rows) == len(group) for rows, group in zip(judged, groups))
    jobs = [job["coords"]["backend"]["name"] for job in _RecordingWorker.jobs]
    assert sorted(jobs) == sorted(c.backend.name for group in groups for c in group)  # each probe once
    if forked:  # local (no delay) ran dry first: its workers went on as SDPA's, closed first
        assert moves and set(moves) == {("local", "sdpa")}
        assert pools["sdpa"] == planned["sdpa"] + len(moves)
        assert _RecordingWorker.closed[:len(moves)] == ["local"] * len(moves)  # before the session closed all
    else:
        assert (moves, pools) == ([], planned)


def test_closing_a_session_asks_every_worker_to_quit_before_it_waits_for_any(recorded):
    """Each worker's end is its CUDA context's teardown: waited for one after another, sixteen TE workers took
    seconds at the end of every sweep on the H100 (lease6); asked all first, their ends overlap."""
    events: list[str] = []

    class _Ordered(_RecordingWorker):
        def ask_to_quit(self):
            events.append("ask")

        def close(self, graceful=True):
            events.append("close")

    session = recorded.Session("cpu", workers_per_family=3)
    session.workers = {"sdpa": [_Ordered("sdpa", "cpu", 1.0) for _ in range(3)], "local": [_Ordered("local", "cpu", 1.0)]}
    session.close()
    assert events == ["ask"] * 4 + ["close"] * 4
    events.clear()
    session.close(graceful=False)  # Ctrl-C: killed at once, nobody asked
    assert events == ["close"] * 4
