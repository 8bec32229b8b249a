"""Numerics on CPU: the float64 reference, the metrics, the verdict rule, and real and faulty kernels.

Kernels run through a `Session`, i.e. in real worker processes exactly as `attn-doctor run` runs them.
"""

from __future__ import annotations

import math

import pytest
import torch

from attn_doctor.numerics import metrics
from attn_doctor.backends import BackendSpec
from attn_doctor.backends.kernel import parse_kernel_spec
from attn_doctor.core.case import make_case
from attn_doctor.verdict.diagnosis import find_faulty, summarize
from attn_doctor.core.layouts import LAYOUTS, layout_unsupported
from attn_doctor.numerics.metrics import TensorMetrics, compare
from attn_doctor.numerics.reference import attention_reference, naive_reference
from attn_doctor.execution.session import Session
from attn_doctor.probes.plan import plan_calls
from attn_doctor.verdict.rule import CORE_TENSORS as TENSORS
from attn_doctor.verdict.rule import EPS, FAIL, INCONCLUSIVE, PASS, SKIP, judge_tensor

FAULTY_NAMES = ("correct_fp32", "dq_two_percent", "causal_shift_backward", "nan_one_head_dk", "ignores_strides")
VIEW_LAYOUTS = tuple(layout for layout in LAYOUTS if layout != "contiguous")


def _run(cases, specs, layouts, session=None):
    """Judged rows of every backend x layout on each case, in real worker processes."""
    if session is None:
        with Session("cpu", timeout_s=120) as session:
            return _run(cases, specs, layouts, session)
    return [row for case in cases for row in session.run(plan_calls(case, specs, layouts))]


def _randn(*shape, seed, dtype=torch.float64):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# --- the float64 reference --------------------------------------------------------------------------------

REFERENCE_SHAPES = [
    # batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, window
    (2, 64, 64, 4, 4, 16, True, None),
    (2, 64, 64, 4, 4, 16, False, None),
    (1, 100, 100, 8, 2, 8, True, None),  # GQA, 100 rows: a partial last block
    (2, 48, 80, 4, 1, 16, False, None),  # seq_kv > seq, multi-query
    (2, 80, 48, 4, 2, 16, True, None),  # seq_kv < seq, causal top-left aligned
    (1, 96, 96, 4, 4, 8, True, (20, 0)),  # causal sliding window
    (1, 96, 96, 4, 2, 8, False, (10, 5)),  # two-sided window, GQA
    (1, 96, 96, 2, 2, 8, False, (-1, 3)),  # right-bounded only
    (1, 64, 16, 2, 1, 8, False, (1, 0)),  # rows 17.. see no key at all
]


TILINGS = {  # block_bytes, widest key tile: each exercises one path of attention_reference
    "one-tile": (None, None),
    "kept-key-tiles": (None, 16),  # several key tiles, probabilities kept from forward to backward
    "kept-head-chunks": (700_000, None),  # kept, and (batch, kv head) pairs taken one chunk at a time
    "recomputed-16x16-tiles": (1, None),  # the smallest tiles, probabilities recomputed in the backward
    "recomputed-wide-tiles": (200_000, 32),
}


@pytest.mark.parametrize("tiling", TILINGS)
@pytest.mark.parametrize("shape", REFERENCE_SHAPES, ids=lambda s: "b{}-s{}-skv{}-h{}-kv{}-d{}-{}-w{}".format(*s))
def test_blockwise_reference_matches_naive(shape, tiling, monkeypatch):
    from attn_doctor.numerics import reference

    block_bytes, widest = TILINGS[tiling]
    if widest is not None:
        monkeypatch.setattr(reference, "MAX_TILE_COLS", widest)
    batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, window = shape
    q = _randn(batch, seq_q, heads, head_dim, seed=1)
    k = _randn(batch, seq_kv, kv_heads, head_dim, seed=2)
    v = _randn(batch, seq_kv, kv_heads, head_dim, seed=3)
    dout = _randn(batch, seq_q, heads, head_dim, seed=4)
    scale = 1 / math.sqrt(head_dim)
    got = attention_reference(q, k, v, dout, causal=causal, softmax_scale=scale, window=window, block_bytes=block_bytes)
    want = naive_reference(q, k, v, dout, causal=causal, softmax_scale=scale, window=window)
    for name in TENSORS:
        assert getattr(got, name).shape == getattr(want, name).shape, name
        assert torch.isfinite(getattr(got, name)).all(), name
        assert _rel(getattr(got, name), getattr(want, name)) < 1e-12, name
    assert torch.equal(torch.isinf(got.lse), torch.isinf(want.lse))
    finite = torch.isfinite(want.lse)
    assert _rel(got.lse[finite], want.lse[finite]) < 1e-12


