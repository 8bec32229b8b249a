"""TE's whole attention API as case dimensions (issue 16): the case vocabulary and its refusals, the float64
reference against an independent dense computation for every mask type, length pattern, bias and softmax
type, thd packing, every correct CPU path passing on every feature, faults that only a feature exposes caught
and named, the empty-row and padding rules, the FP8 yardstick, and the coverage recipe."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from attn_doctor.backends import select
from attn_doctor.backends.kernel import parse_kernel_spec
from attn_doctor.cli.options import build_cases
from attn_doctor.core import layouts
from attn_doctor.core.case import Case, expand_grids, make_case
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import BadInput
from attn_doctor.numerics import fp8_simulation, views
from attn_doctor.numerics.inputs import make_inputs
from attn_doctor.numerics.masks import alibi_slopes, describe
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.numerics.reference import attention_reference, naive_reference
from attn_doctor.probes import Caches, run_probe
from attn_doctor.results.row import Row
from attn_doctor.verdict.judge import judge
from attn_doctor.verdict.rule import EPS, FAIL, PASS, SKIP, judge_tensor

CPU = torch.device("cpu")
FEATURES = "tests/kernels/features.py"
BASELINE = select(["local"])[0]
CORRECT_PATHS = [spec for spec in select(["sdpa"]) if spec.name in ("sdpa.math", "sdpa.flash")] + [
    parse_kernel_spec(f"{FEATURES}:correct")]
SMALL = dict(heads=4, head_dim=16, dtype="fp32")


# --- the case vocabulary --------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, says", [
    (dict(qkv_format="thd"), "add --seqlens"),
    (dict(qkv_format="thd", seqlens=(8, 4), mask="causal"), "--mask padding_causal"),
    (dict(seqlens=(8, 4), mask="causal"), "use --mask padding_causal"),
    (dict(mask="arbitrary"), "--mask-source random:P"),
    (dict(mask="arbitrary", mask_source="block:3"), "expected random:P"),
    (dict(mask_source="random:0.5"), "--mask arbitrary"),
    (dict(pad_between_seqs=True, seqlens=(8, 4), mask="padding"), "--qkv-format thd"),
    (dict(fp8="delayed", dtype="fp32"), "bf16"),
    (dict(seqlens=(8, 40), seq=16, mask="padding"), "longer than the padded length"),
    (dict(seqlens=(8, 4), seq=8, seq_kv=12, mask="padding"), "needs --seqlens-kv"),
    (dict(seqlens=(8, -1), mask="padding"), ">= 0"),
    (dict(bias="post_scale_bias:h1ss"), "unknown bias"),
    (dict(mask="arbitrary", mask_source="random:0.5", window=(2, 2)), "no sliding window with an arbitrary mask"),
])
def test_impossible_cases_are_refused_with_the_fix(fields, says):
    with pytest.raises(BadInput, match=says):
        make_case(**{"batch": 2, "seq": 8, **fields})


def test_lengths_set_the_batch_and_the_padded_length_and_read_back():
    case = make_case(seqlens=(512, 387, 0, 1), mask="padding_causal", qkv_format="thd", heads=4, head_dim=16)
    assert (case.batch, case.seq, case.seq_kv) == (4, 512, 512)
    assert case.lengths_q() == case.lengths_kv() == (512, 387, 0, 1)
    assert case.seqlens_kv is None  # self-attention: the kv lengths are the q ones
    assert Case.from_dict(case.to_dict()) == case
    assert "--seqlens 512,387,0,1" in case.cli_flags() and "--qkv-format thd" in case.cli_flags()
    assert case.short().endswith("padding_causal thd lens 512,387,0,1")


def test_the_dense_api_reads_as_it_always_did():
    case = make_case(mask="none", head_dim_v=64)
    assert case.mask == "no_mask" and not case.mla  # "none" is TE's no_mask; equal dims: no MLA
    assert set(case.to_dict()) == {"batch", "seq", "heads", "head_dim", "kv_heads", "seq_kv", "dtype", "mask",
                                   "window", "seed"}
    assert case.api_features() == []


def test_a_grid_drops_what_the_api_cannot_take_and_says_why():
    cases, dropped = expand_grids({"batch": 2, "seq": 8}, [{"qkv_format": ["bshd", "thd"], "mask": ["causal",
                                                                                                     "padding"]}],
                                  drop_invalid=True)
    assert {(c.qkv_format, c.mask) for c in cases} == {("bshd", "causal"), ("bshd", "padding")}
    assert len(dropped) == 2 and all("seqlens" in why for why in dropped)
    with pytest.raises(BadInput):
        expand_grids({"batch": 2, "seq": 8}, [{"qkv_format": ["thd"]}])


def test_the_coverage_recipe_walks_every_feature():
    cases, dropped, depths, degrees, recipe_layouts = build_cases({"recipe": "te-coverage"})
    assert depths is None and degrees is None and dropped
    assert recipe_layouts == ["contiguous"]
    seen = {name: {getattr(c, name) for c in cases} for name in
            ("qkv_format", "mask", "bias", "softmax", "fp8", "dtype", "head_dim", "pad_between_seqs")}
    assert seen["qkv_format"] == {"sbhd", "bshd", "thd"}
    assert seen["mask"] == {"no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                            "padding_causal_bottom_right", "arbitrary"}
    assert {"alibi", "post_scale_bias:1hss", "post_scale_bias:111s"} <= seen["bias"]
    assert seen["softmax"] == {"vanilla", "off-by-one", "learnable"} and seen["fp8"] == {"none", "delayed", "current"}
    assert seen["dtype"] == {"bf16", "fp16", "fp32"} and {32, 64, 128, 256} <= seen["head_dim"]
    assert {(c.head_dim, c.head_dim_v) for c in cases if c.mla} == {(192, 128), (128, 64), (256, 128)}
    assert any(c.window for c in cases if c.qkv_format == "thd") and any(c.seq_kv != c.seq for c in cases)
    assert any(0 in c.lengths_q() and 1 in c.lengths_q() for c in cases)  # empty and one-token sequences
    assert any(c.kv_heads != c.heads for c in cases if c.qkv_format == "thd")


# --- the reference against an independent dense float64 computation ---------------------------------------------

def _te_visible(case: Case) -> torch.Tensor:
    """[batch, 1, seq_q, seq_kv]: TE's get_full_mask written out pair by pair (True = visible)."""
    out = torch.zeros(case.batch, 1, case.seq, case.seq_kv, dtype=torch.bool)
    left, right = case.window if case.window is not None else (-1, -1)
    if "causal" in case.mask:
        right = 0
    for b in range(case.batch):
        len_q, len_kv = case.lengths_q()[b], case.lengths_kv()[b]
        bottom_right = case.mask.endswith("bottom_right") or (
            case.mask in ("no_mask", "padding", "arbitrary") and case.window is not None)
        diag = len_kv - len_q if bottom_right else 0
        for i in range(len_q):
            for j in range(len_kv):
                lo_ok = left < 0 or j >= i + diag - left
                hi_ok = right < 0 or j <= i + diag + right
                out[b, 0, i, j] = lo_ok and hi_ok
    return out


