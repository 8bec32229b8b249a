"""Real TP/CP launches on the CPU: torchrun, gloo, 2 ranks, tiny shapes.

Each torchrun launch costs a few seconds (interpreter + torch import on every rank), so the probes of one
rank grid share a launch (module-scoped fixtures) and each test reads its part of the outcomes.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from attn_doctor import distributed as D
from attn_doctor.backends import BackendSpec, build
from attn_doctor.backends.kernel import parse_kernel_spec
from attn_doctor.core.case import make_case
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import BadInput
from attn_doctor.results.row import Row
from attn_doctor.verdict.judge import judge
from attn_doctor.verdict.rule import ERROR, FAIL, PASS, SKIP

RANK_FAULTS = Path(__file__).resolve().parent / "kernels" / "rank_faults.py"
SDPA_MATH = BackendSpec("sdpa.math", "sdpa", {"kernel": "math"})
LOCAL = BackendSpec("local", "local")
CAUSAL = make_case(batch=1, seq=16, heads=4, head_dim=8, dtype="bf16", mask="causal", seed=3)
NO_MASK = make_case(batch=1, seq=16, heads=4, head_dim=8, dtype="bf16", mask="none", seed=4)
GQA = make_case(batch=1, seq=16, heads=4, kv_heads=2, head_dim=8, dtype="bf16", mask="causal", seed=5)
TENSORS = ("out", "dq", "dk", "dv")


def kernel(func: str) -> BackendSpec:
    return parse_kernel_spec(f"{RANK_FAULTS}:{func}")


def grid(tp: int, cp: int, comm: str | None = "all_gather", timeout_s: float = 60.0) -> dict:
    return dict(nproc=tp * cp, tp=tp, cp=cp, cp_comm_type=comm, device="cpu", timeout_s=timeout_s)


@pytest.fixture(scope="module")
def tp2():
    return D.launch_many([(SDPA_MATH, CAUSAL), (LOCAL, CAUSAL), (SDPA_MATH, GQA),
                          (kernel("dq_wrong_on_rank1"), CAUSAL)], **grid(2, 1))


@pytest.fixture(scope="module")
def cp2_all_gather():
    return D.launch_many([(SDPA_MATH, CAUSAL), (SDPA_MATH, NO_MASK), (LOCAL, CAUSAL), (LOCAL, NO_MASK),
                          (kernel("correct"), CAUSAL), (kernel("dq_wrong_on_rank1"), CAUSAL)], **grid(1, 2))


def judged(outcome: D.DistributedOutcome) -> Row:
    row = D.judged_rows([outcome])[-1]
    assert row.coords.params() == {"probe": "distributed", "nproc": outcome.nproc, "tp": outcome.tp, "cp": outcome.cp,
                          "cp_comm_type": outcome.cp_comm_type}
    return row


def assert_passes_like_single(outcome: D.DistributedOutcome, exact: tuple[str, ...], close: float) -> None:
    """PASS against float64 (3x the local baseline) on the whole tensors and on every rank's shard, and
    near the single-process run: bit-identical for `exact` tensors, within `close` for the others (dk, dv
    under CP are sums of per-rank contributions, rounded once more)."""
    assert outcome.status == "ok", (outcome.reason, outcome.detail)
    row = judged(outcome)
    assert row.verdict == PASS, row.reason
    assert set(row.tensors) == set(TENSORS)
    assert outcome.failing_ranks == []
    assert [shard.rank for shard in outcome.ranks] == list(range(outcome.nproc))
    for name in TENSORS:
        assert outcome.single_metrics[name].rel_err < 0.02
        if name in exact:
            assert outcome.bitwise_single[name], name
        assert outcome.vs_single[name] < close, (name, outcome.vs_single)


# --- refusals, no launch ----------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(nproc=3, tp=2, cp=1), "must equal --tp 2 x --cp 1"),
    (dict(nproc=2, tp=1, cp=1), "must equal"),
    (dict(nproc=4, tp=2, cp=2, cp_comm_type="a2a+p2p"), "a2a+p2p"),
    (dict(nproc=2, tp=1, cp=2, cp_comm_type="ring"), "choose one of all_gather, p2p, a2a"),
    (dict(nproc=0, tp=0, cp=1), "whole number >= 1"),
    (dict(nproc=2, tp=2, cp=1, device="mps"), "cpu (gloo) or cuda"),
])
def test_impossible_grid_is_refused_before_launching(kwargs, message):
    kwargs = {"cp_comm_type": "all_gather", "device": "cpu", "timeout_s": 5.0, **kwargs}
    started = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(message)) as caught:
        D.launch(SDPA_MATH, CAUSAL, **kwargs)
    assert isinstance(caught.value, BadInput)
    assert time.perf_counter() - started < 1.0  # refused, not launched


@pytest.mark.parametrize("spec, case, tp, cp, comm, message", [
    (SDPA_MATH, make_case(batch=1, seq=16, heads=3, head_dim=8), 2, 1, None, "divisible by 2"),
    (SDPA_MATH, make_case(batch=1, seq=18, heads=4, head_dim=8), 1, 2, "all_gather", "divisible by 4"),
    (SDPA_MATH, make_case(batch=1, seq=16, seq_kv=32, heads=4, head_dim=8), 1, 2, "p2p", "seq_kv == seq"),
    (SDPA_MATH, make_case(batch=1, seq=16, heads=2, kv_heads=1, head_dim=8), 1, 2, "a2a", "divisible by 2"),
    (BackendSpec("te.fused", "te", {"path": "fused"}), CAUSAL, 2, 1, None, "CUDA"),
])
def test_case_that_does_not_fit_the_grid_skips_without_launching(spec, case, tp, cp, comm, message):
    outcome = D.launch(spec, case, **grid(tp, cp, comm))
    assert outcome.status == "skip" and message in outcome.reason
    assert D.to_row(outcome).verdict == SKIP


def test_rank_grid_is_tp_fastest_and_cp_split_is_load_balanced():
    assert [D.grid_position(r, 2) for r in range(4)] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert D.tp_group_ranks(2, 2) == [[0, 1], [2, 3]]
    assert D.cp_group_ranks(2, 2) == [[0, 2], [1, 3]]
    # 2*cp chunks of 4 tokens: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (TE's causal balance).
    assert D.cp_positions(16, 2, 0) == [0, 1, 2, 3, 12, 13, 14, 15]
    assert D.cp_positions(16, 2, 1) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert sorted(D.cp_positions(24, 3, 0) + D.cp_positions(24, 3, 1) + D.cp_positions(24, 3, 2)) == list(range(24))


# --- TP = 2 ---------------------------------------------------------------------------------------------


@pytest.mark.torchrun
@pytest.mark.slow
def test_tp2_sdpa_math_and_local_pass_and_equal_the_single_process_run(tp2):
    math_causal, local_causal, math_gqa, _ = tp2
    for outcome in (math_causal, local_causal, math_gqa):
        assert_passes_like_single(outcome, exact=TENSORS, close=1e-6)  # heads are independent: same bits
    assert math_causal.ran == "SDPA math: composite matmul + softmax + TP 2, 2 ranks"
    assert local_causal.ran == "Megatron local: baddbmm + fp32 softmax + TP 2, 2 ranks"
    assert [(s.tp_rank, s.cp_rank) for s in math_gqa.ranks] == [(0, 0), (1, 0)]


@pytest.mark.slow
@pytest.mark.torchrun
def test_fault_on_rank1_only_is_detected_and_attributed_to_rank1(tp2):
    outcome = tp2[3]
    assert outcome.status == "ok"
    row = judged(outcome)
    assert row.verdict == FAIL and row.failing_tensors == ["dq"]
    assert outcome.failing_ranks == [1]
    rank0, rank1 = outcome.ranks
    assert all(v.verdict == PASS for v in rank0.verdicts.values())
    assert rank1.failing == ["dq"]
    assert rank1.vs_single["dq"] > 0.03 and rank0.vs_single["dq"] == 0.0  # the single run (rank 0) is correct
    assert "rank 1 (tp_rank 1, cp_rank 0): dq" in row.reason and "rank 0 pass" in row.reason
    assert row.extra["failing_ranks"] == [1]


@pytest.mark.slow
@pytest.mark.torchrun
def test_distributed_row_is_judged_against_the_plain_single_call_baseline(tp2):
    """verdict.judge, as the run workflow calls it, pairs the distributed row with the ordinary baseline row."""
    import torch

    from attn_doctor.probes import Caches, run_probe

    measured = run_probe(build(LOCAL), Coords.call(CAUSAL, LOCAL), Caches(torch.device("cpu")))
    baseline = Row(Coords.call(CAUSAL, LOCAL), "", metrics=measured.metrics)  # as the session makes it
    good, bad = D.to_row(tp2[0]), D.to_row(tp2[3])
    judge([baseline, good, bad])  # and names the ranks whose shards fail
    assert good.verdict == PASS and bad.verdict == FAIL
    assert "rank 1" in bad.reason
    again = Row.from_dict(bad.to_dict())  # the row survives the results JSON
    assert again.coords == bad.coords and again.extra["ranks"][1]["failing"] == ["dq"]


# --- CP = 2 ---------------------------------------------------------------------------------------------


@pytest.mark.torchrun
@pytest.mark.slow
def test_cp2_all_gather_passes_causal_and_no_mask(cp2_all_gather):
    for outcome in cp2_all_gather[:5]:
        # out and dq come from one call per query on the full k, v: the same bits as one process
        # (sdpa/local); dk and dv are two ranks' contributions summed, so they move by a rounding.
        exact = ("out", "dq") if outcome.spec.family != "kernel" else ()
        assert_passes_like_single(outcome, exact=exact, close=0.02)
        assert outcome.ran.endswith(" + CP all_gather, 2 ranks")
        assert [(s.tp_rank, s.cp_rank) for s in outcome.ranks] == [(0, 0), (0, 1)]
    assert "explicit global causal mask" in cp2_all_gather[0].extra["cp_method"]
    assert "zero-padded" in cp2_all_gather[4].extra["cp_method"]


@pytest.mark.slow
@pytest.mark.torchrun
def test_cp2_fault_on_rank1_is_attributed_to_rank1(cp2_all_gather):
    outcome = cp2_all_gather[5]
    row = judged(outcome)
    assert row.verdict == FAIL and "dq" in row.failing_tensors
    assert outcome.failing_ranks == [1]  # rank 1 holds chunks 1 and 2: only their dq is wrong
    assert outcome.ranks[1].failing == ["dq"]


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_cp2_p2p_ring_and_a2a_pass(comm):
    outcomes = D.launch_many([(SDPA_MATH, CAUSAL), (LOCAL, NO_MASK)], **grid(1, 2, comm))
    for outcome in outcomes:
        # a2a runs the backend unchanged on whole sequences: every tensor is the single run's, bit for bit
        assert_passes_like_single(outcome, exact=TENSORS if comm == "a2a" else ("out", "dq"), close=0.02)
        assert outcome.ran.endswith(f" + CP {comm}, 2 ranks")


# --- ranks that fail, die or hang --------------------------------------------------------------------


@pytest.mark.torchrun
@pytest.mark.slow
def test_rank_that_raises_or_dies_is_named_and_later_probes_still_run():
    started = time.perf_counter()
    raised, died, after = D.launch_many([(kernel("raises_on_rank1"), CAUSAL), (kernel("exits_on_rank1"), CAUSAL),
                                         (kernel("correct"), CAUSAL)], **grid(2, 1))
    assert raised.status == "error" and raised.reason == "rank 1: RuntimeError: injected failure on rank 1"
    assert "injected failure" in raised.detail
    assert died.status == "error"
    assert died.reason.startswith("rank 1 died (exit code 9) in the backend's forward/backward of probe 1")
    assert "rank 0" not in died.reason.split(";")[0]
    assert D.to_row(died).verdict == ERROR
    assert after.status == "ok" and judged(after).verdict == PASS  # run by a fresh launch
    assert time.perf_counter() - started < 40


@pytest.mark.slow
def test_rank_that_hangs_is_killed_at_the_timeout_and_named():
    started = time.perf_counter()
    outcome = D.launch(kernel("hangs_on_rank1"), CAUSAL, **grid(2, 1, timeout_s=3.0))
    elapsed = time.perf_counter() - started
    assert outcome.status == "error"
    assert outcome.reason.startswith("hung: no result within --timeout 3 s (rank 1 stuck in the backend's")
    assert "rank 0 waiting in the agreement" in outcome.reason
    assert elapsed < 3.0 + 20  # start-up + timeout + the kill's grace, never the kernel's 120 s sleep


# --- the CLI: `attn-doctor run --nproc` ----------------------------------------------------------------------

@pytest.mark.slow
def test_run_nproc_names_the_faulty_rank_and_refuses_a_bad_grid(tmp_path, monkeypatch, run_cli):
    import json

    monkeypatch.chdir(tmp_path)
    fault = str(Path(__file__).parent / "kernels" / "rank_faults.py") + ":dq_wrong_on_rank1"
    result = run_cli(["run", "--nproc", "2", "--tp", "2", "--batch", "1", "--seq", "32", "--heads", "2",
                      "--head-dim", "8", "--backend", "sdpa.math", "--kernel", fault, "--device", "cpu",
                      "--json", "out.json"])
    assert result.exit_code == 1, result.output
    rows = {r["backend"]: r for r in json.loads((tmp_path / "out.json").read_text())["results"]}
    assert rows["local"]["verdict"] == PASS and rows["sdpa.math"]["verdict"] == PASS
    bad = rows["dq_wrong_on_rank1"]
    assert bad["verdict"] == FAIL and bad["coords"]["probe"] == "distributed" and "rank 1" in bad["reason"]
    assert "--nproc 2 --tp 2 --cp 1" in Row.from_dict(bad).repro_command()
    refused = run_cli(["run", "--nproc", "3", "--tp", "2", "--device", "cpu"])
    assert refused.exit_code == 2 and "--nproc 3" in refused.stderr and "Traceback" not in refused.stderr