@pytest.mark.parametrize("magnitude, causal, path", [(1, True, "no shift"), (6, False, "bound as shift"),
                                                     (6, True, "exact maximum"), (30, True, "exact maximum")])
def test_reference_softmax_shift_paths(monkeypatch, magnitude, causal, path):
    """Ordinary scores need no softmax shift; scores in the hundreds are shifted by their Cauchy-Schwarz bound;
    where that bound is far above a row's maximum (in the thousands, or a causal row that sees a few keys
    pointing away from its query) the sums would underflow, and the block is redone with the exact maximum. Each
    path must match the plain formula."""
    from attn_doctor.numerics import reference

    bounds, exact_calls = [], []
    score_bound, exact_row_max = reference._score_bound, reference._exact_row_max
    monkeypatch.setattr(reference, "_score_bound", lambda *a: bounds.append(float(score_bound(*a).max()))
                        or score_bound(*a))
    monkeypatch.setattr(reference, "_exact_row_max", lambda *a: exact_calls.append(1) or exact_row_max(*a))
    q, k = (_randn(1, 64, 2, 16, seed=s) * magnitude for s in (20, 21))
    v, dout = (_randn(1, 64, 2, 16, seed=s) for s in (22, 23))
    got = attention_reference(q, k, v, dout, causal=causal, softmax_scale=0.25, block_bytes=1)
    want = naive_reference(q, k, v, dout, causal=causal, softmax_scale=0.25)
    took = "exact maximum" if exact_calls else "bound as shift" if bounds else "no shift"
    assert took == path, "the inputs no longer exercise the path this case is for"
    for name in TENSORS:
        assert _rel(getattr(got, name), getattr(want, name)) < 1e-12 * magnitude**2, name
    torch.testing.assert_close(got.lse, want.lse, rtol=1e-13, atol=0)


def test_reference_takes_low_precision_strided_inputs():
    """bf16 views (transposed storage, a head slice) give exactly the reference of their contiguous copies."""
    b, s, h, d = 2, 40, 4, 8
    q_wide = _randn(s, b, 2 * h, d, seed=5, dtype=torch.bfloat16)
    q = q_wide.transpose(0, 1)[:, :, h:]  # non-contiguous, offset storage
    k = _randn(s, b, h, d, seed=6, dtype=torch.bfloat16).transpose(0, 1)
    v = _randn(b, s, h, d, seed=7, dtype=torch.bfloat16)
    dout = _randn(b, s, h, d, seed=8, dtype=torch.bfloat16)
    assert not q.is_contiguous() and not k.is_contiguous()
    got = attention_reference(q, k, v, dout, causal=True, softmax_scale=0.3, block_bytes=1)
    want = naive_reference(*(t.contiguous() for t in (q, k, v, dout)), causal=True, softmax_scale=0.3)
    assert got.out.dtype == torch.float64
    for name in TENSORS:
        assert _rel(getattr(got, name), getattr(want, name)) < 1e-12, name


@pytest.mark.parametrize("tiling, pairs, rows, cols, keep", [
    ("one-tile", 2, 100, 100, True), ("kept-key-tiles", 2, 100, 16, True), ("kept-head-chunks", 1, 100, 100, True),
    ("recomputed-16x16-tiles", 2, 16, 16, False), ("recomputed-wide-tiles", 2, 25, 32, False),
])
def test_tilings_take_the_path_they_are_named_for(monkeypatch, tiling, pairs, rows, cols, keep):
    from attn_doctor.numerics import reference

    block_bytes, widest = TILINGS[tiling]
    if widest is not None:
        monkeypatch.setattr(reference, "MAX_TILE_COLS", widest)
    plan = reference.plan_tiles(2, 4, 100, 100, torch.device("cpu"), block_bytes)  # REFERENCE_SHAPES[2]
    assert (plan.pairs, plan.rows, plan.cols, plan.keep) == (pairs, rows, cols, keep)


