"""The command line's contract, for every input a user can type.

0 every tested path passes, 1 some path FAILs or ERRORs, 2 bad input or a request that cannot run here
(one line on stderr, no traceback, nothing written), 130 on Ctrl-C (at once, keeping what finished). Output
fits 80 columns and pipes; result files follow the umask; `--help` and argument errors need no torch.
"""

from __future__ import annotations

import io
import json
import os
import signal
import stat
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from rich.console import Console

from cli_checks import one_line_error

REPO = Path(__file__).resolve().parent.parent
KERNELS = Path(__file__).resolve().parent / "kernels"
FAULTY = KERNELS / "faulty.py"
BROKEN = KERNELS / "broken.py"
DATA = Path(__file__).resolve().parent / "data" / "results-fixed.json"
TINY = ["--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu"]


def _recipe(tmp_path: Path, text: str) -> str:
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return str(path)


# Every one of these is refused before any work: (arguments, a piece of the one line on stderr).
BAD = {
    "run-timeout-negative": (["run", *TINY, "--timeout", "-1"], "--timeout"),
    "run-timeout-zero": (["run", *TINY, "--timeout", "0"], "--timeout"),
    "run-device-unknown": (["run", "--device", "tpu"], "--device 'tpu'"),
    "run-device-cuda-on-cpu": (["run", "--batch", "1", "--device", "cuda:0"], "no CUDA GPU"),
    "bisect-tp-zero": (["bisect", *TINY, "--backend", "local", "--tp", "0"], "--tp"),
    "bisect-layers-negative": (["bisect", *TINY, "--backend", "local", "--layers", "-1"], "--layers"),
    "bisect-from-with-case-flags": (["bisect", "--from", str(DATA), "--seq", "8", "--device", "cpu"],
                                    "--from starts from a row"),
    "run-json-under-a-file": (["run", *TINY, "--json", str(DATA / "out.json")], "cannot write --json"),
    "run-json-unwritable": (["run", *TINY, "--json", "/proc/attn-doctor/out.json"], "cannot write --json"),
    "sweep-out-unwritable": (["sweep", *TINY, "--out", "/proc/attn-doctor-sweep"], "cannot write --out"),
    "bisect-json-unwritable": (["bisect", *TINY, "--backend", "local", "--json", "/proc/x/b.json"],
                               "cannot write --json"),
    "report-output-unwritable": (["report", str(DATA), "--output", "/proc/attn-doctor.md"], "cannot write --output"),
    "run-only-skipped-backends": (["run", *TINY, "--backend", "te"], "nothing was tested"),
    "sweep-tp-that-cannot-split": (["sweep", *TINY, "--tp", "3", "--backend", "sdpa.math"], "TP=3"),
    "run-window-kernel-only": (["run", *TINY, "--mask", "none", "--window", "2,2", "--kernel", f"{FAULTY}:correct_fp32"],
                               "nothing was tested"),
    "kernel-named-like-the-baseline": (["run", *TINY, "--kernel", f"local={FAULTY}:correct_fp32"], "is taken"),
    "run-nproc-contradicts-tp": (["run", *TINY, "--nproc", "3", "--tp", "2"], "must equal"),
    "run-nproc-without-tp-cp": (["run", *TINY, "--nproc", "2"], "must equal"),
    "run-cp-without-nproc": (["run", *TINY, "--cp", "2"], "add --nproc 2"),
    "run-tp-with-layout": (["run", *TINY, "--tp", "2", "--layout", "transposed"], "--layout does not apply"),
    "run-nproc-with-layout": (["run", *TINY, "--nproc", "2", "--tp", "2", "--layout", "transposed"],
                              "--layout does not apply"),
    "sweep-layers-with-layout": (["sweep", *TINY, "--layers", "2", "--layout", "transposed"], "--layout does not apply"),
    "run-too-large": (["run", "--seq", "10000000", "--device", "cpu"], "needs about"),
    "recipe-without-case": (["run", "--recipe", "{recipe}:description = 'x'\n[grid]\nseq = [16]\n", "--device", "cpu"],
                            "has no [case] table"),
    "recipe-unknown-table": (["run", "--recipe", "{recipe}:[case]\nbatch = 1\n[cases]\nseq = 2\n", "--device", "cpu"],
                             "unknown table or key cases"),
    "recipe-unknown-grid-key": (["sweep", "--recipe", "{recipe}:[case]\nbatch = 1\n[grid]\ncolour = [1]\n",
                                 "--device", "cpu"], "unknown grid key(s) colour"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_exits_2_with_one_line_and_nothing_written(name, tmp_path, monkeypatch, run_cli):
    args, message = BAD[name]
    args = [_recipe(tmp_path, a.split(":", 1)[1]) if a.startswith("{recipe}:") else a for a in args]
    monkeypatch.chdir(tmp_path)
    started = time.perf_counter()
    line = one_line_error(run_cli(args))
    assert message in line, line
    assert not (tmp_path / "attn-doctor-results").exists()
    assert time.perf_counter() - started < 30  # refused, not run


def test_memory_refusal_gives_the_estimate_and_what_fits(tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(run_cli(["run", "--seq", "10000000", "--device", "cpu"]))
    assert "PiB" in line and "local's probe" in line and "free in RAM at the start" in line
    fits = int(line.rsplit("the longest --seq that fits is about ", 1)[1].split()[0])
    assert 0 < fits < 10_000_000
    from attn_doctor.backends import select
    from attn_doctor.core.case import make_case
    from attn_doctor.execution.budget import MemoryAsk
    from attn_doctor.execution.memory_plan import plan_memory
    from attn_doctor.probes.plan import plan_calls
    from attn_doctor.workflows.run import runnable

    specs = select([])
    coords = runnable(plan_calls(make_case(seq=fits), specs, ["contiguous"]), specs, "cpu")
    plan_memory(coords, "cpu", MemoryAsk().budget("cpu"))  # what it says fits, fits the same plan


@pytest.mark.slow
def test_run_tp_without_nproc_runs_the_tp_shard_probe(tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["run", *TINY, "--tp", "2", "--backend", "sdpa.math", "--json", "r.json"])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    tp_rows = [r for r in rows if r["coords"].get("probe") == "tp"]
    assert {(r["coords"]["tp"], r["coords"]["shards_as"]) for r in tp_rows} == {(2, "views"), (2, "copies")}
    assert all(r["verdict"] == "PASS" for r in rows)


def test_a_write_that_fails_at_the_end_keeps_the_results(tmp_path, monkeypatch, run_cli):
    from attn_doctor.results import files

    real = files.write_atomic

    def failing(path, text):
        if Path(path).name == "r.json":
            raise OSError(28, "No space left on device")
        real(path, text)

    monkeypatch.setattr(files, "write_atomic", failing)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    result = run_cli(["run", *TINY, "--backend", "local", "--layout", "contiguous", "--json", "r.json"])
    line = one_line_error(result)
    assert "No space left on device" in line and "kept in" in line
    kept = Path(line.rsplit("kept in ", 1)[1].split()[0])
    assert json.loads(kept.read_text())["results"][0]["verdict"] == "PASS"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_result_files_follow_the_umask(tmp_path, umask, mode):
    from attn_doctor.results.files import write_atomic

    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "results.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "results.json").stat().st_mode) == mode


# --- 80 columns, pipes ------------------------------------------------------------------------------------

def _render(renderables, width: int = 80) -> str:
    console = Console(file=io.StringIO(), width=width, highlight=False, markup=False, force_terminal=False)
    for renderable in renderables:
        console.print(renderable)
    return console.file.getvalue()


def test_run_output_fits_80_columns_with_every_number_and_verdict():
    from attn_doctor.render.format import ratio, sci
    from attn_doctor.render.terminal import run_view
    from attn_doctor.results.report import read_report

    report = read_report(DATA)  # failing, NaN, ERROR and SKIP rows, a hostile backend name
    text = _render(run_view(report, title="b1 s32 h2 d8 bf16 causal on cuda:0"))
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert "…" not in text
    flat = " ".join(text.split())
    for row in report.rows:
        if row.coords.kind.value == "depth":
            continue
        for t in row.tensors.values():
            assert sci(t.rel_err) in text and ratio(t.ratio) in text
        assert row.verdict in text
        if row.ran and row.tensors:
            assert " ".join(row.ran.split()) in flat  # what ran, in the lines under the table
    assert report.summary.split(":")[0] in flat


def test_sweep_and_bisect_output_fit_80_columns():
    from attn_doctor.bisect.engine import Bisector, Outcome
    from attn_doctor.bisect.knobs import coords_at
    from attn_doctor.core.case import make_case
    from attn_doctor.render.format import ratio, sci
    from attn_doctor.render.terminal import bisect_tables, sweep_view
    from attn_doctor.results.report import read_report

    report = read_report(DATA)
    text = _render(sweep_view(report))
    assert max(len(line) for line in text.splitlines()) <= 80
    for line in report.depth_lines:
        assert sci(line.dq_first) in text and ratio(line.ratio) in text
    start = coords_at(make_case(batch=4, seq=1024, heads=8, kv_heads=2, head_dim=64), "head_slice", tp=2)
    result = Bisector(lambda c: Outcome("FAIL" if c.case.seq > 100 else "PASS", "dq: error 0.05")).run(start)
    text = _render(bisect_tables(result, "a_rather_long_kernel_name", {"first_wrong": "backward"}))
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "fails at seq 101, passes at 100" in text


@pytest.mark.slow
def test_cli_at_80_columns_in_a_pipe_keeps_every_verdict(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from attn_doctor.cli import cli

    monkeypatch.chdir(tmp_path)
    runner = CliRunner(env={"COLUMNS": "80", "NO_COLOR": "1"})
    result = runner.invoke(cli, ["run", *TINY, "--backend", "sdpa", "--backend", "local", "--layout", "contiguous",
                                 "--kernel", f"{FAULTY}:dq_two_percent", "--json", "r.json"], catch_exceptions=False)
    assert result.exit_code == 1
    assert max(len(line) for line in result.stdout.splitlines()) <= 80
    rows = json.loads((tmp_path / "r.json").read_text())["results"]
    table = {}
    for line in result.stdout.splitlines():
        words = line.split()
        if len(words) >= 3 and words[0] in {r["backend"] for r in rows}:
            table[(words[0], words[1])] = words[-1]
    for row in rows:
        assert table.get((row["backend"], row["layout"]), table.get((row["backend"], "all"))) == row["verdict"]
    assert result.stderr == ""  # no progress bar outside a terminal


# --- progress -------------------------------------------------------------------------------------------------

def test_terminal_progress_shows_counts_eta_and_layers():
    from attn_doctor.render.progress import TerminalProgress

    out = io.StringIO()
    console = Console(file=out, width=100, force_terminal=True, color_system=None)
    progress = TerminalProgress(console)
    progress.begin(4, "probes")
    progress.advance(1, "local contiguous")
    progress.note("local: backward layer 3/24")
    progress._progress.refresh()
    shown = out.getvalue()
    assert "1/4" in shown and "ETA" in shown and "backward layer 3/24" in shown
    progress.end()


@pytest.mark.slow
def test_depth_probes_report_every_layer():
    from attn_doctor.backends import BackendSpec
    from attn_doctor.core.case import make_case
    from attn_doctor.execution.progress import ProgressSink
    from attn_doctor.execution.session import Session
    from attn_doctor.probes.plan import plan_depth

    class Notes(ProgressSink):
        def __init__(self):
            self.notes = []

        def note(self, text):
            self.notes.append(text)

    notes = Notes()
    case = make_case(batch=1, seq=8, heads=2, head_dim=8, seed=1)
    with Session("cpu", timeout_s=120, progress=notes) as session:
        rows = session.run(plan_depth(case, [BackendSpec("sdpa.math", "sdpa", {"kernel": "math"})], [2], [1]))
    assert all(row.verdict == "PASS" for row in rows)
    for text in ("float64 replica: forward layer 1/2", "float64 replica: backward layer 2/2",
                 "baseline: backward layer 1/2", "sdpa.math: sdpa.math: forward layer 2/2"):
        assert any(text in note for note in notes.notes), (text, notes.notes)


# --- Ctrl-C ---------------------------------------------------------------------------------------------------

def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _interrupt(tmp_path: Path, args: list[str], busy, settle: float = 1.0, signum: int = signal.SIGINT
               ) -> tuple[subprocess.CompletedProcess, float, list[int]]:
    """Start `attn-doctor ARGS`, wait until `busy(child pids)` and `settle` seconds more, send `signum` (SIGINT:
    Ctrl-C); (result, seconds to exit, the children it had)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "80", "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "attn_doctor", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        children: list[int] = []
        while time.monotonic() < deadline and proc.poll() is None:
            children = _children(proc.pid)
            if busy(children):
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        time.sleep(settle)
        started = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=30)  # both pipes closed: nothing left holding them
        elapsed = time.monotonic() - started
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.decode(), err.decode()), elapsed, children


def _workers(children: list[int]) -> list[int]:
    return [pid for pid in children if _family(pid)]


def _family(pid: int) -> bytes:
    """The family of a worker process (launched: its command line's; forked: the name it took, `worker FAMILY`)."""
    words = _cmdline(pid).split(b"\0")
    if b"attn_doctor.execution.worker" in words:
        return words[words.index(b"attn_doctor.execution.worker") + 1]
    try:
        name = Path(f"/proc/{pid}/comm").read_bytes().strip()
    except OSError:
        return b""
    return name.split(b" ", 1)[1] if name.startswith(b"worker ") else b""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _gone(pids: list[int]) -> bool:
    return not any(Path(f"/proc/{pid}").exists() and b"zombie" not in Path(f"/proc/{pid}/status").read_bytes().lower()
                   for pid in pids)


@pytest.mark.slow
@pytest.mark.parametrize("signum, code, said", [(signal.SIGINT, 130, "interrupted"),
                                                (signal.SIGTERM, 143, "terminated (SIGTERM)")], ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_during_run_answers_at_once_and_keeps_the_finished_probes(tmp_path, signum, code, said):
    # Both workers up, and seconds for the baseline's tiny probe to finish while the kernel hangs.
    result, elapsed, children = _interrupt(
        tmp_path, ["run", *TINY, "--layout", "contiguous", "--kernel", f"{BROKEN}:hangs", "--json", "r.json"],
        lambda pids: {b"kernel", b"local"} <= {_family(p) for p in pids}, settle=5.0, signum=signum)
    assert result.returncode == code, result.stderr
    assert elapsed < 2.0
    assert "Traceback" not in result.stderr and f"attn-doctor: {said}" in result.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["interrupted"] is True and doc["summary"].startswith("Interrupted (Ctrl-C or SIGTERM)")
    assert [r["backend"] for r in doc["results"]] == ["local"]  # the baseline finished; the hung kernel did not
    deadline = time.monotonic() + 2.0  # every process it started, torch's shared-memory manager too
    while not _gone(children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(children), [_cmdline(pid) for pid in children if Path(f"/proc/{pid}").exists()]


def test_ctrl_c_during_a_depth_sweep_answers_at_once(tmp_path):
    result, elapsed, children = _interrupt(
        tmp_path, ["sweep", "--batch", "1", "--heads", "4", "--head-dim", "16", "--seq", "64", "--device", "cpu",
                   "--layers", "64,128", "--backend", "sdpa.math", "--out", "sw"], lambda pids: bool(_workers(pids)))
    assert result.returncode == 130 and elapsed < 2.0, (result.returncode, elapsed, result.stderr)
    assert "--resume" in result.stderr and not (tmp_path / "sw" / "results.json").exists()
    assert _gone(_workers(children))


def test_ctrl_c_during_bisect_answers_at_once(tmp_path):
    result, elapsed, children = _interrupt(
        tmp_path, ["bisect", *TINY, "--kernel", f"{BROKEN}:hangs", "--timeout", "100", "--out", "b"],
        lambda pids: any(_family(p) == b"kernel" for p in pids))
    assert result.returncode == 130 and elapsed < 2.0, (result.returncode, elapsed, result.stderr)
    assert _gone(_workers(children))


# --- start-up ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["--help"], ["--version"], ["run", "--help"], ["sweep", "--seq", "x"],
                                  ["run", "--bogus"], ["run", "--heads", "5", "--kv-heads", "2"]],
                         ids=["help", "version", "run-help", "bad-list", "unknown-option", "bad-case"])
def test_help_version_and_argument_errors_do_not_load_torch(args):
    code = ("import sys\nfrom attn_doctor.cli import cli\n"
            f"sys.argv = ['attn-doctor', *{args!r}]\n"
            "try:\n    cli.main()\nexcept SystemExit as exc:\n    code = exc.code\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code, file=sys.stderr)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    marker, code = proc.stderr.strip().splitlines()[-1].split()
    assert marker == "NO-TORCH", proc.stderr
    assert code in ("0", "2")


# --- an installed wheel ships what the README promises ----------------------------------------------------------

@pytest.mark.slow
def test_the_wheel_ships_the_recipes_and_the_known_defects(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("attn_doctor-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"attn_doctor/recipes/megatron-gpt-1615.toml", "attn_doctor/recipes/gqa-llama.toml",
            "attn_doctor/data/known_bugs.toml"} <= names
    assert not any(name.startswith(("tests/", "reports/", "benchmarks/")) for name in names)


def test_what_ran_on_the_h200_is_not_refused_there():
    """The plan never refuses what the H200 (139 GiB free) ran: the default run on every layout, the GQA recipe,
    and the depth sweeps of TE#1615 (24 and 128 layers, TP 1 and 2; run one family at a time)."""
    from attn_doctor.backends import select
    from attn_doctor.core.case import make_case
    from attn_doctor.core.layouts import LAYOUTS
    from attn_doctor.execution.budget import MemoryBudget
    from attn_doctor.execution.memory_plan import plan_memory
    from attn_doctor.probes.plan import plan_calls, plan_depth, plan_tp

    h200 = MemoryBudget(139 << 30, "cuda:0", "139 GiB free", 141 << 30)
    specs = select([])
    default = make_case()
    plan_memory(plan_calls(default, specs, list(LAYOUTS)), "cuda", h200)
    plan_memory(plan_calls(make_case(batch=2, seq=2048, heads=32, kv_heads=8, head_dim=128), specs, list(LAYOUTS)),
                "cuda", h200)
    plan_memory(plan_tp(default, specs, [1, 2]), "cuda", h200, workers_per_family=2)
    for layers in (24, 128):
        plan_memory(plan_depth(default, specs, [layers], [1, 2]), "cuda", h200)


@pytest.mark.slow
def test_wide_puts_what_ran_in_a_column(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from attn_doctor.cli import cli

    monkeypatch.chdir(tmp_path)
    runner = CliRunner(env={"COLUMNS": "180", "NO_COLOR": "1"})
    result = runner.invoke(cli, ["run", *TINY, "--backend", "sdpa.math", "--backend", "local", "--layout",
                                 "contiguous", "--wide", "--json", "r.json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    header = next(line for line in result.stdout.splitlines() if "backend" in line and "verdict" in line)
    assert "ran" in header.split()
    row = next(line for line in result.stdout.splitlines() if line.split()[:1] == ["sdpa.math"])
    assert "SDPA math: composite matmul + softmax" in row and row.split()[-1] == "PASS"
    assert not any(line.startswith("ran ") for line in result.stdout.splitlines())  # not repeated below


@pytest.mark.slow
@pytest.mark.parametrize("kernel, code", [("correct_fp32", 0), ("dq_two_percent", 1)])
def test_a_reader_that_goes_away_loses_no_results_and_no_verdict(kernel, code, tmp_path):
    """`attn-doctor run | head -1`: the command prints nothing more once its reader is gone, but saves its results
    and exits with its verdict's code (rich's default was to exit 1 at once, before the results were saved)."""
    results = tmp_path / "results.json"
    proc = subprocess.Popen([sys.executable, "-m", "attn_doctor", "run", *TINY, "--backend", "local", "--layout",
                             "contiguous", "--kernel", f"k={FAULTY}:{kernel}", "--json", str(results)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()  # what `head -1` reads, then it is gone
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err.decode()
    assert "Traceback" not in err.decode()
    assert json.loads(results.read_text())["format"] == "attn-doctor/results"


def _run_session_in_thread(groups, **run_groups_options):
    """run_groups in a thread, with a bound: a session that stalls fails the test instead of hanging it."""
    import threading

    from attn_doctor.execution.session import Session

    result: dict = {}

    def go() -> None:
        with Session("cpu", workers_per_family=1) as session:
            try:
                result["rows"] = session.run_groups(groups, **run_groups_options)
            except Exception as exc:  # noqa: BLE001 - what the test looks at
                result["raised"] = exc

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the session stalled"
    return result


def _small_groups():
    from attn_doctor.backends import select
    from attn_doctor.core.case import make_case
    from attn_doctor.core.coords import Coords

    specs = select(["local", "sdpa.math"])
    return [[Coords.call(make_case(batch=1, seq=32, heads=2, head_dim=16, seed=seed), spec, "contiguous")
             for spec in specs] for seed in range(1, 7)]


@pytest.mark.slow
def test_an_error_of_attn_doctor_judging_one_point_is_its_rows_internal_error_and_the_rest_goes_on(monkeypatch):
    """One worker per family: a family whose only thread died would leave its references kept, and every other
    family waiting for room to keep more (the te-tests sweep on the H100 stalled so, issue 51)."""
    import attn_doctor.execution.session as session_module

    real = session_module.judge

    def judge_failing_on_seed_2(rows):
        if rows and rows[0].case.seed == 2:
            raise ZeroDivisionError("a bug in judging")
        return real(rows)

    monkeypatch.setattr(session_module, "judge", judge_failing_on_seed_2)
    result = _run_session_in_thread(_small_groups())
    verdicts = [[row.verdict for row in group] for group in result["rows"]]
    assert verdicts[1] == ["ERROR", "ERROR"] and all(v == ["PASS", "PASS"] for i, v in enumerate(verdicts) if i != 1)
    row = result["rows"][1][0]
    assert row.internal and row.reason.startswith("attn-doctor internal error (not the kernel's): ZeroDivisionError")
    assert "judge_failing_on_seed_2" in row.detail  # the traceback, for the report to attn-doctor


@pytest.mark.slow
def test_a_failure_handling_a_finished_point_stops_the_session_and_is_raised_not_a_stall():
    def writing_fails(index, rows):
        if index == 2:
            raise OSError("No space left on device")

    result = _run_session_in_thread(_small_groups(), on_group=writing_fails)
    assert isinstance(result.get("raised"), OSError)
