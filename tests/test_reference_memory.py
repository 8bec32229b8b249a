"""The float64 reference never materialises seq x seq: checked in a subprocess against a memory bound
that the naive formula's scores alone would exceed."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attn_doctor.numerics.reference import attention_reference, naive_reference

ROOT = Path(__file__).resolve().parent.parent
SEQ, HEADS, HEAD_DIM = 8192, 2, 16
BOUND_MIB = 400  # the naive scores alone: SEQ * SEQ * HEADS * 8 bytes = 1024 MiB (autograd keeps several)

PROBE = textwrap.dedent(f"""
    import json, resource, torch
    from attn_doctor.numerics.reference import attention_reference
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, {SEQ}, {HEADS}, {HEAD_DIM}) for _ in range(4))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ref = attention_reference(q, k, v, dout, causal=True, softmax_scale={HEAD_DIM} ** -0.5)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({{"growth_mib": (after - before) / 1024, "finite": bool(torch.isfinite(ref.dq).all()),
                       "dq_norm": float(ref.dq.norm())}}))
""")


@pytest.mark.slow
def test_long_sequence_stays_under_a_bound_the_naive_scores_exceed():
    naive_scores_mib = SEQ * SEQ * HEADS * 8 / 2**20
    assert naive_scores_mib > 2 * BOUND_MIB
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["finite"] and result["dq_norm"] > 0
    assert result["growth_mib"] < BOUND_MIB, result


def test_agrees_with_the_naive_formula_at_small_seq():
    torch.manual_seed(1)
    q = torch.randn(2, 96, 4, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 80, 2, 16, dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn(2, 96, 4, 16, dtype=torch.bfloat16)
    for causal, window in ((True, None), (False, None), (False, (7, 5))):
        blocks = attention_reference(q, k, v, dout, causal=causal, softmax_scale=0.25, window=window,
                                     block_bytes=4096)
        naive = naive_reference(q, k, v, dout, causal=causal, softmax_scale=0.25, window=window)
        for name in ("out", "dq", "dk", "dv"):
            a, b = getattr(blocks, name), getattr(naive, name)
            assert float((a - b).norm() / b.norm()) < 1e-12, (name, causal, window)
