"""The module paths (`te.mha`, `te.layer`: TE's MultiheadAttention and TransformerLayer as layers) on the CPU,
against stand-ins for TE's modules written in plain torch: TE's structure and parameter names, computed with
other (correct) roundings than attn-doctor's replicas (RoPE in the dtype as TE's unfused RoPE, attention with
fp32 scores and softmax); a correct stand-in PASSes, a fault in its core attention FAILs as attention's, and a
fault elsewhere FAILs as the layer's, at its stage, with attention passing."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from attn_doctor.backends import BackendSpec, build, is_layer_path, select
from attn_doctor.backends import te as te_backend
from attn_doctor.backends.te_module import layer_unsupported
from attn_doctor.core.case import make_case
from attn_doctor.core.coords import Coords
from attn_doctor.numerics import layer
from attn_doctor.probes import run_probe
from attn_doctor.probes.caches import Caches
from attn_doctor.probes.plan import plan_calls
from attn_doctor.results.row import Row
from attn_doctor.verdict.judge import judge
from attn_doctor.verdict.rule import FAIL, PASS

FAULTS = {"scale": 1.0, "drop_key": False, "rope_base": 10000.0, "proj_bias": 1.0, "mlp_bias": 1.0}


def faults(**changed):
    return {**FAULTS, **changed}


class StandInDPA(torch.nn.Module):
    """DotProductAttention: fp32 scores and softmax, probabilities rounded to the dtype, GQA by repeat."""

    def __init__(self, heads, head_dim, kv_heads, fmt, fault, state):
        super().__init__()
        self.heads, self.head_dim, self.kv_heads, self.fmt, self.fault, self.state = (
            heads, head_dim, kv_heads, fmt, fault, state)

    def forward(self, q, k, v, attn_mask_type="causal", window_size=None, **_):
        self.state.update(use_unfused_attention=True, use_flash_attention=False, use_fused_attention=False)
        if self.fmt == "sbhd":
            q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        group = self.heads // self.kv_heads
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, d]
        scale = self.fault["scale"] / math.sqrt(self.head_dim)
        scores = (qh.float() @ kh.float().transpose(-1, -2)) * scale
        seq = scores.shape[-1]
        offset = torch.arange(seq)[None, :] - torch.arange(seq)[:, None]  # key - query
        left, right = window_size if window_size is not None else (-1, -1)
        hidden = (offset > 0) if "causal" in attn_mask_type else torch.zeros(seq, seq, dtype=torch.bool)
        if left >= 0:
            hidden |= offset < -left
        if right >= 0:
            hidden |= offset > right
        scores = scores.masked_fill(hidden, float("-inf"))
        if self.fault["drop_key"]:
            scores[..., 0] = float("-inf")  # key 0 never attended (query 0 then sees nothing)
        probs = torch.nan_to_num(torch.softmax(scores, -1)).to(q.dtype)
        out = (probs @ vh).transpose(1, 2)  # [b, s, h, d]
        if self.fmt == "sbhd":
            out = out.transpose(0, 1)
        return out.reshape(*out.shape[:2], self.heads * self.head_dim)


def unfused_rope(t, freqs, fmt, base_fault):
    """TE's unfused apply_rotary_pos_emb: cos and sin rounded to the dtype, the rest in the dtype."""
    if base_fault != layer.ROPE_BASE:
        freqs = layer.rotary_frequencies(freqs.shape[0], freqs.shape[-1], freqs.device, base=base_fault)
    freqs = freqs[: t.shape[0] if fmt == "sbhd" else t.shape[1]]
    if fmt == "bshd":
        freqs = freqs.transpose(0, 1)
    cos, sin = torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype)
    t1, t2 = torch.chunk(t, 2, dim=-1)
    return t * cos + torch.cat((-t2, t1), dim=-1) * sin


class StandInLayerNormLinear(torch.nn.Module):
    def __init__(self, hidden, out, dtype):
        super().__init__()
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype))
        self.weight = torch.nn.Parameter(torch.empty(out, hidden, dtype=dtype))
        self.bias = torch.nn.Parameter(torch.zeros(out, dtype=dtype))

    def forward(self, x):
        normed = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, 1e-5)
        return F.linear(normed, self.weight, self.bias)