def test_long_context_plan_on_cuda_keeps_tall_blocks_a_few_heads_at_a_time():
    """Seq 131072 x 16 heads on CUDA: the default budget keeps 1024 rows of probabilities of 4 heads (4 GiB)."""
    from attn_doctor.numerics.reference import plan_tiles

    plan = plan_tiles(16, 1, 131072, 131072, torch.device("cuda"), None)
    assert (plan.pairs, plan.rows, plan.cols, plan.keep) == (4, 1024, 8192, True)
    assert plan.pairs * plan.rows * 131072 * 8 <= 4 << 30
    short = plan_tiles(32, 1, 4096, 4096, torch.device("cuda"), None)  # the default run's size: all heads at once
    assert (short.pairs, short.rows, short.keep) == (32, 1024, True)


def test_reference_is_not_trivially_zero():
    """Guard for the comparison above: a mask bug that zeroes everything would match itself."""
    q, k, v, dout = (_randn(1, 32, 2, 8, seed=i) for i in range(4))
    ref = attention_reference(q, k, v, dout, causal=True, softmax_scale=0.35)
    assert ref.out.abs().sum() > 0 and ref.dk.abs().sum() > 0
    # Row 0 under a causal mask sees only key 0: its output is v[:, 0] exactly.
    torch.testing.assert_close(ref.out[:, 0], v[:, 0], rtol=1e-12, atol=1e-12)
    unmasked = attention_reference(q, k, v, dout, causal=False, softmax_scale=0.35)
    assert _rel(unmasked.out, ref.out) > 0.1


# --- metrics ----------------------------------------------------------------------------------------------

def test_compare_identical_is_exact():
    ref = _randn(2, 16, 3, 8, seed=9)
    m = compare(ref.clone(), ref)
    assert m.rel_err == 0 and m.max_abs_err == 0 and m.worst_head_rel_err == 0
    assert m.cosine == pytest.approx(1.0, abs=1e-12)
    assert (m.nan, m.inf, m.ref_nonfinite) == (0, 0, 0)


def test_compare_scaled_and_one_head_error():
    ref = _randn(2, 16, 3, 8, seed=10)
    m = compare(ref * 1.01, ref)
    assert m.rel_err == pytest.approx(0.01, rel=1e-9)
    assert m.worst_head_rel_err == pytest.approx(0.01, rel=1e-9)
    assert m.cosine == pytest.approx(1.0, abs=1e-12)
    assert m.max_abs_err == pytest.approx(float(ref.abs().max()) * 0.01, rel=1e-9)

    one_head = ref.clone()
    one_head[1, :, 2] *= 1.3  # batch 1, head 2 only
    m = compare(one_head, ref)
    assert m.worst_head_rel_err == pytest.approx(0.3, rel=1e-9)
    assert m.rel_err < 0.3 / 2  # averaged over 6 (batch, head) slices
    assert m.cosine < 1.0


def test_compare_low_precision_candidate_and_strides():
    ref = _randn(2, 16, 3, 8, seed=11)
    cand = ref.to(torch.bfloat16).transpose(0, 1).contiguous().transpose(0, 1)  # bf16, non-contiguous
    m = compare(cand, ref)
    assert 0 < m.rel_err < EPS["bf16"]
    assert m.cosine > 0.9999


def test_compare_counts_nan_and_inf():
    ref = _randn(2, 16, 3, 8, seed=12)
    cand = ref.clone()
    cand[0, 0, 0, :3] = float("nan")
    cand[1, 5, 1, 0] = float("inf")
    m = compare(cand, ref)
    assert (m.nan, m.inf, m.ref_nonfinite) == (3, 1, 0)
    assert m.rel_err == 0  # measured over entries finite in both
    ref_bad = ref.clone()
    ref_bad[0, 1, 0, 0] = float("nan")
    assert compare(ref.clone(), ref_bad).ref_nonfinite == 1


def test_compare_chunking_gives_the_same_answer(monkeypatch):
    ref = _randn(2, 50, 3, 8, seed=13)
    cand = ref + 1e-3 * _randn(2, 50, 3, 8, seed=14)
    whole = compare(cand, ref)
    monkeypatch.setattr(metrics, "CHUNK_ELEMENTS", 7)  # several positions per chunk, a partial last chunk
    chunked = compare(cand, ref)
    for field in ("rel_err", "max_abs_err", "cosine", "worst_head_rel_err"):
        assert getattr(chunked, field) == pytest.approx(getattr(whole, field), rel=1e-12), field


