"""TE's call options beyond the attention problem (issue 51): custom ALiBi slopes, the max logit, num_splits, the
boolean padding mask, forward-only runs and the FP8 modes. Each is checked as a case (refusals and round trips), as
the arguments TE gets (`te_call`), and judged on the CPU with a --kernel standing in for TE: a correct kernel
PASSes, a kernel with the fault the option exposes FAILs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attn_doctor.backends import te_call
from attn_doctor.core.case import Case, make_case
from attn_doctor.core.errors import BadInput
from attn_doctor.numerics import standalone
from attn_doctor.numerics.inputs import make_inputs
from attn_doctor.numerics.reference import attention_reference, max_logit_reference
from tests.cli_checks import one_line_error

KERNELS = Path(__file__).resolve().parent / "kernels" / "features.py"
SMALL = ["--batch", "2", "--seq", "64", "--heads", "4", "--head-dim", "32", "--layout", "contiguous",
         "--backend", "local", "--backend", "sdpa.math"]


def kernel(name: str) -> list[str]:
    return ["--kernel", f"{KERNELS}:{name}"]


def rows_of(tmp_path: Path) -> dict[str, dict]:
    document = json.loads((tmp_path / "r.json").read_text())
    return {row["backend"]: row for row in document["results"]}


# --- the case ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "words"), [
    ({"alibi_slopes": "random"}, "add --bias alibi"),
    ({"bias": "alibi", "alibi_slopes": (0.5, 0.25)}, "2 slopes for 16 heads"),
    ({"bias": "alibi", "alibi_slopes": "uniform"}, "expected random or random-batch"),
    ({"padding_mask": True}, "needs a padding mask type"),
    ({"padding_mask": True, "mask": "padding", "seqlens": (5, 3), "qkv_format": "thd"}, "use --qkv-format bshd"),
    ({"fp8_backward": "f16"}, "add --fp8 delayed"),
    ({"fp8_backward": "fp16", "fp8": "delayed"}, "unknown fp8-backward"),
    ({"num_splits": 0}, "--num-splits must be"),
    ({"fp8": "delayed", "fp8_backward": "f16", "forward_only": True}, "drop one of them"),
])
def test_call_options_refuse_what_te_cannot_take(fields, words):
    with pytest.raises(BadInput, match=words):
        make_case(**fields)


def test_call_options_round_trip_and_rebuild_from_flags():
    case = make_case(batch=2, seq=64, heads=4, bias="alibi", alibi_slopes=(0.5, 0.25, 0.125, 1.0),
                     return_max_logit=True, num_splits=2, mask="padding_causal", seqlens=(64, 40), padding_mask=True,
                     forward_only=True)
    assert Case.from_dict(json.loads(json.dumps(case.to_dict()))) == case
    flags = case.cli_flags()
    for flag in ("--alibi-slopes 0.5,0.25,0.125,1", "--max-logit", "--num-splits 2", "--padding-mask",
                 "--forward-only"):
        assert flag in flags
    assert "max-logit" in case.short() and "fwd-only" in case.short()
    plain = make_case()  # options at their defaults leave the dict, short form and flags as they were
    assert "alibi_slopes" not in plain.to_dict() and "--max-logit" not in plain.cli_flags()


# --- what TE is given ---------------------------------------------------------------------------------------------

def test_te_gets_the_max_logit_flag_num_splits_slopes_and_the_padding_mask():
    case = make_case(batch=2, seq=8, seq_kv=6, heads=2, head_dim=8, mask="padding", seqlens=(8, 5),
                     seqlens_kv=(6, 2), bias="alibi", alibi_slopes="random-batch", return_max_logit=True,
                     num_splits=3, padding_mask=True).plain()
    assert te_call.module_arguments(case)["return_max_logit"] is True
    slopes = standalone.case_alibi_slopes(case)
    arguments = te_call.forward_arguments(case, {"cu_seqlens_q": [0, 8, 13], "cu_seqlens_kv": [0, 6, 8]}, None,
                                          None, "cpu", slopes)
    assert arguments["num_splits"] == 3
    assert arguments["alibi_slopes"].dtype == torch.float32 and arguments["alibi_slopes"].shape == (2, 2)
    q_mask, kv_mask = arguments["attention_mask"]  # cross-attention: one per side, True = padding
    assert q_mask.shape == (2, 1, 1, 8) and kv_mask.shape == (2, 1, 1, 6)
    assert q_mask[1, 0, 0].tolist() == [False] * 5 + [True] * 3
    assert kv_mask[1, 0, 0].tolist() == [False] * 2 + [True] * 4
    self_case = make_case(batch=2, seq=8, heads=2, head_dim=8, mask="padding", seqlens=(8, 5),
                          padding_mask=True).plain()
    one = te_call.forward_arguments(self_case, {"cu_seqlens_q": [0, 8, 13]}, None, None, "cpu")["attention_mask"]
    assert isinstance(one, torch.Tensor) and one.shape == (2, 1, 1, 8)  # self-attention: one tensor
    assert "num_splits" not in te_call.forward_arguments(make_case().plain(), {}, None, None, "cpu")


def test_te_is_told_which_fp8_backward_and_returns_a_max_logit_pair():
    assert te_call.fp8_backward_environment(make_case(fp8="delayed", fp8_backward="f16").plain()) == {
        "NVTE_FP8_DPA_BWD": "0"}
    assert te_call.fp8_backward_environment(make_case(fp8="delayed").plain()) == {"NVTE_FP8_DPA_BWD": "1"}
    out, logit = torch.zeros(2), torch.ones(3)
    assert te_call.split_outputs((out, logit)) == (out, logit)
    assert te_call.split_outputs(out) == (out, None)


# --- the float64 side ---------------------------------------------------------------------------------------------

def test_custom_slopes_are_the_seeded_draw_every_device_gets_and_differ_from_te_defaults():
    case = make_case(heads=4, bias="alibi", alibi_slopes="random").plain()
    slopes = standalone.case_alibi_slopes(case)
    assert torch.equal(slopes, standalone.case_alibi_slopes(case)) and bool((slopes > 0).all())
    assert not torch.allclose(slopes, standalone.alibi_slopes(4))
    assert standalone.case_alibi_slopes(make_case(heads=4, bias="alibi").plain()).equal(standalone.alibi_slopes(4))
    per_sequence = standalone.case_alibi_slopes(make_case(batch=3, heads=4, bias="alibi",
                                                          alibi_slopes="random-batch").plain())
    assert per_sequence.shape == (3, 4)


def test_the_tiled_reference_with_custom_slopes_equals_the_plain_formula():
    case = make_case(batch=2, seq=24, heads=4, head_dim=8, dtype="fp32", bias="alibi", alibi_slopes="random-batch",
                     mask="padding_causal", seqlens=(24, 17))
    inputs = make_inputs(case, torch.device("cpu"))
    tiled = attention_reference(inputs.q, inputs.k, inputs.v, inputs.dout, softmax_scale=case.softmax_scale,
                                semantics=inputs.semantics)
    plain = case.plain()
    bias = standalone.dense_bias(plain, None, torch.float64, "cpu")
    dense = standalone.dense_reference(inputs.q, inputs.k, inputs.v, inputs.dout, case.softmax_scale,
                                       standalone.dense_allowed(plain, None, "cpu"), bias, None)
    valid = torch.arange(24)[None, :] < torch.tensor([24, 17])[:, None]
    for name in ("out", "dq", "dk", "dv"):
        assert torch.allclose(getattr(tiled, name)[valid], dense[name][valid], rtol=1e-10, atol=1e-12), name


def test_the_max_logit_reference_is_the_largest_visible_score_with_bias():
    case = make_case(batch=2, seq=20, seq_kv=12, heads=4, kv_heads=2, head_dim=8, dtype="fp32",
                     mask="padding_causal_bottom_right", seqlens=(20, 9), seqlens_kv=(12, 5),
                     bias="post_scale_bias:b1ss")
    inputs = make_inputs(case, torch.device("cpu"))
    got, terms = max_logit_reference(inputs.q, inputs.k, inputs.semantics, case.softmax_scale, block_bytes=2048)
    plain = case.plain()
    scores = torch.einsum("bqhd,bkhd->bhqk", inputs.q.double(),
                          inputs.k.double().repeat_interleave(2, dim=2)) * case.softmax_scale
    scores = scores + standalone.dense_bias(plain, inputs.semantics.bias, torch.float64, "cpu")
    visible = standalone.dense_allowed(plain, None, "cpu")
    expected = scores.masked_fill(~visible, float("-inf")).amax(dim=(0, 2, 3))
    assert torch.allclose(got.view(-1), expected, rtol=1e-12)
    assert got.shape == (1, 1, 4, 1) and terms.shape == (1, 1, 4, 2) and bool((terms > 0).all())


# --- judged on the CPU, both sides --------------------------------------------------------------------------------

def test_custom_alibi_slopes_pass_a_correct_kernel_and_fail_one_slope_for_all_heads(run_cli, tmp_path):
    flags = [*SMALL, "--bias", "alibi", "--alibi-slopes", "random", "--json", tmp_path / "r.json"]
    result = run_cli(["run", *flags, *kernel("correct"), *kernel("one_alibi_slope")])
    assert result.exit_code == 1, result.output
    rows = rows_of(tmp_path)
    assert rows["correct"]["verdict"] == "PASS" and rows["sdpa.math"]["verdict"] == "PASS"
    assert rows["one_alibi_slope"]["verdict"] == "FAIL"


def test_the_max_logit_is_judged_passing_right_and_failing_unscaled(run_cli, tmp_path):
    flags = [*SMALL, "--max-logit", "--json", tmp_path / "r.json"]
    result = run_cli(["run", *flags, *kernel("with_max_logit"), *kernel("max_logit_unscaled")])
    assert result.exit_code == 1, result.output
    rows = rows_of(tmp_path)
    assert rows["with_max_logit"]["verdict"] == "PASS"
    assert rows["with_max_logit"]["tensors"]["max_logit"]["verdict"] == "PASS"
    wrong = rows["max_logit_unscaled"]
    assert wrong["verdict"] == "FAIL" and wrong["tensors"]["max_logit"]["verdict"] == "FAIL"
    assert wrong["tensors"]["out"]["verdict"] == "PASS"
    assert "max_logit" not in rows["sdpa.math"]["tensors"]  # a path that returns none is judged on the rest
    assert "max-logit" in result.output


def test_forward_only_judges_out_alone_so_a_backward_fault_passes_there_and_fails_with_one(run_cli, tmp_path):
    flags = [*SMALL, "--json", tmp_path / "r.json", *kernel("wrong_in_backward")]
    result = run_cli(["run", *flags, "--forward-only"])
    assert result.exit_code == 0, result.output
    row = rows_of(tmp_path)["wrong_in_backward"]
    assert row["verdict"] == "PASS" and set(row["tensors"]) == {"out"}
    assert "forward only" in result.output
    result = run_cli(["run", *flags])
    assert result.exit_code == 1 and rows_of(tmp_path)["wrong_in_backward"]["verdict"] == "FAIL"


def test_new_flags_are_bad_input_when_they_cannot_apply(run_cli):
    line = one_line_error(run_cli(["run", *SMALL, "--alibi-slopes", "random"]))
    assert "--bias alibi" in line
    line = one_line_error(run_cli(["run", *SMALL, "--padding-mask"]))
    assert "padding mask type" in line


def test_the_sweep_grids_num_splits_and_fp8_backward():
    from attn_doctor.cli.options import build_grid

    _, grid, _, _ = build_grid({"num_splits": "1,2", "fp8_backward": "fp8,f16", "max_logit": True})
    assert grid["num_splits"] == [1, 2] and grid["fp8_backward"] == ["fp8", "f16"]


# --- FP8 modes ----------------------------------------------------------------------------------------------------

def test_mxfp8_rounds_blocks_of_32_with_power_of_two_scales():
    x = torch.cat([torch.full((32,), 1000.0), torch.full((32,), 1e-3)])  # two blocks far apart in size
    rounded = standalone.fp8_round(x, "mx-e4m3")
    assert torch.allclose(rounded, x, rtol=2 ** -3)  # each block keeps its own range
    per_tensor = standalone.fp8_round(x, "e4m3")
    assert per_tensor[40] == 0  # one scale for both: the small block underflows


def test_the_f16_backward_simulation_rounds_the_forward_alone():
    q, k, v = (torch.randn(16, 1, 2, 8, requires_grad=True) for _ in range(3))
    grads = {}
    modes = {backward: standalone.fp8_mode(make_case(fp8="delayed", fp8_backward=backward).plain())
             for backward in ("fp8", "f16")}
    assert modes["fp8"] == standalone.FP8_DEFAULT and modes["f16"][2] is None
    assert standalone.fp8_mode(make_case(fp8="mxfp8", fp8_backward="f16").plain()) == ("mx-e4m3", "e4m3", None)
    for backward, mode in modes.items():
        out = standalone.megatron_core_attention(q, k, v, 8 ** -0.5, None, fp8=mode)
        grads[backward] = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    plain = standalone.megatron_core_attention(q, k, v, 8 ** -0.5, None)
    f16_out = standalone.megatron_core_attention(q, k, v, 8 ** -0.5, None, fp8=modes["f16"])
    assert not torch.equal(f16_out, plain)  # the forward is FP8 in both modes
    assert any(not torch.equal(a, b) for a, b in zip(grads["fp8"], grads["f16"]))  # the backward differs


# --- the flash path's FlashAttention version ----------------------------------------------------------------------

def test_with_several_flash_attention_versions_each_is_a_path_of_its_own(monkeypatch):
    from attn_doctor.backends import te as te_backend

    monkeypatch.setattr(te_backend, "te_version", lambda: (2, 20))
    monkeypatch.setattr(te_backend, "flash_versions_installed", lambda: ["3", "4"])
    paths = dict(te_backend.te_paths())
    assert paths["te.flash.fa3"] == {"path": "flash", "flash_version": "3"} and "te.flash" in paths
    env = te_backend.path_environment("flash", "3")
    assert env["NVTE_FLASH_ATTN"] == "1" and env["NVTE_FLASH_ATTN_V3"] == "1"
    assert env["NVTE_FLASH_ATTN_V2"] == env["NVTE_FLASH_ATTN_V4"] == "0" and env["NVTE_FUSED_ATTN"] == "0"
    own_choice = te_backend.path_environment("flash")  # after te.flash.fa3 in the same worker: TE's choice again
    assert all(own_choice[f"NVTE_FLASH_ATTN_V{major}"] == "1" for major in "234")
    monkeypatch.setattr(te_backend, "flash_versions_installed", lambda: ["4"])
    assert not any(name.startswith("te.flash.fa") for name, _ in te_backend.te_paths())  # one version: te.flash
    monkeypatch.setattr(te_backend, "flash_versions_installed", lambda: ["2", "3"])
    monkeypatch.setattr(te_backend, "te_version", lambda: (2, 17))  # no NVTE_FLASH_ATTN_V* before TE 2.18
    assert not any(name.startswith("te.flash.fa") for name, _ in te_backend.te_paths())


def test_a_recipe_s_families_pick_its_grids_and_an_unknown_one_is_bad_input(run_cli, tmp_path):
    from attn_doctor.cli.options import build_cases
    from attn_doctor.core.recipes import load_recipe

    recipe = load_recipe("te-tests")
    assert {"base", "max_logit", "d256", "fp8_vs_f16", "mxfp8"} <= set(recipe.family_names())
    cases, _, _, _, _ = build_cases({"recipe": "te-tests", "family": "mxfp8"})
    assert cases and all(case.fp8 == "mxfp8" for case in cases)
    line = one_line_error(run_cli(["sweep", "--recipe", "te-tests", "--family", "nope", "--device", "cpu"]))
    assert "no family nope" in line and "max_logit" in line
    line = one_line_error(run_cli(["sweep", "--family", "base", "--device", "cpu"]))
    assert "--family picks grids of a recipe" in line


# --- the standalone repro ------------------------------------------------------------------------------------------

def _full_repro(fields: dict, spec_name: str, tmp_path: Path):
    """Run the full standalone repro of `spec_name` (local, or a kernel of tests/kernels/features.py) on a small
    case with `fields`."""
    import subprocess
    import sys

    from attn_doctor.backends import parse_kernel_spec, select
    from attn_doctor.bisect.repro import repro_text
    from attn_doctor.core.coords import Coords

    spec = select(["local"])[0] if spec_name == "local" else parse_kernel_spec(f"{KERNELS}:{spec_name}")
    case = make_case(batch=2, seq=32, heads=2, head_dim=16, **fields)
    script = tmp_path / "repro.py"
    script.write_text(repro_text(Coords.call(case, spec, "contiguous"), None, "test", "attn-doctor run ...",
                                 full=True))
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_the_full_repro_of_a_forward_only_case_judges_out_alone(tmp_path):
    done = _full_repro({"forward_only": True}, "wrong_in_backward", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FIXED" in done.stdout and "\ndq" not in done.stdout  # a backward fault cannot show without a backward
    done = _full_repro({}, "wrong_in_backward", tmp_path)
    assert done.returncode == 1 and "STILL WRONG: dq" in done.stdout


def test_the_full_repro_judges_the_max_logit_the_path_returns(tmp_path):
    done = _full_repro({"return_max_logit": True}, "local", tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max_logit" in done.stdout and "FIXED" in done.stdout
    done = _full_repro({"return_max_logit": True}, "correct", tmp_path)  # a kernel that returns none: said so
    assert "max_logit not returned by the kernel: not judged" in done.stdout


def test_the_dense_max_logit_equals_the_tiled_reference():
    case = make_case(batch=2, seq=20, seq_kv=12, heads=4, kv_heads=2, head_dim=8, dtype="fp32",
                     mask="padding_causal_bottom_right", seqlens=(20, 9), seqlens_kv=(12, 5),
                     bias="alibi", alibi_slopes="random-batch")
    inputs = make_inputs(case, torch.device("cpu"))
    tiled, tiled_terms = max_logit_reference(inputs.q, inputs.k, inputs.semantics, case.softmax_scale)
    plain = case.plain()
    dense, dense_terms = standalone.dense_max_logit(
        inputs.q, inputs.k, case.softmax_scale, standalone.dense_allowed(plain, None, "cpu"),
        standalone.dense_bias(plain, None, torch.float64, "cpu"))
    assert torch.allclose(tiled, dense, rtol=1e-12) and torch.allclose(tiled_terms, dense_terms, rtol=1e-10)



def test_delayed_scaling_s_warm_up_runs_with_gradients_also_before_a_forward_only_probe(monkeypatch):
    """TE updates delayed scaling's scales as its autocast exits only with gradients enabled: a forward-only probe's
    warm-up step runs with them (else the measured step quantises with scale 1), the measured step without."""
    import torch

    from attn_doctor.backends import BackendSpec, build
    from attn_doctor.core.case import make_case
    from attn_doctor.core.coords import Coords
    from attn_doctor.probes import Caches, run_probe

    seen: list[bool] = []
    spec = BackendSpec("local", "local", {})
    backend = build(spec)
    forward = backend.forward

    def recording(*args, **kwargs):
        seen.append(torch.is_grad_enabled())
        return forward(*args, **kwargs)

    monkeypatch.setattr(backend, "forward", recording)
    for fp8, forward_only, expected in (("delayed", True, [True, False]), ("delayed", False, [True, True]),
                                        ("current", True, [False])):
        seen.clear()
        case = make_case(batch=1, seq=16, heads=2, head_dim=16, mask="causal", fp8=fp8, forward_only=forward_only)
        outcome = run_probe(backend, Coords.call(case, spec, "contiguous"), Caches(torch.device("cpu")))
        assert outcome.status == "ok", outcome.reason
        assert seen == expected, (fp8, forward_only, seen)
