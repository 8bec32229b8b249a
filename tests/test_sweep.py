"""`attn-doctor sweep`: the depth stack's float64 replica, depth and TP probes, resume, grids and the plot.

Every sweep here is tiny (batch 1, hidden <= 64, seq <= 48, CPU) and writes into a temporary directory
given with --out. Sweeps run in-process through click's CliRunner (their worker processes are real),
except the resume test, which kills a real `python -m attn_doctor sweep` process with a signal.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from attn_doctor.cli.options import build_grid
from attn_doctor.core.case import expand_grid, make_case
from attn_doctor.probes import stack as stacking
from attn_doctor.probes.plan import plan_points
from attn_doctor.results.log import RESULTS_FILE, ResultsLog
from attn_doctor.results.report import read_report
from attn_doctor.verdict.depth import depth_findings, depth_lines
from attn_doctor.workflows.sweep import PLOT_FILE
from cli_checks import one_line_error

REPO = Path(__file__).resolve().parent.parent
KERNELS = Path(__file__).resolve().parent / "kernels"
FAULTY = KERNELS / "faulty.py"
DEPTH_FAULTS = KERNELS / "depth_faults.py"
CORRECT = f"{FAULTY}:correct_fp32"
IGNORES_STRIDES = f"{FAULTY}:ignores_strides"
COMPOUNDING = f"{DEPTH_FAULTS}:compounding_backward"
SLOW = f"{DEPTH_FAULTS}:slow_correct"

# hidden 64, seq 32: a 16-layer stack runs in well under a second per backend.
DEPTH_FLAGS = ["--batch", "1", "--seq", "32", "--heads", "4", "--head-dim", "16", "--device", "cpu"]
# Measured on these flags (dQ error at layer 1 / the baseline's): compounding_backward is 1.08x at 1 layer,
# 1.86x at 4, 5.86x at 16 and about 9x at 24; the FAIL line is 3x. So 4 passes and 16 fails with margin.
COMPOUNDING_DEPTHS = [1, 4, 16, 24]
COMPOUNDING_FIRST_FAIL = 16
CORRECT_DEPTHS = [1, 4, 16]
TINY_FLAGS = ["--batch", "1", "--heads", "2", "--head-dim", "8", "--device", "cpu"]


def _norm(text: str) -> str:
    return " ".join(text.split())




def _sweep(run_cli, workdir: Path, args) -> tuple[object, dict]:
    """`attn-doctor sweep ARGS --out workdir/sweep` from inside workdir: the result and results.json."""
    out = workdir / "sweep"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        result = run_cli(["sweep", *args, "--out", out])
    path = out / "results.json"
    assert path.exists(), result.output
    return result, json.loads(path.read_text())


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _coords(row: dict) -> str:
    return json.dumps(row.get("coords", {}), sort_keys=True)


# --- 1. the depth stack's float64 replica against a straightforward float64 autograd -----------------------

def _megatron_split(mixed: torch.Tensor, heads: int, kv_heads: int, d: int):
    """q, k, v from linear_qkv's output [s, b, (heads + 2 kv_heads) d] by explicit column indices:
    kv group j holds q heads j*g .. j*g+g-1, then k_j, then v_j (Megatron's ordering)."""
    g = heads // kv_heads
    width = (g + 2) * d
    q_cols = [j * width + m * d + e for j in range(kv_heads) for m in range(g) for e in range(d)]
    k_cols = [j * width + g * d + e for j in range(kv_heads) for e in range(d)]
    v_cols = [j * width + (g + 1) * d + e for j in range(kv_heads) for e in range(d)]
    s, b = mixed.shape[:2]

    def take(cols, n):
        return mixed[..., torch.tensor(cols)].reshape(s, b, n, d)

    return take(q_cols, heads), take(k_cols, kv_heads), take(v_cols, kv_heads)


def _naive_attention(q, k, v, case) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v on sbhd tensors, every score materialised, masks spelled out."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * case.softmax_scale
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(k.shape[0])[None, :]
    visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    if case.causal:
        visible &= j <= i
    if case.window is not None:
        left, right = case.window
        if left >= 0:
            visible &= j >= i - left
        if right >= 0:
            visible &= j <= i + right
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("bhst,tbhd->sbhd", probs, v)


def _naive_stack_dqs(inputs: stacking.StackInputs, case, split=_megatron_split) -> list[torch.Tensor]:
    hidden = case.heads * case.head_dim
    h = inputs.x.detach().clone().requires_grad_()
    qs = []
    for w in inputs.layers:
        normed = F.layer_norm(h, (hidden,), w.ln_weight, w.ln_bias, eps=1e-5)
        mixed = F.linear(normed, w.qkv_weight, w.qkv_bias)
        q, k, v = split(mixed, case.heads, case.kv_heads, case.head_dim)
        q.retain_grad()
        qs.append(q)
        context = _naive_attention(q, k, v, case)
        h = h + F.linear(context.reshape(*context.shape[:2], hidden), w.proj_weight, w.proj_bias)
    y = F.layer_norm(h, (hidden,), *inputs.final_ln, eps=1e-5)
    y.backward(inputs.dy)
    return [q.grad for q in qs]


def _load_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"sweep_test_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _replica_dqs(case, layers: int, tp: int = 1):
    inputs = stacking.make_stack(case, layers, torch.device("cpu"), torch.bfloat16).to(torch.float64)
    return inputs, stacking.stack_dqs(inputs, case, stacking.float64_attention(case), tp=tp)


STACK_CASES = {
    "mha-causal": dict(heads=4, head_dim=16),
    "gqa-causal": dict(heads=4, kv_heads=2, head_dim=16),
    "mqa-none": dict(heads=4, kv_heads=1, head_dim=16, mask="none"),
    "gqa-window-causal": dict(heads=4, kv_heads=2, head_dim=16, window=(4, 0)),
    "window-both-sides": dict(heads=2, head_dim=32, mask="none", window=(3, 2)),
}


@pytest.mark.parametrize("fields", list(STACK_CASES.values()), ids=list(STACK_CASES))
def test_float64_replica_matches_naive_autograd(fields):
    case = make_case(batch=1, seq=32, seed=3, **fields)
    inputs, replica = _replica_dqs(case, layers=3)
    naive = _naive_stack_dqs(inputs, case)
    assert len(replica) == len(naive) == 3
    for layer, (got, want) in enumerate(zip(replica, naive), start=1):
        assert got.dtype == torch.float64
        assert got.shape == (case.seq, case.batch, case.heads, case.head_dim)
        assert float(want.norm()) > 0
        assert _rel(got, want) < 1e-10, (layer, _rel(got, want))


def test_naive_comparison_is_sensitive_to_the_split():
    """The check above can fail: the same stack with k and v swapped in the split is far off."""
    case = make_case(batch=1, seq=32, heads=4, kv_heads=2, head_dim=16, seed=3)
    inputs, replica = _replica_dqs(case, layers=2)

    def swapped(mixed, heads, kv_heads, d):
        q, k, v = _megatron_split(mixed, heads, kv_heads, d)
        return q, v, k

    naive = _naive_stack_dqs(inputs, case, split=swapped)
    assert all(_rel(got, want) > 1e-3 for got, want in zip(replica, naive))


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 2), (4, 4, 2), (4, 4, 4), (4, 1, 1)])
def test_float64_replica_tp_inside_the_stack_equals_tp1(heads, kv_heads, tp):
    case = make_case(batch=1, seq=24, heads=heads, kv_heads=kv_heads, head_dim=16, seed=5)
    inputs, unsharded = _replica_dqs(case, layers=3)
    _, sharded = _replica_dqs(case, layers=3, tp=tp)
    naive = _naive_stack_dqs(inputs, case)
    for got, base, want in zip(sharded, unsharded, naive):
        assert got.shape == base.shape == (case.seq, 1, heads, 16)
        assert _rel(got, base) < 1e-12
        assert _rel(got, want) < 1e-10