def test_a_comparison_reads_its_figures_in_one_transfer(monkeypatch):
    """Each value read from a GPU tensor waits for the GPU, and with a dozen processes time-sliced on it, for the
    process's next turn (about 110 such reads a compared row made comparing cost 30-60 ms on the H100). So the
    sums read nothing, and the figures read them through one copy to the host: counted here on the CPU."""
    from attn_doctor.numerics import standalone

    reads: list[str] = []
    for name in ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "cpu"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _real=real, _name=name, **k: (
            reads.append(_name), _real(self, *a, **k))[1])
    ref = _randn(2, 16, 3, 8, seed=21)
    cand = ref + 1e-3 * _randn(2, 16, 3, 8, seed=22)
    terms = ref.square().sum(-1, keepdim=True).expand(2, 16, 3, 2).clone()
    rows = torch.ones(2, 16, dtype=torch.bool)
    rows[1, 9:] = False
    sums = None
    for stretch in (slice(0, 5), slice(5, 16)):  # the way `compare` adds stretches of the sequence
        sums = standalone.error_sums(cand[:, stretch], ref[:, stretch], terms[:, stretch], rows[:, stretch],
                                     ~rows[:, stretch], into=sums)
    assert reads == []
    figures = standalone.error_figures(sums)
    assert reads[0] == "cpu" and reads.count("cpu") == 1
    assert figures["empty_rows"] == 7 * 3 and 0 < figures["rel"] < 1e-2


def test_compare_refuses_shape_mismatch():
    with pytest.raises(ValueError, match="shape"):
        compare(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 4, 3, dtype=torch.float64))


# --- the verdict rule on its own ---------------------------------------------------------------------------

def _metrics(err, worst=None, nan=0, inf=0, ref_nonfinite=0, cancellation=0.5):
    """Metrics whose scaled error is `err` (relative error err / cancellation)."""
    worst = err if worst is None else worst
    return TensorMetrics(err / cancellation, err, 1.0, worst / cancellation, nan, inf, ref_nonfinite,
                         scaled_err=err, worst_head_scaled_err=worst, cancellation=cancellation)


def test_judge_tensor_threshold():
    base = _metrics(4e-3)
    threshold = 3 * 4e-3
    assert judge_tensor("dq", _metrics(threshold * 0.999), base, "bf16").verdict == PASS
    failed = judge_tensor("dq", _metrics(threshold * 1.001), base, "bf16")
    assert failed.verdict == FAIL and "baseline" in failed.why
    assert failed.threshold == pytest.approx(threshold / 0.5)  # shown as a relative error
    assert failed.ratio == pytest.approx(threshold * 1.001 / 4e-3)


def test_judge_tensor_worst_head_and_nonfinite():
    base = _metrics(4e-3, worst=5e-3)
    assert judge_tensor("dk", _metrics(4e-3, worst=0.05), base, "bf16").verdict == FAIL  # one bad head
    nan = judge_tensor("dk", _metrics(4e-3, nan=2), base, "bf16")
    assert nan.verdict == FAIL and "NaN" in nan.why
    # NaN the reference shares is not the candidate's fault, and where the exact values are unknown nothing can
    # be judged: cannot tell, with the reason.
    shared = judge_tensor("dk", _metrics(4e-3, nan=2, ref_nonfinite=2), _metrics(4e-3, ref_nonfinite=2), "bf16")
    assert shared.verdict == INCONCLUSIVE
    assert shared.why.startswith("cannot tell: the float64 reference holds 2 NaN/Inf values")
    # an error that cannot be sized against its terms (their scale overflowed) is attn-doctor's limit, said so
    unsized = judge_tensor("dk", _metrics(math.inf), _metrics(math.inf), "bf16")
    assert unsized.verdict == INCONCLUSIVE and "a limit of attn-doctor's, not the kernel's" in unsized.why
    # The noise floor: a zero-error baseline still lets a candidate within 3 x 0.25 eps (bf16/fp16) or
    # 3 x 1 eps (fp32) of the terms' scale pass.
    assert judge_tensor("out", _metrics(0.7 * EPS["bf16"]), _metrics(0.0), "bf16").verdict == PASS
    assert judge_tensor("out", _metrics(0.8 * EPS["bf16"]), _metrics(0.0), "bf16").verdict == FAIL
    assert judge_tensor("out", _metrics(2.9 * EPS["fp32"]), _metrics(0.0), "fp32").verdict == PASS
    assert judge_tensor("out", _metrics(3.1 * EPS["fp32"]), _metrics(0.0), "fp32").verdict == FAIL


