"""The short repro (attn_doctor/bisect/short_repro.py): one screen, written for its case, held to attn-doctor's own
implementation. Its pieces bitwise (views, masks, biases; the inputs in tests/test_inputs.py), its rule's figures
and verdicts on the same numbers, its length on the known TE faults' minimal cases, and a CPU path's script run in
a fresh process giving the figures of the run it came from, for each distribution, layout, mask and bias kind the
pruning decides on. Real torch on the CPU."""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from attn_doctor.backends import BackendSpec
from attn_doctor.backends.kernel import parse_kernel_spec
from attn_doctor.bisect.short_repro import not_covered, short_repro_text
from attn_doctor.core.case import make_case
from attn_doctor.core.coords import Coords
from attn_doctor.numerics import standalone

KERNELS = Path(__file__).resolve().parent / "kernels"
CORRECT = parse_kernel_spec(f"{KERNELS / 'features.py'}:correct")
TE_FUSED = BackendSpec("te.fused", "te", {"path": "fused"})
# The three TE faults' minimal cases (reports/h200/cudnn/run-2/bisect-*), the default run's fault on the GPU
# (reports/h200/run-default: te.fused on the transposed views) and a --kernel path's bisected fault.
KNOWN = {
    "thd head dim 136": (make_case(batch=1, seq=1, heads=1, head_dim=136, dtype="bf16", mask="padding",
                                   qkv_format="thd", seqlens=(1,)), "contiguous", TE_FUSED),
    "111s bias": (make_case(batch=1, seq=2, heads=1, head_dim=8, dtype="bf16", mask="no_mask",
                            bias="post_scale_bias:111s"), "contiguous", TE_FUSED),
    "strided views": (make_case(batch=2, seq=2, heads=1, head_dim=8, dtype="bf16", mask="no_mask"), "transposed",
                      TE_FUSED),
    "the default run's (te.fused, transposed)": (make_case(), "transposed", TE_FUSED),
    "a --kernel's (tests/test_bisect.py's)": (
        make_case(batch=2, seq=300, heads=2, head_dim=16, dtype="fp16", mask="causal"), "head_slice",
        parse_kernel_spec(f"{KERNELS / 'conditional.py'}:seq_ge_300_noncontig")),
}


@pytest.mark.parametrize("case, layout, spec", KNOWN.values(), ids=list(KNOWN))
def test_the_known_faults_repros_fit_one_screen(case, layout, spec):
    script = short_repro_text(Coords.call(case, spec, layout), None, "0.1.0")
    lines = script.splitlines()
    assert len(lines) <= 120, len(lines)
    # the command in the header is copied whole, and a --kernel's file is where it is
    assert max(len(line) for line in lines[1:] if not line.startswith(("TARGET", "Run on the build"))) <= 120


def test_a_repro_of_a_prepared_te_release_says_how_to_run_it_on_that_release():
    """A path on `--te 2.18.0` (and `--cudnn`): the header's line puts the release's folder first on PYTHONPATH, as
    its worker had it, beside the build's loader variables, and names the release it ran; a path on the machine's
    own TE gets no such line."""
    from attn_doctor.machine.te_installs import TEInstall

    release = TEInstall("2.18.0", "/root/.cache/attn-doctor/te/2.18.0").to_dict()
    case, layout, _ = KNOWN["111s bias"]
    on_release = BackendSpec("te.fused@te-2.18.0", "te", {"path": "fused", "te": release})
    script = short_repro_text(Coords.call(case, on_release, layout), None, "0.1.0")
    assert ('Run on the TE release (2.18.0) it failed on: env PYTHONPATH="/root/.cache/attn-doctor/te/2.18.0/site" '
            "python3 THIS_FILE") in script
    own = BackendSpec("te.fused@te-2.20.2", "te", {"path": "fused", "te": TEInstall("2.20.2", "").to_dict()})
    assert "Run on the" not in short_repro_text(Coords.call(case, own, layout), None, "0.1.0")
    assert "Run on the" not in short_repro_text(Coords.call(case, TE_FUSED, layout), None, "0.1.0")


def _namespace(case, layout: str, spec=CORRECT) -> dict:
    script = short_repro_text(Coords.call(case, spec, layout), None, "test")
    assert script is not None, not_covered(Coords.call(case, spec, layout))
    return _run_pieces(script)