def _te_alibi(case: Case) -> torch.Tensor:
    """[batch, heads, seq_q, seq_kv]: TE's get_alibi written out (its slope formula, -slope |i - j + off|)."""
    n = 2 ** int(math.log2(case.heads))
    slopes = [2 ** (-8 * (k + 1) / n) for k in range(n)] + [2 ** (-4 * k / n) for k in range(1, 2 * (case.heads - n), 2)]
    out = torch.zeros(case.batch, case.heads, case.seq, case.seq_kv, dtype=torch.float64)
    for b in range(case.batch):
        off = 0 if case.mask in ("causal", "padding_causal") else case.lengths_kv()[b] - case.lengths_q()[b]
        for i in range(case.seq):
            for j in range(case.seq_kv):
                out[b, :, i, j] = -torch.tensor(slopes, dtype=torch.float64) * abs(i - j + off)
    return out


REFERENCE_CASES = {
    "no_mask cross": dict(batch=2, seq=12, seq_kv=9, mask="no_mask"),
    "causal top-left, more queries": dict(batch=2, seq=12, seq_kv=7, mask="causal"),
    "causal bottom-right, more queries": dict(batch=2, seq=12, seq_kv=7, mask="causal_bottom_right"),
    "causal bottom-right, more keys": dict(batch=2, seq=7, seq_kv=12, mask="causal_bottom_right", kv_heads=2),
    "padding ragged with 0 and 1": dict(seqlens=(11, 0, 1, 6), seq=12, mask="padding"),
    "padding_causal ragged": dict(seqlens=(11, 0, 1, 6), seqlens_kv=(5, 3, 0, 9), seq=12, seq_kv=10,
                                  mask="padding_causal"),
    "padding_causal_bottom_right ragged": dict(seqlens=(11, 2, 1, 6), seqlens_kv=(5, 3, 4, 9), seq=12, seq_kv=10,
                                               mask="padding_causal_bottom_right", kv_heads=2),
    "window no_mask (bottom-right)": dict(batch=2, seq=12, seq_kv=9, mask="no_mask", window=(3, 2)),
    "window causal (top-left)": dict(batch=2, seq=12, seq_kv=9, mask="causal", window=(3, 0)),
    "window padding ragged": dict(seqlens=(11, 1, 6), seq=12, mask="padding", window=(2, 1)),
    "arbitrary": dict(batch=2, seq=10, seq_kv=8, mask="arbitrary", mask_source="random:0.6"),
    "bias 1hss": dict(batch=2, seq=10, mask="causal", bias="post_scale_bias:1hss"),
    "bias b1ss padding": dict(seqlens=(10, 3), seq=10, mask="padding", bias="post_scale_bias:b1ss"),
    "bias bhss": dict(batch=2, seq=10, seq_kv=6, mask="no_mask", bias="post_scale_bias:bhss"),
    "bias 111s": dict(batch=2, seq=10, mask="causal", bias="post_scale_bias:111s"),
    "bias 11ss": dict(batch=2, seq=10, mask="no_mask", bias="post_scale_bias:11ss"),
    "alibi causal": dict(batch=2, seq=10, mask="causal", bias="alibi", heads=6),
    "alibi bottom-right padded": dict(seqlens=(10, 4), seqlens_kv=(7, 9), seq=10, seq_kv=9,
                                      mask="padding_causal_bottom_right", bias="alibi"),
    "off-by-one": dict(batch=2, seq=10, mask="causal", softmax="off-by-one"),
    "learnable": dict(batch=2, seq=10, mask="no_mask", softmax="learnable", kv_heads=2),
    "learnable padded bottom-right with empty rows": dict(seqlens=(10, 0, 3), seqlens_kv=(4, 2, 6), seq=10, seq_kv=6,
                                                          mask="padding_causal_bottom_right", softmax="learnable"),
    "learnable alibi window": dict(batch=2, seq=10, seq_kv=12, mask="no_mask", softmax="learnable", bias="alibi",
                                   window=(4, 1)),
    "MLA": dict(batch=2, seq=10, mask="causal", head_dim=24, head_dim_v=8),
    "MLA ragged thd": dict(seqlens=(10, 1, 0), seq=10, mask="padding_causal", head_dim=24, head_dim_v=8,
                           qkv_format="thd"),
}