class StandInMHA(torch.nn.Module):
    """MultiheadAttention (fused QKV, interleaved per kv group), as TE splits and rotates."""

    def __init__(self, hidden, heads, kv_channels=None, num_gqa_groups=None, attn_mask_type="causal",
                 qkv_format="sbhd", input_layernorm=False, params_dtype=torch.float32, return_bias=False,
                 fuse_qkv_params=False, window_size=None, *, fault, state, **_):
        super().__init__()
        assert fuse_qkv_params
        self.fault, self.state, self.window = fault, state, window_size
        self.heads, self.kv_heads, self.head_dim = heads, num_gqa_groups, kv_channels
        self.mask, self.fmt, self.return_bias = attn_mask_type, qkv_format, return_bias
        out = (heads + 2 * num_gqa_groups) * kv_channels
        if input_layernorm:
            self.layernorm_qkv = StandInLayerNormLinear(hidden, out, params_dtype)
        else:
            self.qkv = torch.nn.Linear(hidden, out, dtype=params_dtype)
        self.core_attention = StandInDPA(heads, kv_channels, num_gqa_groups, qkv_format, self.fault, self.state)
        self.proj = torch.nn.Linear(hidden, hidden, dtype=params_dtype)

    def forward(self, x, rotary_pos_emb=None, attn_mask_type=None):
        mixed = self.layernorm_qkv(x) if hasattr(self, "layernorm_qkv") else self.qkv(x)
        group = self.heads // self.kv_heads
        mixed = mixed.view(*mixed.shape[:2], self.kv_heads, group + 2, self.head_dim)
        q, k, v = torch.split(mixed, [group, 1, 1], dim=-2)
        q, k, v = (t.reshape(*t.shape[:2], -1, self.head_dim) for t in (q, k, v))
        q = unfused_rope(q, rotary_pos_emb, self.fmt, self.fault["rope_base"])
        k = unfused_rope(k, rotary_pos_emb, self.fmt, self.fault["rope_base"])
        context = self.core_attention(q, k, v, attn_mask_type=attn_mask_type or self.mask, window_size=self.window)
        out = F.linear(context, self.proj.weight)
        bias = self.proj.bias * self.fault["proj_bias"]
        return (out, bias) if self.return_bias else out + bias


class StandInLayerNormMLP(torch.nn.Module):
    def __init__(self, hidden, ffn, dtype):
        super().__init__()
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype))
        self.fc1_weight = torch.nn.Parameter(torch.empty(ffn, hidden, dtype=dtype))
        self.fc1_bias = torch.nn.Parameter(torch.zeros(ffn, dtype=dtype))
        self.fc2_weight = torch.nn.Parameter(torch.empty(hidden, ffn, dtype=dtype))
        self.fc2_bias = torch.nn.Parameter(torch.zeros(hidden, dtype=dtype))


class StandInTransformerLayer(torch.nn.Module):
    def __init__(self, hidden, ffn, heads, num_gqa_groups=None, kv_channels=None, self_attn_mask_type="causal",
                 params_dtype=torch.float32, activation="gelu", attn_input_format="sbhd", window_size=None, *, fault,
                 state, **rest):
        super().__init__()
        assert activation == "relu"
        self.fault = fault
        self.self_attention = StandInMHA(hidden, heads, kv_channels, num_gqa_groups, self_attn_mask_type,
                                         attn_input_format, input_layernorm=True, params_dtype=params_dtype,
                                         return_bias=True, fuse_qkv_params=rest["fuse_qkv_params"],
                                         window_size=window_size, fault=fault,
                                         state=state)
        self.layernorm_mlp = StandInLayerNormMLP(hidden, ffn, params_dtype)

    def forward(self, x, rotary_pos_emb=None):
        out, bias = self.self_attention(x, rotary_pos_emb=rotary_pos_emb)
        h = x + (out + bias)
        mlp = self.layernorm_mlp
        normed = F.layer_norm(h, h.shape[-1:], mlp.layer_norm_weight, mlp.layer_norm_bias, 1e-5)
        inner = torch.relu(F.linear(normed, mlp.fc1_weight, mlp.fc1_bias))
        return h + (F.linear(inner, mlp.fc2_weight) + mlp.fc2_bias * self.fault["mlp_bias"])


def rotary(head_dim):
    return lambda seq: layer.rotary_frequencies(seq, head_dim, torch.device("cpu"))


