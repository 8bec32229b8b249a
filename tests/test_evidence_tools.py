"""The tools that made committed evidence (benchmarks/evidence/) still run with this code, on the CPU."""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "benchmarks" / "evidence"
EVIDENCE = ROOT / "reports" / "h200"  # committed GPU evidence: read, never written
BROKEN = ROOT / "tests" / "kernels" / "broken.py"
TINY = ["--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu"]


def _tool(name: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "NO_COLOR": "1"}
    return subprocess.run([sys.executable, str(TOOLS / name), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_pick_bisects_picks_on_the_committed_coverage_sweep_what_was_bisected(tmp_path):
    """The H200's TE-coverage sweep (reports/h200/api/coverage), unpacked: the same four faults picked."""
    sweep = tmp_path / "coverage"
    sweep.mkdir()
    shutil.copy(EVIDENCE / "api" / "coverage" / "sweep.json", sweep)
    with gzip.open(EVIDENCE / "api" / "coverage" / "results.jsonl.gz") as packed:
        (sweep / "results.jsonl").write_bytes(packed.read())
    proc = _tool("pick_bisects.py", sweep, "--limit", "4", "--out", tmp_path / "api", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 4
    assert all(line.startswith(f"bisect --from {sweep} --row ") for line in lines)
    picked = [line for line in proc.stderr.splitlines() if line.startswith("# ")]
    committed = (EVIDENCE / "api" / "bisect-picks.txt").read_text().splitlines()
    assert picked == [line for line in committed if line.startswith("# ")]


@pytest.mark.slow
def test_interrupt_sends_sigint_and_reports_the_exit(tmp_path):
    """A run whose kernel hangs, interrupted after 4 s: the CLI exits 130, and the tool says so in its log."""
    log = tmp_path / "interrupt.log"
    proc = _tool("interrupt.py", 4, log, "--", "run", *TINY, "--layout", "contiguous",
                 "--kernel", f"{BROKEN}:hangs", "--json", tmp_path / "r.json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("SIGINT after 4 s: exit code 130, process gone after ")
    assert log.read_text().endswith(proc.stdout)


@pytest.mark.slow
def test_shared_direction_reads_a_capture_and_gives_one_line_per_call(tmp_path):
    """shared_direction.py on a capture with values of the tiny GPT (two layers): a line per call, with the
    keys' and values' shared-direction figures."""
    capture = tmp_path / "cap"
    made = subprocess.run([sys.executable, "-m", "attn_doctor", "capture", "--out", str(capture), "--values", "--",
                           sys.executable, str(ROOT / "tests" / "models" / "tiny_gpt.py"), "--steps", "1",
                           "--layers", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert made.returncode == 0, made.stderr[-2000:]
    proc = _tool("shared_direction.py", capture, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("capture | rank | layer") and len(lines) == 3
    for line, layer in zip(lines[1:], ("0", "1")):
        cells = line.split(" | ")
        assert cells[2] == layer and all(float(x) >= 0 for cell in cells[4].split("; ") for x in cell.split(", "))