@pytest.mark.parametrize("fields", REFERENCE_CASES.values(), ids=list(REFERENCE_CASES))
@pytest.mark.parametrize("tiles", ["one tile", "small tiles"])
def test_reference_matches_an_independent_dense_computation(fields, tiles, monkeypatch):
    from attn_doctor.numerics import reference

    if tiles == "small tiles":
        monkeypatch.setattr(reference, "MAX_TILE_COLS", 4)
    case = make_case(**{**SMALL, **fields})
    x = make_inputs(case, CPU)
    got = attention_reference(x.q, x.k, x.v, x.dout, softmax_scale=case.softmax_scale, semantics=x.semantics,
                              block_bytes=None if tiles == "one tile" else 1)
    allowed = _te_visible(case)
    if case.mask == "arbitrary":
        allowed &= x.semantics.allowed
    bias = _te_alibi(case) if case.bias == "alibi" else x.semantics.bias
    want = naive_reference(x.q, x.k, x.v, x.dout, softmax_scale=case.softmax_scale, allowed=allowed, bias=bias,
                           sink=x.semantics.sink)
    names = ["out", "dq", "dk", "dv"] + (["dsink"] if case.softmax == "learnable" else [])
    for name in names:
        a, b = getattr(got, name), getattr(want, name)
        assert a.shape == b.shape, name
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12), (name, float((a - b).abs().max()))
        assert torch.allclose(got.terms(name), want.terms(name), rtol=1e-10, atol=1e-14), name
    if case.softmax != "learnable":
        assert got.dsink is None