# --- real PyTorch kernels on CPU ----------------------------------------------------------------------------

REAL_CASES = [
    make_case(batch=2, seq=64, heads=4, head_dim=16, dtype="bf16", mask="causal", seed=0),
    make_case(batch=2, seq=64, heads=4, head_dim=16, dtype="bf16", mask="causal", seed=1),
    make_case(batch=2, seq=96, heads=4, kv_heads=2, head_dim=32, dtype="fp16", mask="causal", seed=2),
    make_case(batch=1, seq=64, seq_kv=128, heads=4, kv_heads=1, head_dim=16, dtype="fp16", mask="none", seed=3),
    make_case(batch=2, seq=64, heads=4, kv_heads=2, head_dim=32, dtype="fp32", mask="none", seed=4),
    make_case(batch=2, seq=128, heads=4, head_dim=16, dtype="fp32", mask="causal", seed=5),
    make_case(batch=2, seq=64, heads=4, kv_heads=2, head_dim=16, dtype="bf16", mask="causal", window=(16, 0), seed=6),
]
REAL_SPECS = [
    BackendSpec("sdpa.math", "sdpa", {"kernel": "math"}),
    BackendSpec("sdpa.flash", "sdpa", {"kernel": "flash"}),
    BackendSpec("local", "local"),
]


@pytest.fixture(scope="module")
def real_rows():
    return _run(REAL_CASES, REAL_SPECS, ["contiguous", "sbh3d_packed", "head_slice", "transposed"])


@pytest.mark.slow
def test_real_cpu_kernels_pass(real_rows):
    ran = [row for row in real_rows if row.verdict != SKIP]
    bad = [(row.backend, row.layout, row.case.short(), row.verdict, row.reason) for row in ran if row.verdict != PASS]
    assert not bad
    for row in ran:
        assert set(row.tensors) == set(TENSORS)
        assert all(t.verdict == PASS for t in row.tensors.values())
        assert all(0 < t.rel_err < 10 * EPS[row.case.dtype] for t in row.tensors.values())  # really measured


def test_real_cpu_kernels_all_ran(real_rows):
    """Every backend ran on every case (none silently skipped), and SDPA says which kernel it ran."""
    for case in REAL_CASES:
        for spec in REAL_SPECS:
            rows = [r for r in real_rows if r.case == case and r.backend == spec.name]
            assert {r.layout for r in rows if r.verdict == PASS} >= {"contiguous", "head_slice", "transposed"}
            assert all(r.verdict == PASS or "packs" in r.reason for r in rows)
    flash = [r for r in real_rows if r.backend == "sdpa.flash" and r.verdict == PASS]
    assert all("flash" in r.ran.lower() for r in flash)


def test_every_probe_measures_against_the_one_shared_reference(real_rows):
    """Each case's reference is computed once, in the parent, and opened by every worker (not recomputed)."""
    ran = [row for row in real_rows if row.verdict != SKIP]
    assert ran and {row.extra.get("reference") for row in ran} == {"shared"}


def _run_one_case():
    with Session("cpu", timeout_s=120) as session:
        rows = _run(REAL_CASES[:1], REAL_SPECS, ["contiguous", "transposed"], session)
        return rows, session.references


@pytest.mark.slow
def test_reference_computed_once_per_case_across_families():
    rows, store = _run_one_case()
    assert store.computed == 1 and store.failure is None
    assert {r.family for r in rows} == {"sdpa", "local"}  # two worker processes, one computation
    assert all(r.verdict == PASS and r.extra["reference"] == "shared" for r in rows)