@pytest.fixture
def stand_in(monkeypatch):
    """TE's loader answering with the stand-ins; returns a function setting the faults."""
    state = {"backend_selection_requires_update": True}

    def set_faults(**changed):
        chosen = faults(**changed)

        def mha(*args, **kwargs):
            return StandInMHA(*args, fault=chosen, state=state, **kwargs)

        def transformer_layer(*args, **kwargs):
            return StandInTransformerLayer(*args, fault=chosen, state=state, **kwargs)

        fake = SimpleNamespace(te=SimpleNamespace(MultiheadAttention=mha, TransformerLayer=transformer_layer,
                                                  RotaryPositionEmbedding=rotary),
                               state=state, capture=SimpleNamespace(lines=[]))
        monkeypatch.setattr(te_backend, "_te", fake)
        return fake

    monkeypatch.setattr(te_backend, "_import_error", None)
    set_faults()
    return set_faults


CASE = dict(batch=2, seq=48, heads=4, kv_heads=2, head_dim=16, dtype="bf16", mask="causal")


def judged(module: str, **fields) -> Row:
    """The layer path's row for the case, probed and judged (the baseline's single call beside it)."""
    case = make_case(**{**CASE, **fields})
    spec = next(spec for spec in select(["te.module"]) if spec.options["module"] == module)
    caches = Caches(torch.device("cpu"))
    coords = [c for c in plan_calls(case, [spec], ["contiguous"])]
    rows = []
    for c in coords:
        outcome = run_probe(build(c.backend), c, caches)
        assert outcome.status == "ok", outcome.reason
        rows.append(Row(coords=c, verdict="", ran=outcome.ran, metrics=outcome.metrics, extra=outcome.extra,
                        flash_style=outcome.flash_style))
    judge(rows)
    return next(row for row in rows if row.backend == spec.name)


@pytest.mark.parametrize("module", ["mha", "layer"])
@pytest.mark.parametrize("fields", [{}, {"qkv_format": "bshd", "mask": "no_mask"}, {"kv_heads": 4, "window": (8, 0)}],
                         ids=["sbhd causal GQA", "bshd no mask", "MHA window"])
def test_a_correct_layer_passes(stand_in, module, fields):
    row = judged(module, **fields)
    assert row.verdict == PASS, row.reason
    assert set(row.tensors) == {"out", "dq", "dk", "dv", "layer_q", "layer_k", "layer_v", "layer_dcontext",
                                "layer_out", "layer_dx"}
    assert row.layout == "sbh3d_packed" and row.reason == ""
    assert "DotProductAttention: UnfusedDotProductAttention" in row.ran  # read back from (the stand-in's) TE state


@pytest.mark.parametrize("module", ["mha", "layer"])
@pytest.mark.parametrize("fault", [{"scale": 1.05}, {"drop_key": True}], ids=["softmax scale", "dropped key"])
def test_a_fault_in_attention_is_named_as_attention(stand_in, module, fault):
    stand_in(**fault)
    row = judged(module)
    assert row.verdict == FAIL
    assert row.reason.startswith("fault in attention: TE's core attention in the layer fails (")
    assert "on the q, k, v it received" in row.extra["layer"]["where"]
    assert any(row.tensors[name].verdict == FAIL for name in ("out", "dq", "dk", "dv"))
    for name in ("layer_q", "layer_k", "layer_v"):  # upstream of attention: untouched
        assert row.tensors[name].verdict == PASS
    assert "and a fault outside attention" not in row.reason


@pytest.mark.parametrize("module", ["mha", "layer"])
def test_a_wrong_rope_is_a_fault_before_attention(stand_in, module):
    stand_in(rope_base=5000.0)
    row = judged(module)
    assert row.verdict == FAIL
    assert row.reason.startswith("fault outside attention in the layer, before attention: the q, k, v it received")
    assert row.extra["layer"]["where"].endswith("the core attention passes on the q, k, v it received")
    assert "the same layer's own error in bf16 in plain torch" in row.tensors["layer_q"].why
    assert all(row.tensors[name].verdict == PASS for name in ("out", "dq", "dk", "dv"))
    assert row.tensors["layer_q"].verdict == FAIL and row.tensors["layer_k"].verdict == FAIL
    assert row.tensors["layer_v"].verdict == PASS


@pytest.mark.parametrize("module,fault", [("mha", {"proj_bias": 1.5}), ("layer", {"proj_bias": 1.5}),
                                          ("layer", {"mlp_bias": 0.0})])
def test_a_wrong_bias_after_attention_is_named_so(stand_in, module, fault):
    stand_in(**fault)
    row = judged(module)
    assert row.verdict == FAIL
    assert row.reason.startswith("fault outside attention in the layer, after attention: the layer's output")
    assert all(row.tensors[name].verdict == PASS for name in ("out", "dq", "dk", "dv", "layer_q", "layer_k",
                                                              "layer_v", "layer_dx"))