COMBINATIONS, _ = expand_grids(
    {**SMALL, "seq": 9, "seq_kv": 11, "batch": 3},
    [{"mask": ["no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right",
               "arbitrary"],
      "seqlens": [None, (9, 0, 4)], "seqlens_kv": [None, (2, 11, 0)], "window": [None, (2, 1), (3, 0)],
      "bias": ["no_bias", "post_scale_bias:b1ss", "alibi"], "softmax": ["vanilla", "learnable"],
      "mask_source": [None, "random:0.4"], "kv_heads": [2]}], drop_invalid=True)


@pytest.mark.parametrize("case", COMBINATIONS, ids=[c.short() for c in COMBINATIONS])
def test_reference_matches_the_dense_computation_on_every_combination(case):
    """Every mask type x lengths (none, ragged with an empty sequence on either side) x window x bias x
    softmax, cross-attention with GQA: the tiled reference against the plain formula on TE's mask written out."""
    x = make_inputs(case, CPU)
    got = attention_reference(x.q, x.k, x.v, x.dout, softmax_scale=case.softmax_scale, semantics=x.semantics,
                              block_bytes=1)
    allowed = _te_visible(case) & (x.semantics.allowed if case.mask == "arbitrary" else True)
    bias = _te_alibi(case) if case.bias == "alibi" else x.semantics.bias
    want = naive_reference(x.q, x.k, x.v, x.dout, softmax_scale=case.softmax_scale, allowed=allowed, bias=bias,
                           sink=x.semantics.sink)
    for name in ["out", "dq", "dk", "dv"] + (["dsink"] if case.softmax == "learnable" else []):
        assert torch.allclose(getattr(got, name), getattr(want, name), rtol=1e-11, atol=1e-12), name


def test_the_combinations_cover_every_mask_type_and_both_sides_ragged():
    assert len(COMBINATIONS) > 150
    assert {c.mask for c in COMBINATIONS} == {"no_mask", "causal", "causal_bottom_right", "padding", "padding_causal",
                                              "padding_causal_bottom_right", "arbitrary"}
    assert any(c.seqlens and c.seqlens_kv and c.window and c.bias == "alibi" and c.softmax == "learnable"
               for c in COMBINATIONS)


def test_alibi_slopes_are_tes():
    assert alibi_slopes(8).tolist() == [2 ** (-k) for k in range(1, 9)]
    assert len(alibi_slopes(12)) == 12 and alibi_slopes(12)[8] == 2 ** (-0.5)


# --- thd packing --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["contiguous", "qkv_3hd", "qkv_h3d", "kv_2hd", "kv_h2d", "head_slice"])
@pytest.mark.parametrize("pad_between", [False, True])
def test_thd_packs_each_sequence_in_its_slot_and_unpacks_exactly(layout, pad_between):
    case = make_case(seqlens=(5, 0, 1, 3), seq=6, mask="padding", qkv_format="thd", pad_between_seqs=pad_between,
                     **SMALL)
    x = make_inputs(case, CPU)
    packed = layouts.packing(case)
    qkv = views.build(layout, x.q, x.k, x.v, "thd", packed)
    total = packed.cu_seqlens("q", padded=True)[-1]
    assert qkv.q.shape == (total, case.heads, case.head_dim)
    assert packed.cu_seqlens("q") == [0, 5, 5, 6, 9]
    assert packed.cu_seqlens("q", padded=True) == ([0, 6, 12, 18, 24] if pad_between else [0, 5, 5, 6, 9])
    for name, t, side in (("q", x.q, "q"), ("k", x.k, "kv"), ("v", x.v, "kv")):
        back = views.to_bshd(getattr(qkv, name).detach(), "thd", packed, side)
        for b, n in enumerate(case.lengths_q()):
            assert torch.equal(back[b, :n], t[b, :n]), (name, b)
    if layout.startswith(("qkv_", "kv_")):
        assert qkv.k.untyped_storage().data_ptr() == qkv.v.untyped_storage().data_ptr()  # one buffer


def test_pad_between_seqs_slots_leave_padding_after_each_sequence():
    case = make_case(seqlens=(5, 0, 8, 3), seq=8, mask="padding", qkv_format="thd", pad_between_seqs=True, **SMALL)
    packed = layouts.packing(case)
    assert packed.slots_q == (8, 8, 8, 8)  # rounded up past the next multiple of 8, at most the padded length
    assert packed.cu_seqlens("q") == [0, 5, 5, 13, 16] and packed.cu_seqlens("q", padded=True) == [0, 8, 16, 24, 32]