@pytest.mark.slow
def test_workers_compute_the_reference_when_sharing_fails(monkeypatch):
    from attn_doctor.execution import shared_reference

    def no_shared_memory(tensors):
        raise OSError("No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(shared_reference, "export_tensors", no_shared_memory)
        rows, store = _run_one_case()
    assert store.failure == "OSError: No space left on device" and store.computed == 1  # computed, not shared
    assert all(r.verdict == PASS and r.extra["reference"] == "computed" for r in rows)

    with monkeypatch.context() as patch:
        patch.setattr(shared_reference.ReferenceStore, "handle", lambda self, case, layers=None: "bm90IGEgcGlja2xl")  # unopenable
        rows, _ = _run_one_case()
    assert all(r.verdict == PASS and r.extra["reference"] == "computed" for r in rows)


def test_real_cpu_kernels_summary(real_rows):
    faulty = find_faulty(real_rows)
    assert faulty == []
    assert summarize(real_rows).startswith("All ")


# --- faulty kernels, passed as --kernel targets --------------------------------------------------------------

FAULTY_CASES = [
    make_case(batch=2, seq=64, heads=4, head_dim=16, dtype="bf16", mask="causal", seed=0),
    make_case(batch=2, seq=96, heads=4, kv_heads=2, head_dim=32, dtype="bf16", mask="causal", seed=1),
]


@pytest.fixture(scope="module")
def faulty_outcome(faulty_path):
    specs = [parse_kernel_spec(f"{faulty_path}:{name}") for name in FAULTY_NAMES]
    rows = _run(FAULTY_CASES, specs, list(LAYOUTS))
    faulty = find_faulty(rows)
    return rows, faulty, summarize(rows)


def _rows_of(rows, backend):
    found = [row for row in rows if row.backend == backend and row.verdict != SKIP]
    assert found, backend
    return found


def _verdicts(row):
    return {name: t.verdict for name, t in row.tensors.items()}


@pytest.mark.slow
def test_faulty_kernels_ran_on_every_layout(faulty_outcome):
    rows, _, _ = faulty_outcome
    for name in FAULTY_NAMES:
        for case in FAULTY_CASES:
            got = {r.layout for r in rows if r.backend == name and r.case == case and r.verdict != SKIP}
            want = {layout for layout in LAYOUTS if layout_unsupported(layout, case) is None}
            assert got == want, (name, case.short())
    assert not [r for r in rows if r.verdict == "ERROR"]


def test_correct_fp32_kernel_passes(faulty_outcome):
    rows, faulty, _ = faulty_outcome
    for row in _rows_of(rows, "correct_fp32"):
        assert row.verdict == PASS, (row.layout, row.reason)
        assert row.ran.endswith("faulty.py:correct_fp32")
    assert "correct_fp32" not in {f.backend for f in faulty}


def test_dq_two_percent_fails_on_dq_only(faulty_outcome):
    rows, faulty, summary = faulty_outcome
    for row in _rows_of(rows, "dq_two_percent"):
        assert _verdicts(row) == {"out": PASS, "dq": FAIL, "dk": PASS, "dv": PASS}, row.layout
        assert row.tensors["dq"].rel_err == pytest.approx(0.02, rel=0.15)
        assert row.reason.startswith("dq:")
    (entry,) = [f for f in faulty if f.backend == "dq_two_percent"]
    assert entry.tensors == ("dq",) and entry.verdict == FAIL
    assert "dq_two_percent" in summary and "wrong dq " in summary


def test_causal_shift_backward_fails_on_gradients_only(faulty_outcome):
    rows, faulty, summary = faulty_outcome
    for row in _rows_of(rows, "causal_shift_backward"):
        assert _verdicts(row) == {"out": PASS, "dq": FAIL, "dk": FAIL, "dv": FAIL}, row.layout
    (entry,) = [f for f in faulty if f.backend == "causal_shift_backward"]
    assert entry.tensors == ("dq", "dk", "dv")
    assert "causal_shift_backward" in summary


def test_nan_in_one_dk_head_fails_on_dk(faulty_outcome):
    rows, faulty, summary = faulty_outcome
    for row in _rows_of(rows, "nan_one_head_dk"):
        assert _verdicts(row) == {"out": PASS, "dq": PASS, "dk": FAIL, "dv": PASS}, row.layout
        case = row.case
        assert row.tensors["dk"].nan == case.batch * case.seq_kv * case.head_dim  # exactly one kv head
        assert "NaN" in row.reason and row.reason.startswith("dk:")
    (entry,) = [f for f in faulty if f.backend == "nan_one_head_dk"]
    assert entry.tensors == ("dk",)
    assert "nan_one_head_dk" in summary


def test_ignores_strides_fails_only_on_views(faulty_outcome):
    rows, faulty, summary = faulty_outcome
    for row in _rows_of(rows, "ignores_strides"):
        if row.layout == "contiguous":
            assert row.verdict == PASS, row.reason
        else:
            assert row.verdict == FAIL, row.layout
            assert row.tensors["out"].verdict == FAIL, row.layout  # the forward already reads garbage
    (entry,) = [f for f in faulty if f.backend == "ignores_strides"]
    assert set(entry.layouts) == set(VIEW_LAYOUTS)
    assert "out" in entry.tensors
    assert "ignores_strides" in summary and "a wrong forward" in summary


def test_faulty_summary_names_exactly_the_faulty_kernels(faulty_outcome):
    _, faulty, summary = faulty_outcome
    assert {f.backend for f in faulty} == set(FAULTY_NAMES) - {"correct_fp32"}
    assert summary.startswith("Faulty: ")
    assert "correct_fp32" not in summary
    assert "local" not in {f.backend for f in faulty}


def test_baseline_rows_are_the_reference_of_the_ratios(faulty_outcome):
    rows, _, _ = faulty_outcome
    baselines = [r for r in rows if r.backend == "local"]
    assert len(baselines) == len(FAULTY_CASES)
    for row in baselines:
        assert row.layout == "contiguous" and row.verdict == PASS
        # Its own yardstick: ratio 1, or below 1 where rounding noise is the larger yardstick.
        assert all(t.ratio == 1.0 if t.yardstick_kind == "baseline" else t.ratio < 1.0 for t in row.tensors.values())


def test_the_output_rounding_part_of_dq_is_the_excess_of_a_flash_style_backward_over_an_unfused_one():
    """`numerics.rounded_output`: with keys sharing a large direction, a flash-style backward's dQ (D from the
    output it returned) is far less accurate than an unfused one's, and the predicted part points where the
    excess does; with no shared direction the part is within ordinary rounding."""
    from attn_doctor.numerics.rounded_output import output_rounding_gradients
    from tests.models import hand_attention

    generator = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 64, 2, 16
    shared = 6 * torch.randn(h, d, generator=generator) / d ** 0.5
    q, k, v, dout = (torch.randn(b, s, h, d, generator=generator) for _ in range(4))
    for shift, excess in ((1.0, True), (0.0, False)):
        q16, k16, v16, dout16 = (t.to(torch.bfloat16) for t in (q, k + shift * shared, v, dout))
        exact = attention_reference(q16, k16, v16, dout16, softmax_scale=d ** -0.5, causal=True, with_terms=False)
        dqs = {}
        for kind in ("flash", "unfused"):
            q_, k_, v_ = (t.clone().requires_grad_() for t in (q16, k16, v16))
            out = hand_attention.KINDS[kind]()(q_, k_, v_)
            out.backward(dout16)
            dqs[kind], dqs[f"{kind} out"] = q_.grad.double(), out.detach()
        moved = output_rounding_gradients(q16, k16, dout16, exact.out, dqs["flash out"], softmax_scale=d ** -0.5,
                                          causal=True)["dq"]
        error = {kind: float((dqs[kind] - exact.dq).norm() / exact.dq.norm()) for kind in ("flash", "unfused")}
        part = float(moved.norm() / exact.dq.norm())
        if excess:
            assert error["flash"] > 2 * error["unfused"] and part > error["unfused"]
            gap = (dqs["flash"] - dqs["unfused"]).flatten()
            assert float(gap @ moved.flatten() / gap.norm() / moved.norm()) > 0.5
        else:
            assert error["flash"] < 1.5 * error["unfused"] and part < error["unfused"]  # ordinary rounding


def test_the_output_rounding_part_explains_pytorchs_own_flash_kernel_on_shared_keys():
    """PyTorch's CPU FlashAttention kernel (a real flash-style backward): on keys sharing a large direction its
    dQ is several times the math kernel's error from float64, and `numerics.rounded_output` (D from the output
    the kernel returned) is most of that excess, in its direction."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from attn_doctor.numerics.rounded_output import output_rounding_gradients

    generator = torch.Generator().manual_seed(0)
    b, s, h, d = 2, 256, 4, 64
    shared = torch.randn(h, d, generator=generator)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=generator) for _ in range(4))
    q, k, v, dout = (t.to(torch.bfloat16) for t in (q, k + 24 * shared / shared.norm(dim=-1, keepdim=True), v, dout))
    exact = attention_reference(q, k, v, dout, softmax_scale=d ** -0.5, causal=True, with_terms=False)
    dq, out = {}, {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        q_, k_, v_ = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
        with sdpa_kernel(backend):
            result = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
        result.backward(dout.transpose(1, 2))
        dq[backend], out[backend] = q_.grad.transpose(1, 2).double(), result.detach().transpose(1, 2)
    error = {backend: float((dq[backend] - exact.dq).norm() / exact.dq.norm()) for backend in dq}
    assert error[SDPBackend.FLASH_ATTENTION] > 3 * error[SDPBackend.MATH]  # 9.3e-3 against 1.7e-3
    moved = output_rounding_gradients(q, k, dout, exact.out, out[SDPBackend.FLASH_ATTENTION], softmax_scale=d ** -0.5,
                                      causal=True)["dq"]
    gap = (dq[SDPBackend.FLASH_ATTENTION] - dq[SDPBackend.MATH]).flatten()
    assert float(moved.norm() / exact.dq.norm()) > 0.5 * float(gap.norm() / exact.dq.norm())
    assert float(gap @ moved.flatten() / gap.norm() / moved.norm()) > 0.6  # 0.8


def test_reference_term_magnitudes_stay_finite_where_a_row_sum_is_tiny():
    """A seeded "outliers" case whose bound-shifted row sums came out near 1e-200: dividing dO by them and
    squaring overflowed the term magnitudes (NaN), so every path's error measured infinite and no verdict
    meant anything. Such rows are now redone with the exact maximum."""
    from attn_doctor.core.case import make_case
    from attn_doctor.probes.caches import Caches

    case = make_case(batch=2, seq=2, heads=2, head_dim=16, dtype="fp32", mask="causal", seed=55491064,
                     inputs="outliers")
    _, reference = Caches(torch.device("cpu")).case.get(case)
    for name in ("out", "dq", "dk", "dv"):
        assert torch.isfinite(reference.terms(name)).all(), name


def test_a_bitwise_equal_tensor_reuses_the_metrics_of_the_one_compared_before(monkeypatch):
    """The same kernel on another layout returns the same values: the probe reuses their metrics (compare is
    not called again), and the rows are the same as when each was compared; a different tensor, or one holding
    NaN (never equal to itself), is compared."""
    from attn_doctor.backends import build, select
    from attn_doctor.core.coords import Coords
    from attn_doctor.probes import call
    from attn_doctor.probes.caches import Caches, Measured

    case = make_case(batch=1, seq=32, heads=2, head_dim=16, dtype="bf16", mask="causal")
    (spec,) = select(["sdpa.math"])
    calls = []
    compare = call.compare
    monkeypatch.setattr(call, "compare", lambda *a, **k: calls.append(1) or compare(*a, **k))
    caches = Caches(torch.device("cpu"))
    backend = build(spec)
    first = call.run(backend, Coords.call(case, spec, "contiguous"), caches)
    compared = len(calls)
    again = call.run(backend, Coords.call(case, spec, "transposed"), caches)
    assert compared == 4 and len(calls) == 4  # nothing compared the second time: equal tensors
    assert again.metrics == first.metrics
    fresh = call.run(backend, Coords.call(case, spec, "transposed"), Caches(torch.device("cpu")))
    assert fresh.metrics == first.metrics  # what comparing them again gives

    kept = Measured(torch.device("cpu"))
    x = torch.ones(4)
    kept.keep("dq", x, "metrics of x")
    assert kept.find("dq", x.clone()) == "metrics of x" and kept.find("dq", x + 1) is None
    assert kept.find("dk", x) is None  # per tensor name
    nan = torch.full((4,), math.nan)
    kept.keep("out", nan, "metrics of nan")
    assert kept.find("out", nan) is None


def test_workers_on_a_cpu_share_its_cores(monkeypatch):
    from attn_doctor.execution.session import cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert cpu_threads("cpu", 2) == {"OMP_NUM_THREADS": "4"} and cpu_threads("cpu", 16) == {"OMP_NUM_THREADS": "1"}
    assert cpu_threads("cuda:0", 2) == {}
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads("cpu", 2) == {}  # the user's setting stands
