"""One implementation of the numerics (attn_doctor/numerics/standalone.py, attn_doctor/backends/te_call.py): the
modules the standalone repro scripts hold import torch and the standard library only; every script built from
them is whole (no attn-doctor import, no name it does not define); the script draws the side inputs attn-doctor
draws, its dense float64 reference is attn-doctor's tiled one, and a TE path's script calls TE as attn-doctor
does (run here on a stand-in for TE). Real torch on the CPU, tiny shapes."""

from __future__ import annotations

import ast
import builtins
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attn_doctor.backends import BackendSpec, select
from attn_doctor.backends import te_call
from attn_doctor.backends.kernel import parse_kernel_spec
from attn_doctor.bisect.repro import repro_text, write_repro
from attn_doctor.core.case import make_case
from attn_doctor.core.coords import Coords
from attn_doctor.numerics import standalone
from attn_doctor.numerics.inputs import make_inputs
from attn_doctor.numerics.reference import attention_reference

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent
FEATURES = Path(__file__).resolve().parent / "kernels" / "features.py"
SMALL = dict(heads=4, head_dim=16, dtype="fp32")
CASES = {
    "dense causal GQA": dict(batch=2, seq=12, kv_heads=2, mask="causal"),
    "padded bottom-right, empty rows, learnable sink": dict(seqlens=(10, 0, 3), seqlens_kv=(4, 2, 6), seq=10,
                                                            seq_kv=6, mask="padding_causal_bottom_right",
                                                            softmax="learnable"),
    "arbitrary with a bias": dict(batch=2, seq=10, mask="arbitrary", mask_source="random:0.4",
                                  bias="post_scale_bias:b1ss"),
    "alibi window, off-by-one": dict(batch=2, seq=10, seq_kv=12, mask="no_mask", bias="alibi", window=(4, 1),
                                     softmax="off-by-one"),
    "thd pad between, MLA": dict(seqlens=(9, 1, 4), seq=10, mask="padding_causal", qkv_format="thd",
                                 pad_between_seqs=True, head_dim_v=8),
}


def _imports(module) -> set[str]:
    tree = ast.parse(Path(module.__file__).read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module)
    return found


def test_the_shared_modules_import_torch_and_the_standard_library_only():
    assert _imports(standalone) == {"__future__", "math", "torch"}
    assert _imports(te_call) == {"__future__", "contextlib", "importlib", "torch"}


def _unbound(script: str) -> set[str]:
    """Names the script reads that nothing in it binds (nor Python's builtins)."""
    tree = ast.parse(script)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id not in bound}


PATHS = [*(spec for spec in select([]) if spec.name in ("te.fused", "te.fused.det", "te.unfused", "sdpa.math",
                                                         "local")),
         parse_kernel_spec(f"{FEATURES}:correct")]


@pytest.mark.parametrize("full", [False, True], ids=["short", "full"])
@pytest.mark.parametrize("fields", CASES.values(), ids=list(CASES))
@pytest.mark.parametrize("spec", PATHS, ids=[spec.name for spec in PATHS])
def test_every_repro_is_whole_and_needs_no_attn_doctor(spec, fields, full):
    script = repro_text(Coords.call(make_case(**{**SMALL, **fields}), spec), None, "test", "attn-doctor bisect", full)
    tree = ast.parse(script)
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name.split(".")[0] == "attn_doctor"}
    assert not _unbound(script)


@pytest.mark.parametrize("fields", CASES.values(), ids=list(CASES))
def test_the_repro_draws_the_side_inputs_attn_doctor_draws(fields):
    case = make_case(**{**SMALL, **fields})
    semantics = make_inputs(case, CPU).semantics
    explicit, bias, sink = standalone.draw_side_inputs(case.plain(), CPU)
    for got, want in ((explicit, semantics.allowed), (bias, semantics.bias), (sink, semantics.sink)):
        assert (got is None and want is None) or torch.equal(got, want)


@pytest.mark.parametrize("fields", CASES.values(), ids=list(CASES))
def test_the_repro_s_dense_reference_is_attn_doctor_s_tiled_one(fields):
    """The script's reference (the plain formula on `dense_allowed` and `dense_bias`, as its `reference` calls
    it) against the tiled one attn-doctor judges with: the two implementations of the reference agree."""
    case = make_case(**{**SMALL, **fields})
    x = make_inputs(case, CPU)
    plain = case.plain()
    explicit, bias, sink = standalone.draw_side_inputs(plain, CPU)
    dense = standalone.dense_reference(x.q, x.k, x.v, x.dout, case.softmax_scale,
                                       standalone.dense_allowed(plain, explicit, CPU),
                                       standalone.dense_bias(plain, bias, torch.float64, CPU), sink)
    tiled = attention_reference(x.q, x.k, x.v, x.dout, softmax_scale=case.softmax_scale, semantics=x.semantics,
                                block_bytes=1)
    for name in ("out", "dq", "dk", "dv") + (("dsink",) if case.softmax == "learnable" else ()):
        assert torch.allclose(dense[name], getattr(tiled, name), rtol=1e-11, atol=1e-12), name
        assert torch.allclose(dense[f"{name}_terms"], tiled.terms(name), rtol=1e-10, atol=1e-14), name