# --- every correct path on every feature; faults only a feature exposes -----------------------------------------

def _rows(case: Case, specs, layout: str = "contiguous") -> dict[str, Row]:
    caches = Caches(CPU)
    rows = []
    for spec in [BASELINE, *specs]:
        from attn_doctor.backends import build, static_skip

        coords = Coords.call(case, spec, layout)
        reason = static_skip(spec, case, "cpu") or coords.unsupported()
        if reason:
            rows.append(Row(coords=coords, verdict=SKIP, reason=reason))
            continue
        outcome = run_probe(build(spec), coords, caches)
        rows.append(Row(coords=coords, verdict={"ok": "", "skip": SKIP}[outcome.status], ran=outcome.ran,
                        reason=outcome.reason, metrics=outcome.metrics, extra=outcome.extra))
    return {row.backend: row for row in judge(rows)}


FEATURE_CASES = {
    "thd ragged padding_causal GQA": dict(seqlens=(30, 17, 1, 0), seq=32, mask="padding_causal", qkv_format="thd",
                                          kv_heads=2),
    "bshd cross padding_causal_bottom_right": dict(seqlens=(30, 17, 5), seqlens_kv=(20, 31, 0), seq=32, seq_kv=40,
                                                   mask="padding_causal_bottom_right", qkv_format="bshd"),
    "causal_bottom_right, rows that see nothing": dict(batch=2, seq=40, seq_kv=24, mask="causal_bottom_right"),
    "window padding": dict(seqlens=(30, 9), seq=32, mask="padding", window=(4, 2)),
    "arbitrary": dict(batch=2, seq=24, mask="arbitrary", mask_source="random:0.7"),
    "bias b1ss + alibi-free": dict(batch=2, seq=24, mask="causal", bias="post_scale_bias:b1ss"),
    "alibi": dict(batch=2, seq=24, seq_kv=32, mask="no_mask", bias="alibi"),
    "MLA": dict(batch=2, seq=24, mask="causal", head_dim=32, head_dim_v=16),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("fields", FEATURE_CASES.values(), ids=list(FEATURE_CASES))
def test_every_correct_path_passes_every_feature(fields, dtype):
    case = make_case(**{**SMALL, **fields, "dtype": dtype})
    rows = _rows(case, CORRECT_PATHS)
    assert rows["local"].verdict == PASS and rows["correct"].verdict == PASS, rows["correct"].reason
    ran = [name for name, row in rows.items() if row.verdict != SKIP]
    assert {"sdpa.math", "correct"} <= set(ran)
    assert all(rows[name].verdict == PASS for name in ran), {n: rows[n].reason for n in ran}


def test_sinks_are_judged_with_their_gradient_and_skipped_where_unsupported():
    case = make_case(**{**SMALL, "batch": 2, "seq": 24, "mask": "causal", "softmax": "learnable", "dtype": "bf16"})
    rows = _rows(case, CORRECT_PATHS + [parse_kernel_spec(f"{FEATURES}:sink_in_forward_only")])
    assert rows["correct"].verdict == PASS and "dsink" in rows["correct"].tensors
    assert rows["sdpa.math"].verdict == SKIP and "sink" in rows["sdpa.math"].reason
    faulty = rows["sink_in_forward_only"]
    assert faulty.verdict == FAIL and faulty.tensors["dsink"].verdict == FAIL
    assert faulty.tensors["out"].verdict == PASS  # the forward is right: only the backward shows it


def test_a_kernel_that_ignores_padding_in_its_backward_is_caught_on_the_key_gradients():
    case = make_case(**{**SMALL, "seqlens": (30, 9, 17), "seq": 32, "mask": "padding_causal", "dtype": "bf16"})
    rows = _rows(case, [parse_kernel_spec(f"{FEATURES}:backward_ignores_padding")])
    row = rows["backward_ignores_padding"]
    assert row.verdict == FAIL and row.tensors["out"].verdict == PASS
    assert {"dq", "dk", "dv"} & set(row.failing_tensors)
    dense = make_case(**{**SMALL, "batch": 3, "seq": 32, "mask": "causal", "dtype": "bf16"})
    assert _rows(dense, [parse_kernel_spec(f"{FEATURES}:backward_ignores_padding")])[
        "backward_ignores_padding"].verdict == PASS  # nothing to ignore without padding


def test_top_left_where_bottom_right_was_asked_is_caught():
    spec = parse_kernel_spec(f"{FEATURES}:top_left_always")
    asked = make_case(**{**SMALL, "batch": 2, "seq": 24, "seq_kv": 40, "mask": "causal_bottom_right", "dtype": "bf16"})
    assert _rows(asked, [spec])["top_left_always"].tensors["out"].verdict == FAIL
    square = make_case(**{**SMALL, "batch": 2, "seq": 24, "mask": "causal_bottom_right", "dtype": "bf16"})
    assert _rows(square, [spec])["top_left_always"].verdict == PASS  # the same diagonal when seq_q == seq_kv


def test_rows_that_see_no_key_have_their_own_rule():
    case = make_case(**{**SMALL, "batch": 2, "seq": 24, "seq_kv": 12, "mask": "causal_bottom_right", "dtype": "bf16"})
    rows = _rows(case, CORRECT_PATHS + [parse_kernel_spec(f"{FEATURES}:empty_rows_mean_of_v")])
    assert rows["correct"].tensors["out"].empty_rows == 2 * 12 * case.heads
    assert rows["correct"].verdict == PASS
    wrong = rows["empty_rows_mean_of_v"]
    assert wrong.tensors["out"].verdict == FAIL and "see no key" in wrong.tensors["out"].why


def test_the_empty_row_rule_on_both_sides():
    base = TensorMetrics(1e-3, 1e-3, 1.0, 1e-3, 0, 0, 0, scaled_err=1e-3, worst_head_scaled_err=1e-3, empty_rows=8)
    exact_zero = judge_tensor("out", base, base, "bf16")
    rounding = judge_tensor("out", TensorMetrics(**{**base.to_dict(), "empty_rows_max": 0.5 * EPS["bf16"]}), base,
                            "bf16")
    written = judge_tensor("out", TensorMetrics(**{**base.to_dict(), "empty_rows_max": 0.3}), base, "bf16")
    nan = judge_tensor("out", TensorMetrics(**{**base.to_dict(), "empty_rows_nonfinite": 3}), base, "bf16")
    assert (exact_zero.verdict, rounding.verdict, written.verdict, nan.verdict) == (PASS, PASS, FAIL, FAIL)


def test_writing_into_padding_is_flagged_not_failed():
    case = make_case(**{**SMALL, "seqlens": (30, 9), "seq": 32, "mask": "padding", "dtype": "bf16"})
    rows = _rows(case, [parse_kernel_spec(f"{FEATURES}:writes_into_padding"), parse_kernel_spec(f"{FEATURES}:correct")])
    flagged = rows["writes_into_padding"]
    assert flagged.verdict == PASS
    padded_values = (2 + 23) * case.heads * case.head_dim
    assert flagged.padding_writes["out"] == (padded_values, padded_values)
    assert rows["correct"].padding_writes == {}


def test_an_old_kernel_is_skipped_where_its_signature_cannot_say_the_case():
    spec = parse_kernel_spec("tests/kernels/faulty.py:correct_fp32")
    from attn_doctor.backends import static_skip

    window = make_case(**{**SMALL, "batch": 1, "seq": 8, "mask": "no_mask", "window": (2, 2)})
    assert "allowed" in static_skip(spec, window, "cpu")
    assert static_skip(spec, make_case(**{**SMALL, "batch": 1, "seq": 8}), "cpu") is None
    assert "softmax_offset" in static_skip(spec, make_case(**{**SMALL, "batch": 1, "seq": 8, "softmax": "learnable"}),
                                           "cpu")


# --- FP8: its own yardstick --------------------------------------------------------------------------------------

def test_fp8_quantisation_rounds_to_the_format_and_passes_gradients_rounded():
    x = torch.randn(64, 64, dtype=torch.float32).requires_grad_()
    y = fp8_simulation.quantize(x, "e4m3", "e5m2")
    scale = torch.finfo(torch.float8_e4m3fn).max / x.detach().abs().amax()
    on_grid = y.detach() * scale
    assert torch.allclose(on_grid.to(torch.float8_e4m3fn).float(), on_grid, rtol=1e-6, atol=0)
    assert 0 < float((y - x).detach().abs().max()) < 0.1 * float(x.detach().abs().max())
    (grad,) = torch.autograd.grad(y, x, torch.randn(64, 64) * 1e-3)
    assert len(torch.unique(grad)) < grad.numel()  # rounded to e5m2's grid


def test_the_fp8_baseline_is_a_quantised_attention_far_from_the_bf16_one():
    from attn_doctor.backends import build

    case = make_case(**{**SMALL, "batch": 2, "seq": 64, "head_dim": 32, "dtype": "bf16", "fp8": "delayed"})
    x = make_inputs(case, CPU)
    ref = attention_reference(x.q, x.k, x.v, x.dout, softmax_scale=case.softmax_scale, semantics=x.semantics)
    local = build(BASELINE)
    errors = {}
    for fp8 in ("delayed", "none"):
        c = make_case(**{**case.to_dict(), "fp8": fp8})
        q, k, v = (t.transpose(0, 1).detach().requires_grad_() for t in (x.q, x.k, x.v))
        out = local.forward(q, k, v, c, x.semantics).transpose(0, 1)
        errors[fp8] = float((out.double() - ref.out).norm() / ref.out.norm())
    assert errors["delayed"] > 4 * errors["none"]  # quantisation dominates: never the bf16 yardstick


@pytest.mark.parametrize("fp8, steps", [("delayed", 2), ("current", 1), ("none", 1)])
def test_delayed_fp8_is_judged_after_one_warm_up_step_with_the_same_output_gradient(fp8, steps, monkeypatch):
    from attn_doctor.backends import build

    case = make_case(**{**SMALL, "batch": 1, "seq": 16, "head_dim": 16, "dtype": "bf16", "fp8": fp8})
    local = build(BASELINE)
    forward, gradients = local.forward, []

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.register_hook(lambda g: gradients.append(g.detach().clone()))
        return out

    monkeypatch.setattr(local, "forward", recording)
    outcome = run_probe(local, Coords.call(case, BASELINE, "contiguous"), Caches(CPU))
    assert outcome.status == "ok" and len(gradients) == steps
    assert all(torch.equal(g, gradients[-1]) for g in gradients)  # the warm-up saw the measured dout


def test_fp8_on_the_cpu_is_refused(run_cli):
    result = run_cli(["run", "--fp8", "delayed", "--device", "cpu", "--batch", "1", "--seq", "8", "--heads", "2",
                      "--head-dim", "8"])
    assert result.exit_code == 2 and "FP8" in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, says", [
    (["--qkv-format", "thd"], "--seqlens"),
    (["--mask", "arbitrary"], "--mask-source"),
    (["--seqlens", "8,4", "--mask", "causal"], "padding"),
    (["--seqlens", "8,x", "--mask", "padding"], "whole numbers"),
    (["--seqlens", "8,4", "--mask", "padding", "--tp", "2"], "single call"),
    (["--softmax-scale", "-0.5"], "positive number"),
    (["--softmax-scale", "x"], "numbers"),
])
def test_bad_api_flags_exit_2_with_one_line(run_cli, flags, says):
    result = run_cli(["run", "--batch", "2", "--seq", "8", "--heads", "2", "--head-dim", "8", "--device", "cpu",
                      *flags])
    assert result.exit_code == 2, result.output
    assert says in result.stderr and len(result.stderr.strip().splitlines()) == 1