def _whole_graph_dqs(inputs: stacking.StackInputs, case, attention, tp: int = 1) -> list[torch.Tensor]:
    """dQ of every layer from one autograd graph over the whole stack (every layer's activations held at once):
    what the stack computed before it held one layer's graph at a time."""
    hidden = case.heads * case.head_dim
    h = inputs.x.detach().requires_grad_()
    qs = []
    for w in inputs.layers:
        h, layer_qs = stacking.block(h, w, case, attention, tp)
        qs.append(layer_qs)
    y = F.layer_norm(h, (hidden,), *inputs.final_ln, eps=1e-5)
    grads = torch.autograd.grad(y, [q for layer_qs in qs for q in layer_qs], inputs.dy)
    return [torch.cat(grads[i * tp:(i + 1) * tp], dim=2) for i in range(len(qs))]


@pytest.mark.parametrize("fields,tp", [(dict(heads=4, head_dim=16), 1), (dict(heads=4, kv_heads=2, head_dim=16), 2)],
                         ids=["mha", "gqa-tp2"])
def test_one_layer_graph_at_a_time_gives_the_whole_graphs_dq_bitwise(fields, tp):
    """Recomputing each layer from its stored input changes nothing a probe measures: the local baseline's bf16
    stack and the float64 replica give bitwise the dQ of one graph over the whole stack."""
    from attn_doctor.backends import BASELINE, build
    from attn_doctor.core.case import tp_shard

    case = make_case(batch=2, seq=32, seed=3, **fields)
    inputs = stacking.make_stack(case, 4, torch.device("cpu"), torch.bfloat16)
    local = stacking.BackendAttention(build(BASELINE), tp_shard(case, tp))
    exact = stacking.float64_attention(tp_shard(case, tp))
    for attention, stack in ((local, inputs), (exact, inputs.to(torch.float64))):
        got = stacking.stack_dqs(stack, case, attention, tp=tp)
        want = _whole_graph_dqs(stack, case, attention, tp=tp)
        assert [g.dtype for g in got] == [w.dtype for w in want] == [stack.x.dtype] * 4
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_the_stack_hands_each_dq_on_last_layer_first_and_holds_one_layer_graph():
    """`run_stack` hands dQ on as the backward reaches each layer (last first), and while it does, no other
    layer's activations are alive (a graph over the whole stack would keep every layer's q until its backward)."""
    import weakref

    case = make_case(batch=1, seq=16, heads=2, head_dim=8, seed=1)
    inputs = stacking.make_stack(case, 6, torch.device("cpu"), torch.float32)
    exact = stacking.float64_attention(case)
    queries: list[weakref.ref] = []
    order, alive = [], []

    def attention(q, k, v):
        queries.append(weakref.ref(q))
        return exact(q.double(), k.double(), v.double()).to(q.dtype)

    def on_dq(index, dq):
        order.append(index)
        alive.append(sum(ref() is not None for ref in queries))

    stacking.run_stack(inputs, case, attention, on_dq)
    assert order == [5, 4, 3, 2, 1, 0]
    assert len(queries) == 12  # each layer's forward, then again in its backward
    assert max(alive) <= 1, alive  # at most the layer being differentiated


# --- 2 and 7. a correct kernel passes at every depth; the plot --------------------------------------------

@pytest.fixture(scope="module")
def correct_depth(tmp_path_factory, run_cli):
    workdir = tmp_path_factory.mktemp("correct-depth")
    layers = ",".join(map(str, CORRECT_DEPTHS))
    result, doc = _sweep(run_cli, workdir, [*DEPTH_FLAGS, "--kernel", CORRECT, "--backend", "sdpa.math",
                                            "--layers", layers])
    return result, doc, workdir / "sweep"