LAYOUTS = [("contiguous", "bshd"), ("transposed", "bshd"), ("head_slice", "bshd"), ("sb3hd_packed", "bshd"),
           ("sbh3d_packed", "bshd"), ("qkv_3hd", "bshd"), ("kv_h2d", "bshd"), ("contiguous", "sbhd"),
           ("transposed", "sbhd"), ("head_slice", "thd"), ("kv_2hd", "thd"), ("qkv_h3d", "thd")]


@pytest.mark.parametrize("layout, fmt", LAYOUTS, ids=[f"{layout}-{fmt}" for layout, fmt in LAYOUTS])
def test_the_views_are_attn_doctor_s_bitwise(layout, fmt):
    """views(q, k, v) in the kernel's format are `standalone.lay_out`'s: values, shapes and strides."""
    thd = fmt == "thd"
    case = make_case(batch=2, seq=6, heads=4, kv_heads=4, head_dim=8, dtype="fp32",
                     **(dict(mask="padding", qkv_format="thd", seqlens=(5, 2), pad_between_seqs=True) if thd else {}))
    spec = TE_FUSED if fmt != "bshd" else CORRECT
    if fmt == "sbhd":
        case = make_case(batch=2, seq=6, heads=4, head_dim=8, dtype="fp32", qkv_format="sbhd")
    names = _namespace(case, layout, spec) if fmt == "bshd" else _te_namespace(case, layout)
    q, k, v, _ = names["inputs"]()
    plain = case.plain()
    index = {}
    if thd:
        from attn_doctor.core import layouts

        cu = layouts.packing(case).cu_seqlens_arguments()
        index = {side: standalone.token_index(cu[f"cu_seqlens_{side}_padded"], plain["seq"], "cpu")
                 for side in ("q", "kv")}
    want, _ = standalone.lay_out(layout, q, k, v, fmt, index.get("q"), index.get("kv"))
    got = names["views"](q, k, v)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
        assert not a.is_contiguous() or b.is_contiguous()


def _te_namespace(case, layout: str) -> dict:
    """A TE path's script without TE: its pieces up to the kernel, which is not called here."""
    script = short_repro_text(Coords.call(case, TE_FUSED, layout), None, "test")
    script = "\n".join(line for line in script.splitlines() if "transformer_engine" not in line)
    return _run_pieces(script)