# --- what the output states ------------------------------------------------------------------------------------

def test_the_case_description_states_conventions():
    lines = " ".join(describe(make_case(batch=1, seq=8, mask="arbitrary", mask_source="random:0.5", bias="alibi",
                                        heads=4)))
    assert "dropout 0" in lines and "True = masked out" in lines
    assert "0.25, 0.0625, 0.01562, 0.003906" in lines  # TE's default ALiBi slopes for 4 heads


# --- the standalone repro speaks the whole API ----------------------------------------------------------------

@pytest.mark.parametrize("func, fields, layout, wrong", [
    ("correct", dict(seqlens=(30, 9, 0), seq=32, mask="padding_causal", qkv_format="thd"), "kv_2hd", ""),
    ("backward_ignores_padding", dict(seqlens=(30, 9, 17), seq=32, mask="padding_causal"), "contiguous", "dk"),
    ("sink_in_forward_only", dict(batch=2, seq=24, mask="causal", softmax="learnable"), "contiguous", "dsink"),
    ("top_left_always", dict(batch=2, seq=24, seq_kv=40, mask="causal_bottom_right"), "contiguous", "out"),
    ("correct", dict(batch=2, seq=24, seq_kv=32, mask="no_mask", bias="alibi", softmax="learnable", window=(4, 1)),
     "contiguous", ""),
    ("correct", dict(batch=2, seq=24, mask="arbitrary", mask_source="random:0.5", bias="post_scale_bias:b1ss"),
     "contiguous", ""),
    ("empty_rows_mean_of_v", dict(batch=2, seq=24, seq_kv=12, mask="causal_bottom_right"), "contiguous", "out"),
])
def test_the_repro_reproduces_feature_faults_without_attn_doctor(func, fields, layout, wrong, tmp_path):
    import subprocess
    import sys

    from attn_doctor.bisect.repro import write_repro

    case = make_case(**{**SMALL, **fields, "dtype": "bf16"})
    path = write_repro(tmp_path, Coords.call(case, parse_kernel_spec(f"{FEATURES}:{func}"), layout), None, "test", "x")
    guard = tmp_path / "attn_doctor.py"  # the repro must not need attn-doctor
    guard.write_text('raise ImportError("the repro must not need attn_doctor")\n')
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-800:]
    assert proc.returncode == (1 if wrong else 0), last
    if wrong:
        assert last.startswith("STILL WRONG") and wrong in last