def test_the_layer_paths_are_opt_in_planned_once_on_their_layout_and_refuse_what_they_do_not_model():
    assert not any(is_layer_path(spec) for spec in select([]))  # a run that names no backend keeps its rows
    assert [spec.name for spec in select(["te.module"])] == ["te.mha", "te.layer"]
    spec = select(["te.mha"])[0]
    assert is_layer_path(spec) and not is_layer_path(select(["local"])[0])
    case = make_case(**CASE)
    planned = plan_calls(case, [spec], ["contiguous", "head_slice"])
    assert [(c.backend.name, c.layout) for c in planned] == [("local", "contiguous"), ("te.mha", "sbh3d_packed")]
    assert layer_unsupported(case) is None
    assert "fp32" in layer_unsupported(make_case(**{**CASE, "dtype": "fp32"}))
    assert "padding" in layer_unsupported(make_case(**{**CASE, "mask": "padding", "seqlens": (48, 20)}))
    assert "inputs" in layer_unsupported(make_case(**{**CASE, "inputs": "outliers"}))
    assert Coords.call(make_case(**{**CASE, "seq_kv": 32}), spec, "sbh3d_packed").unsupported()


def test_repeats_are_refused_for_a_layer_not_ignored(stand_in):
    spec = select(["te.layer"])[0]
    outcome = run_probe(build(spec), Coords.call(make_case(**CASE), spec, "sbh3d_packed"), Caches(torch.device("cpu")),
                        repeats=3)
    assert outcome.status == "skip" and "--repeats" in outcome.reason


