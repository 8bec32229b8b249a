"""Sharing references through CUDA IPC gives every byte back (needs a GPU; skipped without one).

A CUDA handle that torch pickles carries one reference count, which the process that opens it gives back
when it frees what it opened. A handle opened by two workers, or by none, leaves the parent's block in
torch's limbo for good: the memory is never freed and the parent warns "Producer process has been
terminated before all shared CUDA tensors released" as it exits.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_doctor.backends import select
from attn_doctor.core.case import make_case
from attn_doctor.execution.session import Session
from attn_doctor.probes.plan import plan_calls, plan_depth

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a CUDA GPU")]

REPO = Path(__file__).resolve().parent.parent
LEAK_WARNING = "Producer process has been terminated before all shared CUDA tensors released"


def test_parent_frees_every_shared_reference():
    # 512 MiB of float64 reference per case, so a leak of even one case stands out from what the parent
    # keeps for itself (cuBLAS keeps a 32 MiB workspace per thread that ran a matmul: 4 serving threads here).
    cases = [make_case(batch=4, seq=2048, heads=16, head_dim=128, dtype="bf16", mask="causal", seed=seed)
             for seed in range(3)]
    reference_bytes = 4 * 4 * 2048 * 16 * 128 * 8
    specs = select(["sdpa", "local"])
    groups = [plan_calls(case, specs, ["contiguous", "transposed"]) for case in cases]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with Session("cuda", timeout_s=300, workers_per_family=2) as session:
        rows = [row for group in session.run_groups(groups) for row in group]
        depth_rows = session.run(plan_depth(cases[0], specs, [2], [1]))
    torch.cuda.ipc_collect()
    assert session.references.computed == len(cases) + 1
    ran = [row for row in rows + depth_rows if row.verdict != "SKIP"]
    assert ran and {row.extra["reference"] for row in ran} == {"shared"}
    assert all(row.verdict == "PASS" for row in ran), [(r.backend, r.layout, r.verdict, r.reason) for r in ran]
    left = torch.cuda.memory_allocated() - before
    assert left < reference_bytes / 2, f"{left / 2**20:.0f} MiB still allocated in the parent"


def test_run_exits_without_the_leak_warning(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "attn_doctor", "run", "--backend", "sdpa", "--backend", "local", "--seq", "512",
         "--json", str(tmp_path / "run.json")],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert LEAK_WARNING not in proc.stdout + proc.stderr