@pytest.mark.slow
def test_bisect_reduces_a_feature_fault_to_its_conditions(run_cli, tmp_path):
    """A kernel that applies a top-left diagonal where bottom-right was asked: bisect keeps exactly the mask
    type and cross-attention, and drops the learnable sink it started with (its gradient fails too at the
    start, but a case without a sink cannot fail on it: the failure is followed on the tensors both have).
    Cross-attention in either direction fails (the start had fewer keys than queries, the minimal case more):
    the condition is that the lengths differ, not that seq_kv > seq, which the start contradicts."""
    import json

    doc = tmp_path / "b.json"
    result = run_cli(["bisect", "--kernel", f"{FEATURES}:top_left_always", "--batch", "2", "--seq", "16",
                      "--seq-kv", "8", "--heads", "2", "--head-dim", "16", "--mask", "causal_bottom_right",
                      "--softmax", "learnable", "--device", "cpu", "--out", tmp_path, "--json", doc])
    assert result.exit_code == 0, result.output
    found = json.loads(doc.read_text())
    necessary = {n["knob"]: (n["failing_value"], n.get("relation", "")) for n in found["necessary"]}
    assert necessary == {"mask": ("causal_bottom_right", ""), "seq_kv": ("seq_kv 2, seq 1", "seq_kv != seq")}
    assert "softmax" not in found["minimal_case"]["case"]