# A stand-in for transformer_engine: TE's DotProductAttention as tests/test_te_wiring.py's stand-in computes it
# from exactly the arguments TE would get, and the backend state a TE repro reads back.
FAKE_TE = {
    "transformer_engine/__init__.py": "",
    "transformer_engine_torch.py": "def get_cudnn_version():\n    return 91400\n",  # TE's extension, read back
    "transformer_engine/pytorch/attention/__init__.py": "",
    "transformer_engine/pytorch/attention/dot_product_attention/__init__.py": "",
    "transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py": "_attention_backends = {}\n",
    "transformer_engine/pytorch/__init__.py": f"""
import os
import sys
from types import SimpleNamespace
sys.path.insert(0, {str(REPO)!r})
here = os.getcwd()
os.chdir({str(REPO)!r})  # the tests' modules name their kernels relative to the checkout
from attn_doctor.backends import te as te_backend
from tests.test_te_wiring import StandInDotProductAttention as DotProductAttention
os.chdir(here)
from transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention import _attention_backends
te_backend._te = SimpleNamespace(state=_attention_backends)
""",
}


@pytest.mark.parametrize("fields", CASES.values(), ids=list(CASES))
def test_a_te_repro_calls_te_as_attn_doctor_does(fields, tmp_path):
    """A correct TE (the stand-in) passes its TE path's repro: the script's module and forward arguments, thd
    packing and sink reach TE as attn-doctor's do (tests/test_te_wiring.py checks attn-doctor's)."""
    for name, text in FAKE_TE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    case = make_case(**{**SMALL, **fields})
    layout = "kv_2hd" if case.qkv_format == "thd" and not case.mla else "contiguous"
    script = write_repro(tmp_path, Coords.call(case, BackendSpec("te.fused", "te", {"path": "fused"}), layout),
                         None, "test", "attn-doctor bisect")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "FIXED" in proc.stdout and ("'use_fused_attention': True, 'fused_attention_backend': 1} on cuDNN 91400"
                                       in proc.stdout
                                       or case.softmax == "learnable")  # the short form's readback (the full's below)
    full = write_repro(tmp_path / "full", Coords.call(case, BackendSpec("te.fused", "te", {"path": "fused"}), layout),
                       None, "test", "attn-doctor bisect", full=True)
    proc = subprocess.run([sys.executable, str(full)], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0 and "TE ran: FusedAttention sub-backend 1" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_flash_style_kernel_s_repro_judges_it_with_its_own_output_rounding(tmp_path):
    """The repro of a flash-style kernel computes what its output rounding makes on the case, with attn-doctor's
    formula (`standalone.output_rounding_moves`), and judges its dQ and dK with it: on the deep-layer inputs a
    correct flash-style kernel's script exits 0, and the same script told the kernel is not flash-style exits 1
    (its dQ's worst head beyond the plain limit); a dQ 5% too large still exits 1."""
    kernels = Path(__file__).resolve().parent / "kernels" / "flash_style.py"
    case = make_case(batch=4, seq=1024, heads=16, head_dim=64, dtype="bf16", mask="causal", inputs="deep-layer")

    def run(kernel: str, flash_style: bool | None = None) -> subprocess.CompletedProcess:
        script = write_repro(tmp_path / kernel, Coords.call(case, parse_kernel_spec(f"{kernels}:{kernel}")), None,
                             "test", "attn-doctor bisect", full=True)
        text = script.read_text()
        assert "FLASH_STYLE = True" in text and "def output_rounding_moves" in text
        if flash_style is not None:
            script.write_text(text.replace("FLASH_STYLE = True", f"FLASH_STYLE = {flash_style}"))
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                              env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2"})

    correct = run("flash_style")
    assert correct.returncode == 0 and "FIXED" in correct.stdout, correct.stdout + correct.stderr
    plain = run("flash_style", flash_style=False)
    assert plain.returncode == 1 and "dq" in plain.stdout.split("STILL WRONG:")[-1], plain.stdout + plain.stderr
    wrong = run("dq_five_percent")
    assert wrong.returncode == 1 and "systematic" in wrong.stdout, wrong.stdout + wrong.stderr