@pytest.mark.slow
def test_correct_kernels_pass_at_every_depth(correct_depth):
    result, doc, _ = correct_depth
    assert result.exit_code == 0, result.output
    depth_rows = [r for r in doc["results"] if r["coords"].get("probe") == "depth"]
    assert len(depth_rows) == len(doc["results"])
    seen = {(r["backend"], r["coords"]["layers"]): r for r in depth_rows}
    for backend in ("local", "sdpa.math", "correct_fp32"):
        for layers in CORRECT_DEPTHS:
            row = seen[(backend, layers)]
            assert row["verdict"] == "PASS", (backend, layers, row["reason"])
            assert {"dq_first", "dq_last"} <= set(row["tensors"])
            assert len(row["extra"]["dq_rel_err_by_layer"]) == layers
            assert len(row["extra"]["baseline_dq_rel_err_by_layer"]) == layers
            assert 0 < row["tensors"]["dq_first"]["rel_err"] < 0.05
    assert len(depth_rows) == 3 * len(CORRECT_DEPTHS)
    assert doc["faulty"] == []
    summary = _norm(doc["summary"])
    assert "first fails at" not in summary
    assert "grows with depth like the local baseline's for every backend" in summary
    assert "first fails at" not in _norm(result.stdout)
    findings = depth_findings(depth_lines(read_report(correct_depth[2] / "results.json").rows))
    assert {f.backend for f in findings} == {"local", "sdpa.math", "correct_fp32"}
    assert all(f.first_failing_depth is None and f.depths == CORRECT_DEPTHS for f in findings)


def test_depth_reference_built_once_per_depth_and_shared(correct_depth):
    """Each depth's float64 stack is run once, in the parent, and mapped by all three families' workers."""
    _, doc, _ = correct_depth
    assert {r["extra"]["reference"] for r in doc["results"]} == {"shared"}
    assert {r["family"] for r in doc["results"]} == {"local", "sdpa", "kernel"}


@pytest.mark.slow
def test_depth_runs_one_depth_at_a_time_and_computes_each_stack_once():
    from attn_doctor.backends import BackendSpec
    from attn_doctor.execution.session import Session, turns
    from attn_doctor.probes.plan import plan_depth

    case = make_case(batch=1, seq=16, heads=2, head_dim=8, dtype="bf16", mask="causal", seed=3)
    jobs = plan_depth(case, [BackendSpec("sdpa.math", "sdpa", {"kernel": "math"}),
                             BackendSpec("local", "local")], [1, 3], [1, 2])
    units = {family: [(0, [i for i, job in enumerate(jobs) if job.backend.family == family])]
             for family in ("local", "sdpa")}
    steps = [(family, [(jobs[i].reference_layers, jobs[i].tp) for i in unit[1]])
             for family, unit in turns([jobs], units)]
    assert steps == [("local", [(1, 1), (1, 2)]), ("sdpa", [(1, 1), (1, 2)]),
                     ("local", [(3, 1), (3, 2)]), ("sdpa", [(3, 1), (3, 2)])]

    with Session("cpu", timeout_s=120) as session:
        rows = session.run(jobs)
        assert session.references.computed == 2 and session.references.failure is None
    assert all(row.verdict == "PASS" and row.extra["reference"] == "shared" for row in rows), \
        [(row.backend, row.coords, row.verdict, row.reason) for row in rows]


def test_depth_plot_is_a_png(correct_depth):
    _, doc, directory = correct_depth
    plot = directory / PLOT_FILE
    assert plot.exists()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.stat().st_size > 1000
    assert doc["artifacts"] == {"plot": PLOT_FILE}


@pytest.mark.slow
def test_no_plot_without_depths(layout_sweep):
    _, _, directory = layout_sweep
    assert not (directory / PLOT_FILE).exists()


# --- 3. a backward error multiplied at every layer is caught at depth --------------------------------------

@pytest.fixture(scope="module")
def compounding_depth(tmp_path_factory, run_cli):
    workdir = tmp_path_factory.mktemp("compounding-depth")
    layers = ",".join(map(str, COMPOUNDING_DEPTHS))
    result, doc = _sweep(run_cli, workdir, [*DEPTH_FLAGS, "--kernel", COMPOUNDING, "--layers", layers])
    return result, doc, workdir / "sweep"


@pytest.mark.slow
def test_compounding_kernel_passes_shallow_and_fails_deep(compounding_depth):
    result, doc, _ = compounding_depth
    assert result.exit_code == 1, result.output
    rows = {(r["backend"], r["coords"]["layers"]): r for r in doc["results"]}
    assert all(rows[("local", layers)]["verdict"] == "PASS" for layers in COMPOUNDING_DEPTHS)
    verdicts = {layers: rows[("compounding_backward", layers)]["verdict"] for layers in COMPOUNDING_DEPTHS}
    assert verdicts[COMPOUNDING_DEPTHS[0]] == "PASS"
    assert verdicts[COMPOUNDING_DEPTHS[-1]] == "FAIL"
    assert verdicts == {1: "PASS", 4: "PASS", 16: "FAIL", 24: "FAIL"}
    # the ratio to the baseline climbs with depth, and it is layer 1 (the whole backward) that fails
    ratios = [rows[("compounding_backward", layers)]["tensors"]["dq_first"]["ratio"] for layers in COMPOUNDING_DEPTHS]
    assert ratios == sorted(ratios) and ratios[0] < 1.5 and ratios[-1] > 6
    deep = rows[("compounding_backward", COMPOUNDING_DEPTHS[-1])]
    assert deep["tensors"]["dq_first"]["verdict"] == "FAIL"
    assert deep["tensors"]["dq_last"]["verdict"] == "PASS"  # the last layer's backward ran only once
    assert [f["backend"] for f in doc["faulty"]] == ["compounding_backward"]


def test_compounding_kernel_first_failing_depth_is_named(compounding_depth):
    result, doc, directory = compounding_depth
    rows = read_report(directory / "results.json").rows
    fails = sorted(r.coords.layers for r in rows if r.backend == "compounding_backward" and r.verdict == "FAIL")
    assert fails[0] == COMPOUNDING_FIRST_FAIL
    findings = {f.backend: f for f in depth_findings(depth_lines(rows))}
    assert findings["compounding_backward"].first_failing_depth == fails[0]
    assert findings["compounding_backward"].depths == COMPOUNDING_DEPTHS
    assert findings["compounding_backward"].growth > findings["compounding_backward"].baseline_growth
    assert findings["local"].first_failing_depth is None
    sentence = f"first fails at {COMPOUNDING_FIRST_FAIL} layers"
    assert sentence in _norm(result.stdout)
    assert sentence in _norm(doc["summary"])
    assert "compounding_backward first fails at" in _norm(doc["summary"])
    assert "local first fails" not in _norm(doc["summary"])