def _run_pieces(script: str) -> dict:
    """The script's definitions, its run (behind __name__ == "__main__") not started; the file is removed after."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "repro.py"
        path.write_text(script)
        return runpy.run_path(str(path), run_name="repro")


MASKS = {
    "causal": dict(mask="causal"),
    "bottom-right, longer keys": dict(mask="causal_bottom_right", seq_kv=9),
    "sliding window": dict(mask="causal", window=(3, 0)),
    "padding with empty rows": dict(mask="padding_causal_bottom_right", seqlens=(6, 0, 3), seqlens_kv=(2, 3, 5)),
    "arbitrary": dict(mask="arbitrary", mask_source="random:0.6"),
    "padding, window": dict(mask="padding", seqlens=(6, 4, 1), window=(2, 2)),
    "everything visible": dict(mask="padding", seqlens=(6, 6, 6)),
    "off-by-one sink": dict(mask="causal", softmax="off-by-one"),
    "GQA, no mask": dict(mask="no_mask", kv_heads=1),
}


@pytest.mark.parametrize("fields", MASKS.values(), ids=list(MASKS))
@pytest.mark.parametrize("bias", ["no_bias", "alibi", "post_scale_bias:1hss"])
def test_the_mask_and_bias_are_attn_doctor_s_bitwise(fields, bias):
    case = make_case(batch=3, seq=6, heads=2, head_dim=8, dtype="fp32", bias=bias, **fields)
    names = _namespace(case, "contiguous")
    plain = case.plain()
    explicit, drawn, _ = standalone.draw_side_inputs(plain, "cpu")
    allowed = standalone.dense_allowed(plain, explicit, "cpu")
    visible = names.get("VISIBLE")
    if allowed is None or bool(allowed.all()):
        assert visible is None  # pruned: every query sees every key
    else:
        assert torch.equal(visible.expand_as(allowed), allowed)
    want = standalone.dense_bias(plain, drawn, torch.float64, "cpu")
    assert (want is None and "BIAS" not in names) or torch.equal(names["BIAS"].expand_as(want), want)
    # the baseline: Megatron's local attention with this mask and bias, as attn-doctor computes it
    q, k, v, _ = (t.transpose(0, 1) for t in names["inputs"]())
    sink = standalone.draw_side_inputs(plain, "cpu")[2]
    want_out = standalone.megatron_core_attention(q, k, v, plain["scale"], allowed,
                                                  standalone.dense_bias(plain, drawn, torch.float32, "cpu"), sink)
    assert torch.equal(names["local"](q, k, v), want_out)
    # the float64 reference and its terms' sizes: attn-doctor's dense one
    q, k, v, do = names["inputs"]()
    exact = standalone.dense_reference(q, k, v, do, plain["scale"], allowed,
                                       standalone.dense_bias(plain, drawn, torch.float64, "cpu"), sink)
    for name, (got, terms) in names["reference"](q, k, v, do).items():
        torch.testing.assert_close(got, exact[name], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(terms, exact[f"{name}_terms"], rtol=1e-12, atol=1e-14)
    rows = standalone.compared_rows(plain, explicit, "cpu")
    if rows:
        assert torch.equal(names["ROWS"]["q"][0], rows["out"]["rows"])
        assert torch.equal(names["ROWS"]["q"][1], rows["out"]["empty_rows"])
        assert torch.equal(names["ROWS"]["kv"][0], rows["dk"]["rows"])
    else:
        assert "ROWS" not in names


def _perturbed(exact: torch.Tensor, kind: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(exact.shape, generator=g, dtype=torch.float64)
    if kind == "rounding":
        return exact + 1e-3 * exact.abs().mean() * noise
    if kind == "scaled":
        return exact * 1.05
    if kind == "one head":
        wrong = exact.clone()
        wrong[0, :, 0] *= 1.3
        return wrong
    if kind == "nan":
        wrong = exact.clone()
        wrong[0, 0, 0, 0] = math.nan
        return wrong
    return exact + 0.3 * exact.abs().mean() * noise


@pytest.mark.parametrize("flash", [False, True])
@pytest.mark.parametrize("kind", ["rounding", "scaled", "one head", "nan", "large"])
@pytest.mark.parametrize("mask", ["causal", "padding with empty rows"])
def test_the_rule_gives_attn_doctor_s_figures_and_verdicts(kind, mask, flash):
    """The script's figures and judge on a candidate and a baseline are `error_figures` and `judge_figures`'."""
    case = make_case(batch=3, seq=6, heads=2, head_dim=8, dtype="bf16", **MASKS[mask])
    spec = parse_kernel_spec(f"{KERNELS / 'flash_style.py'}:flash_style") if flash else CORRECT
    names = _namespace(case, "contiguous", spec)
    q, k, v, do = names["inputs"]()
    ref = names["reference"](q, k, v, do)
    plain = case.plain()
    explicit = standalone.draw_side_inputs(plain, "cpu")[0]
    rows = standalone.compared_rows(plain, explicit, "cpu")
    flash_figures = {}
    if flash:
        moves = names["flash_moves"](q, k, do, ref["out"][0])
    for i, name in enumerate(ref):
        exact, terms = ref[name]
        side = {"rows": None, "empty_rows": None, **rows.get(name, {})}
        script_rows = () if "ROWS" not in names else names["ROWS"]["q" if name in ("out", "dq") else "kv"]
        candidate, base = _perturbed(exact, kind, i), _perturbed(exact, "rounding", 100 + i)
        want_m = standalone.error_figures(standalone.error_sums(candidate, exact, terms, **side))
        want_b = standalone.error_figures(standalone.error_sums(base, exact, terms, **side))
        got_m, got_b = names["figures"](candidate, exact, terms, *script_rows), names["figures"](base, exact, terms,
                                                                                                  *script_rows)
        want_flash = got_flash = None
        if flash and name in ("dq", "dk"):
            want_flash = standalone.error_figures(standalone.error_sums(exact + moves[name], exact, terms, **side))
            got_flash = names["figures"](exact + moves[name], exact, terms, *script_rows)
        for figure in ("rel", "scaled", "worst", "noise", "head_noise"):
            if figure in got_m:
                assert got_m[figure] == pytest.approx(want_m[figure], rel=1e-9), figure
        found = standalone.judge_figures(want_m, want_b, "bf16", standalone.MULTIPLE[name], flash=want_flash)
        why, ratio = names["judge"](got_m, got_b, *([got_flash] if flash else []))
        assert ratio == pytest.approx(found["ratio"], rel=1e-9)
        assert why.startswith("cannot") == bool(found["inconclusive"]), (name, why, found)
        assert (bool(why) and not why.startswith("cannot")) == (bool(found["failed"]) and not found["inconclusive"]), (
            name, why, found)


# --- end to end: the run's figures ------------------------------------------------------------------------------

DRIVER = r'''
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("repro", sys.argv[1])
repro = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repro)
q, k, v, do = repro.inputs()
ref = repro.reference(q, k, v, do)
got = repro.attend(repro.kernel, repro.views(q, k, v), repro.to_fmt, repro.to_bshd, do)
sbhd = lambda t, side: t.transpose(0, 1)
base = repro.attend(repro.local, [repro.leaf(sbhd(t, "q")) for t in (q, k, v)], sbhd, sbhd, do)
rows = getattr(repro, "ROWS", None)
side = lambda name: () if rows is None else rows["q" if name in ("out", "dq") else "kv"]
out = {}
for name, x, b in zip(ref, got, base):
    m = repro.figures(x, *ref[name], *side(name))
    out[name] = {"rel": m["rel"], "ratio": repro.judge(m, repro.figures(b, *ref[name], *side(name)))[1]}
print(json.dumps(out))
'''

RUNS = {
    "normal, causal GQA, head_slice": (["--kv-heads", 1, "--mask", "causal"], "head_slice"),
    "outliers, padding with empty rows": (["--inputs", "outliers", "--mask", "padding_causal_bottom_right",
                                           "--seqlens", "6,0,3", "--seqlens-kv", "2,3,5"], "contiguous"),
    "uniform, arbitrary mask and bias, sb3hd_packed": (["--inputs", "uniform", "--mask", "arbitrary", "--mask-source",
                                                        "random:0.5", "--bias", "post_scale_bias:1hss"],
                                                       "sb3hd_packed"),
    "structured, ALiBi, window, off-by-one, transposed": (["--inputs", "structured", "--mask", "no_mask", "--bias",
                                                           "alibi", "--window", "3,1", "--softmax", "off-by-one"], "transposed"),
    "deep-layer, window causal, sbh3d_packed": (["--inputs", "deep-layer", "--mask", "causal", "--window", "2,0",
                                                 "--kv-heads", 1], "sbh3d_packed"),
    "large-logits, thd padded, kv_2hd": (["--inputs", "large-logits", "--qkv-format", "thd", "--mask", "padding",
                                          "--seqlens", "5,2,6"], "kv_2hd"),
}


@pytest.mark.slow
@pytest.mark.parametrize("flags, layout", RUNS.values(), ids=list(RUNS))
def test_a_cpu_path_s_short_repro_gives_the_run_s_figures(flags, layout, run_cli, tmp_path, monkeypatch):
    """`run --json` on the CPU, then the short repro of its row in a fresh process: the same relative errors and
    ratios to the yardstick, to 2 significant digits and better (both on one thread: a CPU kernel's rounding
    depends on how many it runs on)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    base = ["--batch", 3, "--seq", 6, "--heads", 2, "--head-dim", 8, "--dtype", "bf16"]
    result = run_cli(["run", "--kernel", f"{KERNELS / 'features.py'}:correct", *base, *flags, "--layout", layout,
                      "--device", "cpu", "--json", "run.json"])
    assert result.exit_code in (0, 1), result.output
    from attn_doctor.results.row import Row

    rows = [Row.from_dict(r) for r in json.loads((tmp_path / "run.json").read_text())["results"]]
    row = next(r for r in rows if r.coords.backend.name == "correct")
    assert row.verdict == "PASS", row.reason
    script = short_repro_text(row.coords, None, "test")
    assert script is not None
    (tmp_path / "repro.py").write_text(script)
    (tmp_path / "driver.py").write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path / "repro.py")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for name, tensor in row.tensors.items():
        assert figures[name]["rel"] == pytest.approx(tensor.rel_err, rel=5e-3, abs=1e-12), name
        assert figures[name]["ratio"] == pytest.approx(tensor.ratio, rel=5e-3, abs=1e-9), (name, figures, tensor)
    plain = subprocess.run([sys.executable, str(tmp_path / "repro.py")], env=env, capture_output=True, text=True,
                           timeout=300, cwd=tmp_path)
    assert plain.returncode == 0 and plain.stdout.rstrip().endswith("FIXED"), plain.stdout + plain.stderr