def test_a_kernel_whose_output_ignores_q_and_k_fails_with_zero_gradients_not_an_error():
    case = make_case(**{**SMALL, "batch": 2, "seq": 16, "mask": "no_mask", "dtype": "bf16"})
    row = _rows(case, [parse_kernel_spec(f"{FEATURES}:ignores_queries_and_keys")])["ignores_queries_and_keys"]
    assert row.verdict == FAIL and {"out", "dq", "dk"} <= set(row.failing_tensors)
    assert row.tensors["dq"].cosine == 0.0  # an all-zero gradient, compared like any other


@pytest.mark.slow
def test_a_softmax_scale_reaches_every_path_and_the_default_one_is_spelled_none(run_cli, tmp_path, monkeypatch):
    from attn_doctor.core.case import make_case

    assert make_case(head_dim=64, scale=0.125).scale is None  # 1/sqrt(64): the default, one case
    monkeypatch.chdir(tmp_path)
    blind = f"{Path(__file__).parent / 'kernels' / 'faulty.py'}:scale_blind"
    flags = ["run", "--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "16", "--device", "cpu",
             "--softmax-scale", "0.5"]
    right = run_cli([*flags, "--backend", "sdpa.math", "--backend", "local"])
    assert right.exit_code == 0, right.output
    assert "scale 0.5" in right.output
    wrong = run_cli([*flags, "--kernel", blind])  # a kernel that never reads softmax_scale
    assert wrong.exit_code == 1, wrong.output