def test_compounding_kernel_counts_backward_calls_per_pass():
    """The test kernel itself: call n of a backward pass scales the gradients by (1 + DELTA) ** n, whether each
    layer is recomputed before its backward (one forward between two backwards continues the pass) or not; two
    forwards in a row start a new pass."""
    depth_faults = _load_module(DEPTH_FAULTS)
    correct_fp32 = _load_module(FAULTY).correct_fp32
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))

    def dq_of(fn):
        out = fn(q, k, v, causal=True, softmax_scale=0.5)
        return torch.autograd.grad(out, q, torch.ones_like(out))[0]

    true = dq_of(correct_fp32)
    depth_faults.reset()
    one = dq_of(depth_faults.compounding_backward)
    assert torch.allclose(one, true * (1 + depth_faults.DELTA), rtol=1e-5, atol=1e-7)
    compounding = depth_faults.compounding_backward
    for _ in range(2):  # a forward pass of two layers, then the backward pass, each layer recomputed first
        a = compounding(q, k, v, causal=True, softmax_scale=0.5)
        compounding(a.detach(), k, v, causal=True, softmax_scale=0.5)
        x = a.detach().requires_grad_()
        b = compounding(x, k, v, causal=True, softmax_scale=0.5)  # layer 2 again
        (grad_a,) = torch.autograd.grad(b, x, torch.ones_like(b))
        assert depth_faults._state["calls"] == 1
        a = compounding(q, k, v, causal=True, softmax_scale=0.5)  # layer 1 again
        dq_first = torch.autograd.grad(a, q, grad_a)[0]
        assert depth_faults._state["calls"] == 2
        assert torch.isfinite(dq_first).all()


# --- 4. tensor parallel: head shards as views and as copies ------------------------------------------------

@pytest.fixture(scope="module")
def tp_sweep(tmp_path_factory, run_cli):
    workdir = tmp_path_factory.mktemp("tp")
    result, doc = _sweep(run_cli, workdir, [
        "--batch", "1", "--seq", "32", "--heads", "4", "--kv-heads", "4,2", "--head-dim", "16", "--device", "cpu",
        "--tp", "1,2,4", "--kernel", IGNORES_STRIDES, "--kernel", CORRECT, "--backend", "sdpa.math",
    ])
    return result, doc


def _tp_rows(doc, backend, kv_heads):
    return {(r["coords"]["tp"], r["coords"]["shards_as"]): r for r in doc["results"]
            if r["backend"] == backend and r["case"]["kv_heads"] == kv_heads and r["coords"].get("probe") == "tp"}


@pytest.mark.slow
def test_tp_rows_layouts_and_coords(tp_sweep):
    _, doc = tp_sweep
    for backend in ("ignores_strides", "correct_fp32", "sdpa.math"):
        for kv_heads in (4, 2):
            rows = _tp_rows(doc, backend, kv_heads)
            assert set(rows) == {(1, "views"), (2, "views"), (2, "copies"), (4, "views"), (4, "copies")}
            assert rows[(1, "views")]["layout"] == "contiguous"
            assert rows[(2, "views")]["layout"] == "head_slice"
            assert rows[(2, "copies")]["layout"] == "contiguous"
    baselines = [r for r in doc["results"] if r["backend"] == "local"]
    assert len(baselines) == 2 and all(r["coords"] == {} and r["verdict"] == "PASS" for r in baselines)


def test_tp_stride_blind_kernel_fails_only_on_views(tp_sweep):
    result, doc = tp_sweep
    assert result.exit_code == 1, result.output
    for kv_heads in (4, 2):
        rows = _tp_rows(doc, "ignores_strides", kv_heads)
        assert rows[(1, "views")]["verdict"] == "PASS"
        assert rows[(2, "copies")]["verdict"] == "PASS"
        assert rows[(2, "views")]["verdict"] == "FAIL", rows[(2, "views")]["tensors"]
        assert rows[(2, "views")]["extra"]["out_vs_tp1"] > 0.1
    assert [f["backend"] for f in doc["faulty"]] == ["ignores_strides"]
    assert doc["faulty"][0]["layouts"] == ["head_slice"]


def test_tp_correct_kernels_pass_at_every_degree(tp_sweep):
    _, doc = tp_sweep
    for backend in ("correct_fp32", "sdpa.math"):
        rows = _tp_rows(doc, backend, 4)
        for (tp, shards_as), row in rows.items():
            assert row["verdict"] == "PASS", (backend, tp, shards_as, row["reason"])
            for name in ("out", "dq", "dk", "dv"):
                assert 0 <= row["extra"][f"{name}_vs_tp1"] < 1e-6, (backend, tp, name, row["extra"])
                assert row["tensors"][name]["verdict"] == "PASS"
        gqa = _tp_rows(doc, backend, 2)
        for key in ((1, "views"), (2, "views"), (2, "copies")):
            assert gqa[key]["verdict"] == "PASS", (backend, key, gqa[key]["reason"])
        for key in ((4, "views"), (4, "copies")):  # 2 kv heads cannot be split 4 ways
            assert gqa[key]["verdict"] == "SKIP" and "divisible by 4" in gqa[key]["reason"]


@pytest.mark.slow
def test_depth_stack_with_tp_shards(tmp_path, run_cli):
    """--layers with --tp: the shards run inside every layer; a correct kernel gives TP=1's dQ."""
    result, doc = _sweep(run_cli, tmp_path, [*DEPTH_FLAGS, "--kv-heads", "2", "--layers", "2", "--tp", "1,2",
                                             "--kernel", CORRECT])
    assert result.exit_code == 0, result.output
    rows = {(r["backend"], r["coords"]["tp"]): r for r in doc["results"]}
    assert set(rows) == {("local", 1), ("correct_fp32", 1), ("correct_fp32", 2)}
    assert all(r["verdict"] == "PASS" for r in rows.values())
    assert rows[("correct_fp32", 2)]["extra"]["dq_first_vs_tp1"] < 1e-6
    assert "dq_first_vs_tp1" not in rows[("correct_fp32", 1)]["extra"]


