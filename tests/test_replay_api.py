"""Replaying the calls of TE's and flash-attn's APIs (issue 17): packed thd calls come back token for token in
their own slots, TE's padding and arbitrary attention_masks, biases, softmax scales and FP8 recipes become the
case's, flash-attn's bottom-right causal and varlen calls are read as TE's names for them, and what cannot be
replayed says why."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

import attn_doctor
from attn_doctor.bisect.knobs import CATEGORICAL
from attn_doctor.core.coords import Coords
from attn_doctor.core.layouts import CAPTURED
from attn_doctor.numerics.inputs import make_inputs
from attn_doctor.tracing.replay_case import case_of
from attn_doctor.tracing.replay_source import CAPTURED_SOURCE, captured_views, view_geometry
from attn_doctor.tracing.replay_source import captured_packing as packing  # the slots the replay packs into
from attn_doctor.tracing.store import load_values, read_capture

ROOT = Path(__file__).resolve().parents[1]


class TEStandIn(torch.nn.Module):
    """TE's DotProductAttention as far as a capture sees it: its constructor's attributes and its forward's
    signature. What it computes is not attention (replay judges the paths on the captured inputs, not on the
    captured output); it only has to depend on q, k and v so that the backward reaches them."""

    def __init__(self, heads: int, qkv_format: str = "sbhd", attn_mask_type: str = "causal", softmax_scale=None):
        super().__init__()
        self.num_attention_heads, self.num_gqa_groups = heads, heads
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, None
        self.attention_dropout, self.softmax_type, self.attention_type = 0.0, "vanilla", "self"
        self.softmax_scale = softmax_scale

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None,
                max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None,
                core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None):
        out = query_layer * key_layer.sum() + value_layer
        return out.reshape(*out.shape[:-2], -1)


@pytest.fixture
def te_stand_in(monkeypatch):
    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = TEStandIn
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    return fake


def _capture_te(root: Path, module: TEStandIn, *tensors, **arguments):
    with attn_doctor.capture(root, values=True):
        out = TEStandIn.forward(module, *tensors, **arguments)
        out.sum().backward()
    (call,) = read_capture(root)
    return call


def _packed_thd(tokens: int, heads: int = 2, dim: int = 8) -> torch.Tensor:
    """A t3hd buffer (one fused QKV projection's output) whose slices are q, k, v."""
    return torch.randn(tokens, 3, heads, dim, requires_grad=True)


def test_a_side_without_padded_offsets_has_its_sequences_as_slots_in_the_case_and_its_packing(te_stand_in,
                                                                                              tmp_path):
    """TE takes a side's cu_seqlens as its padded offsets when the call gives none for it (never the other
    side's padded ones): the checks of the case and the slots the replay packs into must follow the same rule."""
    q, kv = (torch.randn(16, 2, 8, requires_grad=True) for _ in range(2))
    lengths_q, slots_q = torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([0, 7, 16], dtype=torch.int32)
    lengths_kv = torch.tensor([0, 8, 16], dtype=torch.int32)
    module = TEStandIn(2, qkv_format="thd", attn_mask_type="padding")
    call = _capture_te(tmp_path / "cap", module, q, kv, kv, cu_seqlens_q=lengths_q, cu_seqlens_kv=lengths_kv,
                       cu_seqlens_q_padded=slots_q, max_seqlen_q=9, max_seqlen_kv=8)
    case = case_of(call, tmp_path / "cap")
    assert not isinstance(case, str), case
    assert (case.seqlens, case.seqlens_kv, case.pad_between_seqs) == ((5, 3), (8, 8), True)
    assert (packing(case).slots_q, packing(case).slots_kv) == ((7, 9), (8, 8))


def test_a_packed_thd_call_comes_back_token_for_token_in_its_own_slots(te_stand_in, run_cli, tmp_path):
    buffer = _packed_thd(16)
    offsets, slots = torch.tensor([0, 5, 8], dtype=torch.int32), torch.tensor([0, 7, 16], dtype=torch.int32)
    module = TEStandIn(2, qkv_format="thd", attn_mask_type="padding_causal")
    call = _capture_te(tmp_path / "cap", module, buffer[:, 0], buffer[:, 1], buffer[:, 2], cu_seqlens_q=offsets,
                       cu_seqlens_kv=offsets, cu_seqlens_q_padded=slots, cu_seqlens_kv_padded=slots,
                       max_seqlen_q=9, max_seqlen_kv=9)
    case = case_of(call, tmp_path / "cap")
    assert (case.qkv_format, case.mask, case.seqlens, case.pad_between_seqs, case.seq) == (
        "thd", "padding_causal", (5, 3), True, 9)
    assert packing(case).slots_q == (7, 9)  # the call's own slots, not attn-doctor's padding rule
    x = make_inputs(case, torch.device("cpu"), CAPTURED_SOURCE)
    qkv = captured_views(case, x.q, x.k, x.v, "thd")
    values = load_values(call.values_path)
    for name, view in zip("qkv", (qkv.q, qkv.k, qkv.v)):
        captured = call.meta["tensors"][name]
        assert view_geometry(view) == {"shape": captured["shape"], "stride": captured["stride"],
                                       "storage_offset": captured["storage_offset"],
                                       "storage_nbytes": captured["storage"]["nbytes"]}
        assert torch.equal(view, values[name])  # every token, slot padding included, where the run had it
    assert len(qkv.leaves) == 1
    result = run_cli(["replay", tmp_path / "cap", "--backend", "sdpa.math", "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "r" / "results.json").read_text())["results"]
    assert {(r["layout"], r["verdict"]) for r in rows if r["backend"] == "sdpa.math"} == {
        ("contiguous", "PASS"), (CAPTURED, "SKIP")}  # SDPA takes padded bshd: TE's paths take the packed views


class PackedTEStandIn(TEStandIn):
    """TE >= 2.20's DotProductAttention as far as a capture sees it: q, k, v may come packed in qkv_layer (all
    three) or kv_layer (k and v), selected along qkv_interleave_dim; MultiheadAttention passes them so."""

    def forward(self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None, qkv_format=None,
                qkv_layer=None, kv_layer=None, qkv_interleave_dim=-3):
        if qkv_layer is not None:
            query_layer, key_layer, value_layer = (qkv_layer.select(qkv_interleave_dim, i) for i in range(3))
        elif kv_layer is not None:
            key_layer, value_layer = (kv_layer.select(qkv_interleave_dim, i) for i in range(2))
        return super().forward(query_layer, key_layer, value_layer)


@pytest.mark.slow
@pytest.mark.parametrize("packed_as", ["qkv_layer", "qkv_layer at -2", "kv_layer"])
def test_te_packed_qkv_layer_is_captured_as_the_views_te_selects_and_replayed(packed_as, run_cli, tmp_path,
                                                                              monkeypatch):
    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = PackedTEStandIn
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    b, s, h, d = 2, 8, 2, 16
    q = None
    if packed_as == "kv_layer":
        q, packed, dim = torch.randn(b, s, h, d, requires_grad=True), torch.randn(b, s, 2, h, d), -3
        arguments = {"kv_layer": packed.requires_grad_()}
    else:
        dim = -2 if packed_as.endswith("-2") else -3
        packed = torch.randn(b, s, h, 3, d) if dim == -2 else torch.randn(b, s, 3, h, d)
        arguments = {"qkv_layer": packed.requires_grad_(), **({"qkv_interleave_dim": -2} if dim == -2 else {})}
    module = PackedTEStandIn(h, qkv_format="bshd")
    with attn_doctor.capture(tmp_path / "cap", values=True):
        PackedTEStandIn.forward(module, q, **arguments).square().sum().backward()
    (call,) = read_capture(tmp_path / "cap")
    derived = "qkv" if q is None else "kv"  # the names TE gives the slices of the packed buffer
    views = {name: packed.select(dim, i) for i, name in enumerate(derived)} | ({} if q is None else {"q": q})
    tensors, values = call.meta["tensors"], load_values(call.values_path)
    packed_meta = call.meta["arguments"][next(iter(arguments))]["tensor"]
    for name, view in views.items():  # the very views TE reads: its storage, strides and offsets, and values
        assert tensors[name]["shape"] == list(view.shape) and tensors[name]["stride"] == list(view.stride())
        assert tensors[name]["storage_offset"] == view.storage_offset()
        assert torch.equal(values[name], view.detach())
        gradient = load_values(call.values_path.with_name(call.values_path.stem + f".d{name}.safetensors"))
        expected = packed.grad.select(dim, derived.index(name)) if name in derived else q.grad
        assert torch.equal(gradient[f"d{name}"], expected)
        if name in derived:
            assert tensors[name]["storage"] == packed_meta["storage"]
    assert not any(key.startswith("arg.") for key in values)  # the packed buffer is q, k, v's values already
    case = case_of(call, tmp_path / "cap")
    assert not isinstance(case, str), case
    assert (case.qkv_format, case.heads, case.head_dim, case.seq) == ("bshd", h, d, s)
    result = run_cli(["replay", tmp_path / "cap", "--backend", "sdpa.math", "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "r" / "results.json").read_text())["results"]
    assert {(r["layout"], r["verdict"]) for r in rows if r["backend"] == "sdpa.math"} >= {("contiguous", "PASS")}


def test_a_packed_call_captured_without_its_views_says_capture_again(run_cli, tmp_path, monkeypatch):
    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = PackedTEStandIn
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    from attn_doctor.tracing import describe

    monkeypatch.setattr(describe, "unpacked", lambda q, k, v, arguments: (q, k, v))  # as attn-doctor before
    with attn_doctor.capture(tmp_path / "cap"):
        PackedTEStandIn.forward(PackedTEStandIn(2, qkv_format="bshd"), qkv_layer=torch.randn(1, 4, 3, 2, 8))
    (call,) = read_capture(tmp_path / "cap")
    assert "capture again" in case_of(call, tmp_path / "cap")


def test_packed_tensors_with_tokens_outside_every_sequence_say_why(te_stand_in, tmp_path):
    buffer = _packed_thd(12)
    offsets = torch.tensor([0, 5, 8], dtype=torch.int32)
    module = TEStandIn(2, qkv_format="thd", attn_mask_type="padding")
    call = _capture_te(tmp_path / "cap", module, buffer[:, 0], buffer[:, 1], buffer[:, 2], cu_seqlens_q=offsets,
                       cu_seqlens_kv=offsets, max_seqlen_q=5, max_seqlen_kv=5)
    assert "12 q tokens, 8 of them in sequences" in case_of(call, tmp_path / "cap")


def test_a_te_padding_attention_mask_gives_the_lengths_and_must_be_right_padding(te_stand_in, tmp_path):
    q, k, v = (torch.randn(2, 6, 2, 8, requires_grad=True) for _ in range(3))  # bshd
    module = TEStandIn(2, qkv_format="bshd", attn_mask_type="padding")
    right = torch.arange(6)[None, None, None, :] >= torch.tensor([6, 4])[:, None, None, None]  # True = padding
    case = case_of(_capture_te(tmp_path / "a", module, q, k, v, attention_mask=right), tmp_path / "a")
    assert case.seqlens == (6, 4) and case.seqlens_kv is None
    keys = torch.arange(6)[None, None, None, :] >= torch.tensor([3, 5])[:, None, None, None]
    case = case_of(_capture_te(tmp_path / "b", module, q, k, v, attention_mask=(right, keys)), tmp_path / "b")
    assert (case.seqlens, case.seqlens_kv) == ((6, 4), (3, 5))
    left = right.flip(-1)
    reason = case_of(_capture_te(tmp_path / "c", module, q, k, v, attention_mask=left), tmp_path / "c")
    assert "not right padding" in reason


@pytest.mark.slow
def test_a_te_arbitrary_mask_and_bias_are_the_captured_ones(te_stand_in, run_cli, tmp_path):
    q, k, v = (torch.randn(6, 2, 2, 8, requires_grad=True) for _ in range(3))  # sbhd
    hidden = torch.rand(2, 1, 6, 6) < 0.3  # TE: True = masked out
    bias = torch.randn(1, 2, 6, 6)
    module = TEStandIn(2, qkv_format="sbhd", attn_mask_type="arbitrary")
    call = _capture_te(tmp_path / "cap", module, q, k, v, attention_mask=hidden,
                       core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    case = case_of(call, tmp_path / "cap")
    assert (case.mask, case.mask_source, case.bias) == ("arbitrary", "captured", "post_scale_bias:1hss")
    semantics = make_inputs(case, torch.device("cpu"), CAPTURED_SOURCE).semantics
    assert torch.equal(semantics.allowed, ~hidden) and torch.equal(semantics.bias, bias)
    result = run_cli(["replay", tmp_path / "cap", "--backend", "sdpa.math", "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 0, result.output
    # Without its capture (the bisect's first step) the mask is a random one of the same kind, the bias seeded.
    (knob,) = [k for k in CATEGORICAL if k.name == "replay"]
    from attn_doctor.backends import select

    plain = knob.simplify(Coords.call(case, select(["sdpa.math"])[0], CAPTURED), None)
    assert plain.case.replay is None and plain.case.mask_source.startswith("random:") and plain.layout == "contiguous"


@pytest.mark.slow
def test_a_te_softmax_scale_is_the_case_scale_and_a_kernel_that_ignores_it_fails(te_stand_in, run_cli, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)  # run writes its results under ./attn-doctor-results
    q, k, v = (torch.randn(8, 1, 2, 16, requires_grad=True) for _ in range(3))
    call = _capture_te(tmp_path / "cap", TEStandIn(2, softmax_scale=0.5), q, k, v)
    case = case_of(call, tmp_path / "cap")
    assert case.scale == 0.5 and case.softmax_scale == 0.5
    ok = run_cli(["run", "--replay", case.replay, "--backend", "sdpa.math", "--device", "cpu"])
    assert ok.exit_code == 0, ok.output
    blind = f"{ROOT / 'tests' / 'kernels' / 'faulty.py'}:scale_blind"
    wrong = run_cli(["run", "--replay", case.replay, "--kernel", blind, "--device", "cpu"])
    assert wrong.exit_code == 1, wrong.output
    plain = run_cli(["run", "--seq", "8", "--batch", "1", "--heads", "2", "--head-dim", "16", "--kernel", blind,
                     "--device", "cpu"])
    assert plain.exit_code == 0, plain.output  # at the default scale the same kernel is right


def test_fp8_recipes_replay_when_attn_doctor_runs_them_and_say_why_otherwise():
    from attn_doctor.tracing.replay_case import _fp8_recipe

    delayed = {"type": "DelayedScaling", "fp8_dpa": True, "format": "HYBRID", "margin": 0}
    assert _fp8_recipe(delayed) == ("delayed", None)
    assert _fp8_recipe({**delayed, "type": "Float8CurrentScaling"}) == ("current", None)
    assert _fp8_recipe({**delayed, "fp8_dpa": False}) == ("none", None)  # FP8 GEMMs, attention in bf16
    assert "MXFP8BlockScaling" in _fp8_recipe({**delayed, "type": "MXFP8BlockScaling"})[1]
    assert "E4M3" in _fp8_recipe({**delayed, "format": "E4M3"})[1]
    assert "older attn-doctor" in _fp8_recipe("recipe_type=DelayedScaling, ...")[1]


def test_the_fp8_recipe_of_the_run_is_recorded(te_stand_in, monkeypatch, tmp_path):
    class DelayedScaling:  # TE's recipe as the capture reads it: its class name and attributes
        fp8_dpa, margin, fp8_format = True, 0, "Format.HYBRID"

    recipe = DelayedScaling()
    manager = types.SimpleNamespace(is_fp8_enabled=lambda: True, get_fp8_recipe=lambda: recipe)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.fp8",
                        types.SimpleNamespace(FP8GlobalStateManager=manager))
    q, k, v = (torch.randn(8, 1, 2, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    call = _capture_te(tmp_path / "cap", TEStandIn(2), q, k, v)
    assert call.meta["arguments"]["module"]["fp8_recipe"]["type"] == "DelayedScaling"
    assert case_of(call, tmp_path / "cap").fp8 == "delayed"


def test_flash_attn_calls_are_read_with_their_bottom_right_alignment_and_varlen_as_thd(monkeypatch, tmp_path):
    flash = types.ModuleType("flash_attn")

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        return q * (k.sum() + v.sum())

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        return q * (k.sum() + v.sum())

    flash.flash_attn_func, flash.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", flash)
    q, k = torch.randn(1, 4, 2, 8), torch.randn(1, 6, 2, 8)
    packed_q, packed_kv = torch.randn(7, 2, 8), torch.randn(9, 2, 8)
    with attn_doctor.capture(tmp_path / "cap"):
        flash.flash_attn_func(q, k, k, causal=True)
        flash.flash_attn_varlen_func(packed_q, packed_kv, packed_kv, torch.tensor([0, 3, 7], dtype=torch.int32),
                                     torch.tensor([0, 4, 9], dtype=torch.int32), 4, 5, causal=True, softcap=0.0)
        flash.flash_attn_func(q, k, k, softcap=30.0)
    dense, varlen, capped = (case_of(c, tmp_path / "cap") for c in read_capture(tmp_path / "cap"))
    assert (dense.mask, dense.seq, dense.seq_kv) == ("causal_bottom_right", 4, 6)
    assert (varlen.qkv_format, varlen.mask, varlen.seqlens, varlen.seqlens_kv, varlen.pad_between_seqs) == (
        "thd", "padding_causal_bottom_right", (3, 4), (4, 5), False)
    assert capped == "softcap 30.0 (attn-doctor checks uncapped scores)"


def test_te_reasons_for_its_choice_are_recorded_without_printing_and_its_logging_is_left_as_it_was(
        te_stand_in, monkeypatch, tmp_path, capsys):
    import logging

    base = "transformer_engine.pytorch.attention.dot_product_attention"
    params = types.SimpleNamespace(qkv_layout="sbhd_sbhd_sbhd", deterministic=False)
    state = {"attention_params": params, "use_fused_attention": True, "fused_attention_backend": 1}
    logger = logging.getLogger("DotProductAttention")
    stream = logging.StreamHandler()  # what TE attaches on its first call: it must print nothing of ours
    monkeypatch.setattr(logger, "handlers", [stream])
    selections = []

    def get_attention_backend(attention_params):
        selections.append(attention_params)
        logging.getLogger("DotProductAttention").setLevel(utils.AttentionLogging._log_level)
        logging.getLogger("DotProductAttention").debug("Disabling FlashAttention for head_dim > 256")
        logging.getLogger("DotProductAttention").debug("Running with config={...}")
        logging.getLogger("DotProductAttention").debug("Selected backend = FusedAttention (sub-backend 1)")

    utils = types.SimpleNamespace(AttentionLogging=types.SimpleNamespace(_log_level=logging.WARNING),
                                  get_attention_backend=get_attention_backend)
    monkeypatch.setitem(sys.modules, base + ".dot_product_attention",
                        types.SimpleNamespace(_attention_backends=state))
    monkeypatch.setitem(sys.modules, base + ".utils", utils)
    q, k, v = (torch.randn(8, 1, 2, 16, requires_grad=True) for _ in range(3))
    with attn_doctor.capture(tmp_path / "cap"):
        for _ in range(3):  # TE selects once for these parameters: its reasons are read once
            TEStandIn.forward(TEStandIn(2), q, k, v)
    calls = read_capture(tmp_path / "cap")
    assert [c.meta["te"]["reasons"] for c in calls] == [[
        "Disabling FlashAttention for head_dim > 256", "Selected backend = FusedAttention (sub-backend 1)"]] * 3
    assert calls[0].meta["te"]["backend"] == "FusedAttention (sub-backend 1: F16_arbitrary_seqlen)"
    assert selections == [params]
    with attn_doctor.capture(tmp_path / "again"):  # a TE that makes a new parameters object per call
        for _ in range(3):
            state["attention_params"] = types.SimpleNamespace(**vars(params))
            TEStandIn.forward(TEStandIn(2), q, k, v)
    assert len(selections) == 4  # read again for each: an id is never taken for another object's
    assert all(c.meta["te"]["reasons"] for c in read_capture(tmp_path / "again"))
    assert logger.handlers == [stream] and utils.AttentionLogging._log_level == logging.WARNING
    assert "Disabling" not in capsys.readouterr().err


def test_cu_seqlens_are_read_once_per_tensor_and_again_after_an_in_place_change(te_stand_in, tmp_path):
    buffer = _packed_thd(8)
    offsets = torch.tensor([0, 5, 8], dtype=torch.int32)
    module = TEStandIn(2, qkv_format="thd", attn_mask_type="padding")
    with attn_doctor.capture(tmp_path / "cap"):
        for change in (False, True):
            if change:
                offsets[1] = 3
            TEStandIn.forward(module, buffer[:, 0], buffer[:, 1], buffer[:, 2], cu_seqlens_q=offsets,
                              cu_seqlens_kv=offsets, max_seqlen_q=5, max_seqlen_kv=5)
    first, second = (case_of(c, tmp_path / "cap") for c in read_capture(tmp_path / "cap"))
    assert (first.seqlens, second.seqlens) == ((5, 3), (3, 5))


def test_te_calls_are_named_by_their_module_in_the_model_on_every_step_and_outside_it(te_stand_in, tmp_path):
    """After the first call the module path is read from the model's names without walking the stack: it must
    be the same as the walk gives, step after step, and a module outside the model is still named."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = TEStandIn(2, qkv_format="bshd")

        def forward(self, x):
            return self.attention(x, x, x).view_as(x)

    class Stray(torch.nn.Module):  # a module of no model: named by the stack, from itself
        def __init__(self):
            super().__init__()
            self.inner = TEStandIn(2, qkv_format="bshd")

        def forward(self, x):
            return self.inner(x, x, x)

    model = torch.nn.Sequential(Layer(), Layer(), Layer())
    stray, x = Stray(), torch.randn(1, 4, 2, 8)
    with attn_doctor.capture(tmp_path / "cap"):
        for _ in range(2):
            model(x)
        stray(x)
    calls = read_capture(tmp_path / "cap")
    assert [(c.meta["step"], c.meta["module"], c.meta["layer"]) for c in calls] == [
        (step, f"{layer}.attention", layer) for step in (0, 1) for layer in range(3)] + [(1, "inner", 3)]