def test_a_flash_style_core_attention_is_judged_with_its_own_rounding(stand_in):
    """What ran is read back: a fused (flash-style) core attention's dQ and dK get the flash-style part of the
    yardstick, as a single call of a flash-style path does; the correct stand-in still PASSes."""
    fake = stand_in()
    original = StandInDPA.forward

    def fused(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        self.state.update(use_unfused_attention=False, use_fused_attention=True, fused_attention_backend=1)
        return out

    StandInDPA.forward = fused
    try:
        row = judged("mha")
    finally:
        StandInDPA.forward = original
    assert row.verdict == PASS, row.reason
    assert "FusedAttention (sub-backend 1" in row.ran
    assert row.extra["layer"]["flash_style"] and set(row.extra["layer"]["flash_style_part"]) == {"dq", "dk"}
    assert row.tensors["dq"].flash_style_err is not None and row.tensors["out"].flash_style_err is None
    assert fake.state["backend_selection_requires_update"] is True  # invalidated before the forward, as te.py does


def test_nan_from_the_core_attention_fails_as_attention(stand_in):
    original = StandInDPA.forward

    def nan_row(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out.index_fill(0, torch.tensor([3]), float("nan"))

    StandInDPA.forward = nan_row
    try:
        row = judged("mha")
    finally:
        StandInDPA.forward = original
    assert row.verdict == FAIL and row.tensors["out"].nan
    assert row.reason.startswith("fault in attention") and "NaN" in row.reason


def test_a_crash_in_the_module_is_the_kernels_and_a_blind_hook_is_attn_doctors(stand_in):
    from attn_doctor.core.errors import InternalError, KernelError

    case = make_case(**CASE)
    spec = select(["te.mha"])[0]
    coords = Coords.call(case, spec, "sbh3d_packed")
    original = StandInDPA.forward

    def crash(self, *args, **kwargs):
        raise RuntimeError("CUDNN_STATUS_EXECUTION_FAILED")

    StandInDPA.forward = crash
    try:
        with pytest.raises(KernelError, match="CUDNN_STATUS_EXECUTION_FAILED"):
            run_probe(build(spec), coords, Caches(torch.device("cpu")))
    finally:
        StandInDPA.forward = original
    original_mha = StandInMHA.forward

    def around_attention(self, x, rotary_pos_emb=None, attn_mask_type=None):  # never calls core_attention
        return self.proj(x)

    StandInMHA.forward = around_attention
    try:
        with pytest.raises(InternalError, match="hooks saw 0 forward"):
            run_probe(build(spec), coords, Caches(torch.device("cpu")))
    finally:
        StandInMHA.forward = original_mha


def test_a_layer_row_renders_in_the_table_the_reports_and_the_summary(stand_in, tmp_path):
    import io
    import subprocess
    import sys

    from rich.console import Console

    from attn_doctor.render.terminal import run_view
    from attn_doctor.results.report import dumps
    from attn_doctor.workflows.run import make_report

    stand_in(rope_base=5000.0)
    case = make_case(**CASE)
    specs = select(["te.mha"])
    caches = Caches(torch.device("cpu"))
    rows = []
    for c in plan_calls(case, specs, ["contiguous"]):
        outcome = run_probe(build(c.backend), c, caches)
        rows.append(Row(coords=c, verdict="", ran=outcome.ran, metrics=outcome.metrics, extra=outcome.extra,
                        flash_style=outcome.flash_style))
    judge(rows)
    report = make_report(rows, specs, "cpu", "attn-doctor run --backend te.mha", read_te=False)
    assert "te.mha" in report.summary and report.exit_code != 0
    assert "the baseline's error" not in report.summary  # a layer is judged on its own yardsticks
    print(report.summary)
    console = Console(file=io.StringIO(), width=80)
    for part in run_view(report, "attn-doctor run"):
        console.print(part)
    text = console.file.getvalue()
    assert "te.mha" in text and "sbh3d_packed" in text and "fault outside attention" in text
    path = tmp_path / "results.json"
    path.write_text(dumps(report.to_dict()))
    texts = {}
    for fmt in ("markdown", "issue", "html", "csv", "json"):
        done = subprocess.run([sys.executable, "-m", "attn_doctor", "report", str(path), "--format", fmt],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (fmt, done.stderr[-2000:])
        assert "te.mha" in done.stdout, fmt
        texts[fmt] = done.stdout
    issue = texts["issue"]
    assert "not a Transformer Engine path" not in issue and "(forward)" in issue
    assert "In the layer: fault outside attention in the layer, before attention" in issue
    # the local baseline ran on the case's seeded q, k, v, not on the layer's: never shown as right "on the same inputs"
    assert "Paths that are right on the same inputs" not in issue
    assert "fault outside attention in the layer, before attention" in texts["markdown"]


def test_tp_shards_and_depth_stacks_of_a_layer_are_refused_as_skip(stand_in):
    spec = select(["te.mha"])[0]
    case = make_case(**{**CASE, "seq": 32})
    caches = Caches(torch.device("cpu"))
    for coords in (Coords.tp_shards(case, spec, 2, as_views=True), Coords.depth(case, spec, 2)):
        outcome = run_probe(build(spec), coords, caches)
        assert outcome.status == "skip" and "whole layer" in outcome.reason, coords.kind


def _te_importable() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not _te_importable(), reason="TE's layers need a CUDA GPU and transformer_engine")
@pytest.mark.parametrize("flags", [["--mask", "causal"], ["--mask", "no_mask", "--qkv-format", "bshd", "--kv-heads", "4"],
                                   ["--mask", "causal", "--window", "64,0", "--dtype", "fp16"]],
                         ids=["sbhd causal", "bshd GQA", "fp16 window"])
def test_real_te_layers_pass_and_say_what_ran(tmp_path, flags):
    """On a GPU with TE: TE's own MultiheadAttention and TransformerLayer PASS (a false FAIL here is the worst
    bug), and each row says which core attention TE ran, read back."""
    import json
    import subprocess
    import sys

    out = tmp_path / "results.json"
    done = subprocess.run([sys.executable, "-m", "attn_doctor", "run", "--device", "cuda", "--backend", "te.module",
                           "--batch", "2", "--seq", "512", "--heads", "16", "--head-dim", "64", *flags,
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    rows = {row["backend"]: row for row in json.loads(out.read_text())["results"]}
    for name in ("te.mha", "te.layer"):
        row = rows[name]
        assert row["verdict"] == "PASS", (name, row["reason"], done.stdout[-3000:])
        assert "> DotProductAttention: " in row["ran"] and "no backend" not in row["ran"]
        assert set(row["tensors"]) >= {"out", "dq", "dk", "dv", "layer_q", "layer_out", "layer_dx"}
    assert done.returncode == 0, done.stdout[-3000:]


def test_a_layer_s_borderline_advice_asks_only_what_a_layer_path_takes():
    from attn_doctor.verdict.diagnosis import CONFIRM, CONFIRM_LAYER, confirm_advice

    assert confirm_advice(False) == CONFIRM and "--repeats" in CONFIRM
    assert confirm_advice(True) == CONFIRM_LAYER and "another --seed" in CONFIRM_LAYER
    assert "takes neither --repeats nor --dtype fp32" in CONFIRM_LAYER