# --- 5. streamed results and resume ------------------------------------------------------------------------

RESUME_SEQS = [16, 24, 32, 40, 48]
RESUME_FLAGS = [*TINY_FLAGS, "--seq", ",".join(map(str, RESUME_SEQS)), "--backend", "sdpa.math",
                "--layout", "contiguous"]
ROWS_PER_POINT = 2  # the local baseline and sdpa.math on the contiguous layout


def _assert_each_row_once(directory: Path, points: int, rows_per_point: int, raw: bool = True) -> None:
    """results.json has every point's rows exactly once, and so has the log as read back; with `raw`, the
    results.jsonl file itself holds each row of each point exactly once (nothing left of a torn attempt)."""
    doc = json.loads((directory / "results.json").read_text())
    keys = [(json.dumps(r["case"], sort_keys=True), r["backend"], r["layout"], _coords(r)) for r in doc["results"]]
    assert len(keys) == len(set(keys)), "a row appears twice in results.json"
    assert len(keys) == points * rows_per_point, "results.json lacks a row"
    loaded, finished = ResultsLog(directory).load()
    keys = [(json.dumps(r.case.to_dict(), sort_keys=True), r.backend, r.layout, _coords(r.to_dict())) for r in loaded]
    assert len(finished) == points
    assert len(keys) == len(set(keys)) == points * rows_per_point, "results.jsonl reads back a row twice"
    if not raw:
        return
    records = _jsonl(directory / RESULTS_FILE)
    keys = [(r["point"], r["backend"], r["layout"], _coords(r)) for r in records]
    assert len(keys) == len(set(keys)), "a row appears twice in results.jsonl"
    by_point: dict[str, int] = {}
    for r in records:
        by_point[r["point"]] = by_point.get(r["point"], 0) + 1
    assert len(by_point) == points
    assert all(n == rows_per_point for n in by_point.values()), by_point
    assert sum(bool(r.get("point_complete")) for r in records) == points


# SIGTERM and SIGINT (Ctrl-C) both unwind through the sweep, keeping the finished points: exit 143 and 130.
@pytest.mark.slow
@pytest.mark.parametrize("signum,returncode", [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
                         ids=["SIGTERM", "SIGINT"])
def test_kill_mid_sweep_then_resume_runs_every_point_once(tmp_path, run_cli, signum, returncode):
    directory = tmp_path / "sweep"
    # each point takes >= 0.3 s (slow_correct sleeps): time to kill the sweep mid-way
    flags = [*TINY_FLAGS, "--seq", ",".join(map(str, RESUME_SEQS)), "--kernel", SLOW, "--layout", "contiguous"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "NO_COLOR": "1"}
    with open(tmp_path / "stdout", "wb") as out, open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "attn_doctor", "sweep", *flags, "--out", str(directory)],
                                cwd=tmp_path, env=env, stdout=out, stderr=err)
        try:
            results = directory / RESULTS_FILE
            deadline = time.monotonic() + 120
            done = 0
            while time.monotonic() < deadline and proc.poll() is None:
                if results.exists():
                    done = sum(b'"point_complete": true' in line for line in results.read_bytes().splitlines())
                    if done >= 1:
                        break
                time.sleep(0.01)
            assert proc.poll() is None, (tmp_path / "stderr").read_text()[-2000:]
            assert 1 <= done < len(RESUME_SEQS)
            proc.send_signal(signum)
            assert proc.wait(timeout=30) == returncode, (tmp_path / "stderr").read_text()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    before = results.read_bytes()
    completed = sum(bool(r.get("point_complete")) for r in _jsonl(results))
    assert 1 <= completed < len(RESUME_SEQS)
    assert not (directory / "results.json").exists()

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        result = run_cli(["sweep", *flags, "--resume", directory])
    assert result.exit_code == 0, result.output
    assert f"{completed} of {len(RESUME_SEQS)} points already done" in _norm(result.stdout)
    after = results.read_bytes()
    assert after.startswith(before)  # finished points are kept, not rerun
    _assert_each_row_once(directory, len(RESUME_SEQS), 2)  # local and slow_correct
    doc = json.loads((directory / "results.json").read_text())
    assert sorted({r["case"]["seq"] for r in doc["results"]}) == RESUME_SEQS
    assert all(r["verdict"] == "PASS" for r in doc["results"])


@pytest.fixture(scope="module")
def layout_sweep(tmp_path_factory, run_cli):
    """A finished 5-point layout sweep (copied by the tests that damage it)."""
    workdir = tmp_path_factory.mktemp("layout-sweep")
    result, doc = _sweep(run_cli, workdir, RESUME_FLAGS)
    return result, doc, workdir / "sweep"


def _copy(layout_sweep, tmp_path: Path) -> Path:
    directory = tmp_path / "sweep"
    shutil.copytree(layout_sweep[2], directory)
    (directory / "results.json").unlink()
    return directory


def _resume(run_cli, directory: Path, flags=RESUME_FLAGS):
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(directory.parent)
        return run_cli(["sweep", *flags, "--resume", directory])


def test_layout_sweep_streams_one_record_per_row(layout_sweep):
    result, doc, directory = layout_sweep
    assert result.exit_code == 0, result.output
    _assert_each_row_once(directory, len(RESUME_SEQS), ROWS_PER_POINT)
    records = _jsonl(directory / RESULTS_FILE)
    for record, row in zip(records, doc["results"]):  # the record is the `run` row plus the point
        assert {k: v for k, v in record.items() if k not in ("point", "point_complete")} == row
        assert json.loads(record["point"])["case"] == row["case"]


def test_resume_of_a_finished_sweep_runs_nothing(layout_sweep, tmp_path, run_cli):
    directory = _copy(layout_sweep, tmp_path)
    before = (directory / RESULTS_FILE).read_bytes()
    result = _resume(run_cli, directory)
    assert result.exit_code == 0, result.output
    assert f"{len(RESUME_SEQS)} of {len(RESUME_SEQS)} points already done" in _norm(result.stdout)
    assert (directory / RESULTS_FILE).read_bytes() == before
    _assert_each_row_once(directory, len(RESUME_SEQS), ROWS_PER_POINT)


@pytest.mark.slow
def test_torn_appended_line_is_cut_and_its_point_rerun(layout_sweep, tmp_path, run_cli):
    """Killed while writing the last point: its half line is cut off and the point runs again."""
    directory = _copy(layout_sweep, tmp_path)
    path = directory / RESULTS_FILE
    lines = path.read_bytes().splitlines(keepends=True)
    last_point = lines[-ROWS_PER_POINT:]
    path.write_bytes(b"".join(lines[:-ROWS_PER_POINT]) + last_point[0][: len(last_point[0]) // 2])
    result = _resume(run_cli, directory)
    assert result.exit_code == 0, result.output
    assert f"{len(RESUME_SEQS) - 1} of {len(RESUME_SEQS)} points already done" in _norm(result.stdout)
    _assert_each_row_once(directory, len(RESUME_SEQS), ROWS_PER_POINT)


@pytest.mark.slow
def test_torn_last_row_of_a_point_is_rerun_once(layout_sweep, tmp_path, run_cli):
    """Torn inside the point's last line: its earlier rows were written but the point never completed.
    Rerunning it must not leave those rows twice, now or after a later --resume."""
    directory = _copy(layout_sweep, tmp_path)
    path = directory / RESULTS_FILE
    data = path.read_bytes()
    start = data.rstrip(b"\n").rfind(b"\n") + 1
    path.write_bytes(data[: start + (len(data) - start) // 2])
    result = _resume(run_cli, directory)
    assert result.exit_code == 0, result.output
    assert f"{len(RESUME_SEQS) - 1} of {len(RESUME_SEQS)} points already done" in _norm(result.stdout)
    doc = json.loads((directory / "results.json").read_text())
    assert len(doc["results"]) == len(RESUME_SEQS) * ROWS_PER_POINT
    result = _resume(run_cli, directory)  # a second resume reads the repaired log back
    assert result.exit_code == 0, result.output
    _assert_each_row_once(directory, len(RESUME_SEQS), ROWS_PER_POINT, raw=False)


def test_resume_without_results_jsonl_exits_2(tmp_path, run_cli):
    (tmp_path / "empty").mkdir()
    line = _resume(run_cli, tmp_path / "empty").stderr
    assert "no results.jsonl" in line
    one_line_error(_resume(run_cli, tmp_path / "empty"))
    one_line_error(_resume(run_cli, tmp_path / "missing"))


def test_resume_and_out_disagree_exits_2(layout_sweep, tmp_path, run_cli):
    directory = _copy(layout_sweep, tmp_path)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        result = run_cli(["sweep", *RESUME_FLAGS, "--resume", directory, "--out", tmp_path / "elsewhere"])
    one_line_error(result)


def test_resume_with_other_backends_exits_2_and_keeps_the_log(layout_sweep, tmp_path, run_cli):
    directory = _copy(layout_sweep, tmp_path)
    before = (directory / RESULTS_FILE).read_bytes()
    other = [flag if flag != "sdpa.math" else "sdpa.efficient" for flag in RESUME_FLAGS]
    line = one_line_error(_resume(run_cli, directory, other))
    assert "that sweep ran local, sdpa.math, this command asks for local, sdpa.efficient" in line
    assert (directory / RESULTS_FILE).read_bytes() == before


GARBAGE = {
    "not-json": b"this is not json\n",
    "json-list": b"[1, 2]\n",
    "record-without-fields": b'{"point": "p"}\n',
    "tensors-not-a-table": (b'{"point": "p", "backend": "x", "layout": "contiguous", "case": {}, "verdict": "PASS", '
                            b'"tensors": []}\n'),
    "invalid-utf8": b"\xff\xfe\xfd garbage\n",
}


@pytest.mark.parametrize("garbage", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_line_in_the_middle_exits_2(layout_sweep, tmp_path, run_cli, garbage):
    directory = _copy(layout_sweep, tmp_path)
    path = directory / RESULTS_FILE
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + garbage + b"".join(lines[3:]))
    line = one_line_error(_resume(run_cli, directory))
    assert "results.jsonl:4" in line
    assert not (directory / "results.json").exists()


# --- 6. grids ----------------------------------------------------------------------------------------------

def _grid(**options):
    base, grid, depths, degrees = build_grid(options)
    return expand_grid(base, grid), depths, degrees


def test_grid_cross_product():
    cases, depths, degrees = _grid(seq="16,32", head_dim="8,16", mask="causal,none")
    assert depths is None and degrees is None
    assert len(cases) == 8
    assert {(c.seq, c.head_dim, c.mask) for c in cases} == {
        (s, d, m) for s in (16, 32) for d in (8, 16) for m in ("causal", "no_mask")}
    assert len({c.key() for c in cases}) == 8
    assert len(plan_points(cases, ["contiguous"], None, None)) == 8


def test_grid_windows_seq_kv_and_dedup():
    cases, _, _ = _grid(windows=("4,0", "8,0"), seq="16", seq_kv="16,24")
    assert {(c.window, c.seq_kv) for c in cases} == {((4, 0), 16), ((8, 0), 16), ((4, 0), 24), ((8, 0), 24)}
    # causal fixes the right window to 0, so 4,-1 is 4,0: one case, not two
    cases, _, _ = _grid(windows=("4,0", "4,-1"), seq="16,16")
    assert [c.window for c in cases] == [(4, 0)]
    cases, _, _ = _grid(windows=("none", "2,0"), mask="none")
    assert {c.window for c in cases} == {None, (2, 0)}


def test_grid_points_per_probe_kind():
    cases, depths, degrees = _grid(seq="16,32", layers="1,4", tp="1,2")
    assert depths == [1, 4] and degrees == [1, 2]
    points = plan_points(cases, ["contiguous"], depths, degrees)
    assert [p.kind for p in points] == ["depth", "depth"]
    assert all(p.depths == (1, 4) and p.degrees == (1, 2) for p in points)
    assert len({p.id for p in points}) == 2
    cases, depths, degrees = _grid(seq="16", tp="1,2")
    assert [p.kind for p in plan_points(cases, ["contiguous"], depths, degrees)] == ["tp"]


RECIPE = """\
description = "a tiny sweep recipe"

[case]
batch = 1
heads = 2
head_dim = 8
seq = 16
dtype = "bf16"

[grid]
seq = [16, 32]
mask = ["causal", "none"]
layers = [1, 2]
tp = [1, 2]
"""


def test_recipe_grid(tmp_path):
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(RECIPE)
    cases, depths, degrees = _grid(recipe=str(recipe))
    assert depths == [1, 2] and degrees == [1, 2]
    assert {(c.seq, c.mask) for c in cases} == {(16, "causal"), (32, "causal"), (16, "no_mask"), (32, "no_mask")}
    assert all(c.batch == 1 and c.heads == 2 and c.head_dim == 8 for c in cases)
    # flags override the recipe's lists
    cases, depths, degrees = _grid(recipe=str(recipe), seq="24", layers="3", tp="1")
    assert {c.seq for c in cases} == {24} and len(cases) == 2
    assert depths == [3] and degrees == [1]


@pytest.mark.slow
def test_cli_grid_runs_the_cross_product(tmp_path, run_cli):
    result, doc = _sweep(run_cli, tmp_path, [
        "--batch", "1", "--heads", "2", "--device", "cpu", "--seq", "16,32", "--head-dim", "8,16",
        "--mask", "causal,none", "--backend", "local", "--layout", "contiguous", "--layout", "transposed"])
    assert result.exit_code == 0, result.output
    cases = {json.dumps(r["case"], sort_keys=True) for r in doc["results"]}
    assert len(cases) == 8
    assert {(r["case"]["seq"], r["case"]["head_dim"], r["case"]["mask"]) for r in doc["results"]} == {
        (s, d, m) for s in (16, 32) for d in (8, 16) for m in ("causal", "no_mask")}
    assert len(doc["results"]) == 8 * 2 and all(r["verdict"] == "PASS" for r in doc["results"])
    tally = _norm(result.stdout)
    assert "sweep summary" in tally and "local 16 0 0 0" in tally


@pytest.mark.slow
def test_two_workers_per_family_run_every_point_once_in_grid_order(tmp_path, run_cli):
    result, doc = _sweep(run_cli, tmp_path, [
        "--batch", "2", "--heads", "2", "--head-dim", "8", "--device", "cpu", "--seq", "16,24,32,40,48",
        "--backend", "sdpa.math", "--kernel", IGNORES_STRIDES, "--layout", "contiguous", "--layout", "transposed",
        "--workers", "2"])
    assert result.exit_code == 1, result.output  # the stride-blind kernel fails on transposed views
    per_point = 5  # the baseline, then two backends on two layouts
    assert [r["case"]["seq"] for r in doc["results"]] == [s for s in (16, 24, 32, 40, 48) for _ in range(per_point)]
    failing = {(r["backend"], r["layout"]) for r in doc["results"] if r["verdict"] == "FAIL"}
    assert failing == {("ignores_strides", "transposed")}
    records = _jsonl(tmp_path / "sweep" / RESULTS_FILE)
    complete = [r["point"] for r in records if r.get("point_complete")]
    assert len(complete) == len(set(complete)) == 5 and len(records) == 5 * per_point


@pytest.mark.slow
def test_session_spreads_a_familys_points_over_its_workers():
    from attn_doctor.backends import BackendSpec
    from attn_doctor.execution.session import Session
    from attn_doctor.probes.plan import plan_calls

    cases = [make_case(batch=1, seq=seq, heads=2, head_dim=8) for seq in (16, 24, 32, 40)]
    groups = [plan_calls(case, [BackendSpec("sdpa.math", "sdpa", {"kernel": "math"})], ["contiguous"])
              for case in cases]
    finished = []
    with Session("cpu", workers_per_family=2) as session:
        rows = session.run_groups(groups, on_group=lambda index, group_rows: finished.append(index))
        pools = {family: [w.starts for w in workers] for family, workers in session.workers.items()}
    assert pools == {"local": [1, 1], "sdpa": [1, 1]}
    assert sorted(finished) == [0, 1, 2, 3]
    assert [[r.case.seq for r in group] for group in rows] == [[s, s] for s in (16, 24, 32, 40)]
    assert all(r.verdict == "PASS" for group in rows for r in group)


@pytest.fixture(scope="module")
def window_sweep(tmp_path_factory, run_cli):
    """Sliding windows and cross-attention through SDPA and the baseline (and a user kernel)."""
    workdir = tmp_path_factory.mktemp("windows")
    return _sweep(run_cli, workdir, [
        *TINY_FLAGS, "--seq", "32", "--seq-kv", "32,48", "--mask", "causal,none", "--window", "4,0",
        "--window", "8,0", "--backend", "sdpa.math", "--kernel", CORRECT,
        "--layout", "contiguous", "--layout", "sbh3d_packed"])


@pytest.mark.slow
def test_windows_and_cross_attention_reach_sdpa_and_baseline(window_sweep):
    _, doc = window_sweep
    cases = {(r["case"]["seq_kv"], r["case"]["mask"], tuple(r["case"]["window"])) for r in doc["results"]}
    assert cases == {(skv, m, (w, 0)) for skv in (32, 48) for m in ("causal", "no_mask") for w in (4, 8)}
    for row in doc["results"]:
        if row["backend"] not in ("local", "sdpa.math"):
            continue
        if row["layout"] == "sbh3d_packed" and row["case"]["seq_kv"] != row["case"]["seq"]:
            assert row["verdict"] == "SKIP" and "seq_kv == seq" in row["reason"]
        else:
            # SDPA only passes because it got the window: without it its error would be ~100% here
            assert row["verdict"] == "PASS", (row["backend"], row["layout"], row["case"], row["reason"])
            assert row["tensors"]["out"]["rel_err"] < 0.02


def test_windowed_cases_are_not_blamed_on_a_kernel_that_cannot_take_a_window(window_sweep):
    """A --kernel function has no window argument: a windowed case is SKIP (with the reason) for it,
    never a FAIL of a correct kernel."""
    result, doc = window_sweep
    kernel_rows = [r for r in doc["results"] if r["backend"] == "correct_fp32"]
    assert kernel_rows
    for row in kernel_rows:
        assert row["verdict"] in ("PASS", "SKIP"), (row["case"], row["reason"])
        if row["verdict"] == "SKIP":
            assert row["reason"]
    assert result.exit_code == 0, _norm(doc["summary"])


def test_depth_sweep_with_cross_attention_blames_no_kernel(tmp_path, run_cli):
    """The depth stack is self-attention; a --seq-kv case must be refused or skipped, not run as an
    ERROR of every backend but the baseline."""
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        result = run_cli(["sweep", *TINY_FLAGS, "--seq", "16", "--seq-kv", "24", "--layers", "1",
                          "--backend", "sdpa.math", "--out", tmp_path / "sweep"])
    if result.exit_code == 2:
        one_line_error(result)
        return
    doc = json.loads((tmp_path / "sweep" / "results.json").read_text())
    assert not [r for r in doc["results"] if r["verdict"] in ("ERROR", "FAIL")], _norm(doc["summary"])
    assert all(r["verdict"] == "SKIP" and r["reason"] for r in doc["results"]), doc["results"]


BAD_FLAGS = {
    "seq-not-a-number": ["--seq", "16,x"],
    "dtype-unknown": ["--dtype", "bf16,fp8"],
    "layers-zero": ["--layers", "0"],
    "layers-negative": ["--layers", "4,-1"],
    "tp-zero": ["--tp", "0"],
    "mask-unknown": ["--mask", "causal,sideways"],
    "window-one-number": ["--window", "4"],
    "window-right-with-causal": ["--window", "4,2"],
    "kv-heads-not-dividing": ["--heads", "4", "--kv-heads", "4,3"],
    "seq-kv-zero": ["--seq-kv", "16,0"],
    "seq-empty-list": ["--seq", ","],
    "workers-zero": ["--workers", "0"],
}


@pytest.mark.parametrize("flags", list(BAD_FLAGS.values()), ids=list(BAD_FLAGS))
def test_bad_grid_flags_exit_2_with_one_line(tmp_path, run_cli, flags):
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        result = run_cli(["sweep", "--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8",
                          "--device", "cpu", "--backend", "sdpa.math", *flags, "--out", tmp_path / "sweep"])
    one_line_error(result)
    assert not (tmp_path / "sweep" / "results.json").exists()


BAD_RECIPE_GRIDS = {
    "unknown-field": "color = [1]",
    "seq-not-a-number": 'seq = ["a"]',
    "tp-zero": "tp = [0]",
    "layers-not-a-number": 'layers = ["a"]',
    "layers-fraction": "layers = [1.5]",
    "window-not-a-pair": "window = [4]",
}


@pytest.mark.parametrize("grid", list(BAD_RECIPE_GRIDS.values()), ids=list(BAD_RECIPE_GRIDS))
def test_bad_recipe_grid_exits_2_with_one_line(tmp_path, run_cli, grid):
    recipe = tmp_path / "bad.toml"
    recipe.write_text(f"[case]\nbatch = 1\nheads = 2\nhead_dim = 8\nseq = 16\n\n[grid]\n{grid}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        result = run_cli(["sweep", "--recipe", recipe, "--device", "cpu", "--backend", "sdpa.math",
                          "--out", tmp_path / "sweep"])
    one_line_error(result)


@pytest.mark.slow
def test_out_that_already_holds_a_sweep_is_refused(tmp_path, monkeypatch, run_cli):
    """Seen on the H200: re-running into an existing --out silently reused its old rows."""
    monkeypatch.chdir(tmp_path)
    flags = ["sweep", "--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--backend", "sdpa.math",
             "--layout", "contiguous", "--out", str(tmp_path / "sw")]
    assert run_cli(flags).exit_code == 0
    before = (tmp_path / "sw" / "results.jsonl").read_text()
    again = run_cli(flags)
    assert again.exit_code == 2
    assert "--resume" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert (tmp_path / "sw" / "results.jsonl").read_text() == before


# --- where a sweep's time goes -------------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_sweep_records_where_its_time_went_and_workers_can_write_their_profiles(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTN_DOCTOR_PROFILE_DIR", str(tmp_path / "prof"))
    result = run_cli(["sweep", "--batch", "1", "--seq", "32", "--heads", "2", "--head-dim", "16", "--seed", "1,2",
                      "--backend", "local", "--backend", "sdpa.math", "--layout", "contiguous", "--device", "cpu",
                      "--out", tmp_path / "sweep"])
    assert result.exit_code == 0, result.output
    seconds = json.loads((tmp_path / "sweep" / "results.json").read_text())["seconds"]
    assert {"worker start (local)", "worker start (sdpa)", "kernels", "kernels, on a CPU", "comparison",
            "probes (wall)", "points per minute"} <= set(seconds)
    assert seconds["kernels, on a CPU"] > 0
    assert not any(name.startswith("phase ") for name in seconds)  # one plan: no phases to time
    assert seconds["points"] == 2 and seconds["probes (wall)"] <= seconds["wall"]
    # the pace is counted from the command's start (its imports and plan), as a user waits for it
    before = seconds["before the session (from the command's start)"]
    assert 0 < before and seconds["wall"] == pytest.approx(before + seconds["diagnose (wall)"], abs=1e-6)
    assert seconds["points per minute"] == pytest.approx(60 * 2 / seconds["wall"])
    assert "cases in" in result.output and "s from the command's start" in result.output
    assert {path.name.split("-")[1] for path in (tmp_path / "prof").glob("worker-*.prof")} == {"local", "sdpa"}
