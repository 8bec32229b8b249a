"""A captured call's line, encoded once per signature (attn_doctor/tracing/describe.py): the cached text must be
what describing the call in full gives, for calls that differ in each fact a signature is made from, and calls
that repeat must be served from the cache."""

from __future__ import annotations

import json
import sys
import types

import torch

from attn_doctor.tracing.describe import CallDescriber, te_now
from attn_doctor.tracing.store import read_calls

TE_STATE = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
FP8 = "transformer_engine.pytorch.fp8"


class Recipe:
    """TE's FP8 recipes are mutable dataclasses: their fields can change in place."""

    def __init__(self, margin: int = 0):
        self.margin, self.fp8_dpa, self.fp8_format = margin, True, "Format.HYBRID"

    def __repr__(self) -> str:
        return f"Recipe(margin={self.margin}, fp8_dpa={self.fp8_dpa})"


class Module:
    """A TE DotProductAttention as the capture reads it: plain attributes."""

    def __init__(self) -> None:
        self.qkv_format, self.attn_mask_type, self.window_size = "bshd", "causal", (-1, 0)
        self.num_attention_heads, self.attention_dropout, self.softmax_scale = 2, 0.0, 0.125


def test_each_line_is_what_a_full_description_gives_and_repeats_come_from_the_cache(monkeypatch, tmp_path):
    params = types.SimpleNamespace(qkv_layout="bshd_bshd_bshd", deterministic=False)
    state = {"attention_params": params, "use_fused_attention": True, "fused_attention_backend": 1}
    monkeypatch.setitem(sys.modules, TE_STATE, types.SimpleNamespace(_attention_backends=state))
    manager = types.SimpleNamespace(recipe=None)
    manager.is_fp8_enabled = lambda: manager.recipe is not None
    manager.get_fp8_recipe = lambda: manager.recipe
    monkeypatch.setitem(sys.modules, FP8, types.SimpleNamespace(FP8GlobalStateManager=manager))

    packed = torch.randn(2, 6, 3, 2, 4, requires_grad=True)
    lengths = torch.tensor([0, 4, 6], dtype=torch.int32)
    module = Module()
    base = {"q": packed[:, :, 0], "k": packed[:, :, 1], "v": packed[:, :, 2], "out": torch.randn(2, 6, 8)}

    def call(tensors=None, **arguments):
        tensors = tensors or base
        return {"bound": {"query": tensors["q"], "key": tensors["k"], "value": tensors["v"], "cu_seqlens_q": lengths,
                          "max_seqlen_q": 6, "dropout_p": 0.0} | arguments, "output": tensors["out"]}

    def fused_to_flash():
        state.update(use_fused_attention=False, use_flash_attention=True, flash_attention_backend="2.7")

    def new_parameters():
        state["attention_params"] = types.SimpleNamespace(qkv_layout="bshd_bs2hd", deterministic=True)

    other_buffer = torch.randn_like(packed).requires_grad_()
    variants = [  # (what changes before the call, the call): each differs from the one before in one fact
        (None, call()),
        (None, call()),  # a repeat
        (None, call({**base, "q": packed[:, :, 0].transpose(1, 2)})),  # strides
        (None, call({**base, "q": packed[:, 1:, 0]})),  # storage offset and shape
        (None, call({**base, "k": other_buffer[:, :, 1]})),  # which tensors share a storage (same geometry)
        (None, call({**base, "q": base["q"].detach()})),  # requires_grad
        (None, call({**base, "out": base["out"].double()})),  # dtype
        (lambda: lengths.copy_(torch.tensor([0, 3, 6])), call()),  # cu_seqlens changed in place
        (None, call(max_seqlen_q=True)), (None, call(max_seqlen_q=1)), (None, call(max_seqlen_q=1.0)),
        (None, call(dropout_p=-0.0)), (None, call(dropout_p=0.0)),
        (None, call(window=(4, 0))), (None, call(window=[4, 0])),
        (None, call(other=object())), (None, call(other=object())),  # no key: described in full each time
        (lambda: setattr(module, "attn_mask_type", "padding_causal"), call()),
        (lambda: delattr(module, "window_size"), call()),
        (lambda: setattr(module, "window_size", None), call()),
        (fused_to_flash, call()),
        (new_parameters, call()),
        (lambda: setattr(manager, "recipe", Recipe()), call()),
        (lambda: setattr(manager.recipe, "margin", 2), call()),
        (None, call()),  # a repeat
        (None, call({"q": None, "k": None, "v": None, "out": base["out"]}, qkv_layer=packed)),  # TE's packed q, k, v
    ]
    # 26 calls: 2 without a key (whole lines); 3 served from the cache (the two repeats, and dropout 0.0 after
    # -0.0: call 7's signature); each of the other 21 has its own signature. A list after a tuple is one too: a
    # key may tell apart calls whose descriptions are equal, never the other way round.
    NEW_SIGNATURES = set(range(26)) - {1, 12, 15, 16, 24}
    memo = CallDescriber({"pid": 1})
    memo_file, full_file = tmp_path / "memo.jsonl", tmp_path / "full.jsonl"
    for index, (change, arguments) in enumerate(variants):
        if change is not None:
            change()
        common = dict(api="te.DotProductAttention", rank=0, world_size=1, parallel={}, qkv=("query", "key", "value"),
                      te_module=module, te_state=te_now(), index=index, module_path="layers.0.attention", layer=0,
                      step=0, values=None, **arguments)
        if index == 0:
            at_first_call = common
        lines = memo.lines(**common)
        assert len(lines) == (2 if index in NEW_SIGNATURES else 1), variants[index]
        with open(memo_file, "a") as memo_log, open(full_file, "a") as full_log:
            memo_log.writelines(lines)
            full_log.writelines(CallDescriber({"pid": 1}).lines(**common, memo=False))
        assert read_calls(memo_file)[-1] == read_calls(full_file)[-1], variants[index]
        assert read_calls(memo_file)[-1]["index"] == index
    assert memo.signatures == len(NEW_SIGNATURES)
    described = read_calls(memo_file)[-1]
    assert described["arguments"]["module"]["fp8_recipe"]["margin"] == 2
    assert described["te"]["backend"].startswith("FlashAttention") and described["te"]["qkv_layout"] == "bshd_bs2hd"
    assert described["arguments"]["cu_seqlens_q"]["values"] == [0, 3, 6]
    assert [described["tensors"][name]["storage_offset"] for name in "qkv"] == [0, 8, 16]  # packed's selected views
    # a call described after TE's state changed (a deferred call) is described as TE's state was at the call
    late = CallDescriber({"pid": 1}).lines(**at_first_call, memo=False)[0]
    assert json.loads(late)["te"]["backend"].startswith("FusedAttention") and "fp8_recipe" not in late
    assert all(len(line) < 120 for line in memo_file.read_text().splitlines() if '"index"' in line
               and '"api"' not in line), "a call naming its signature is a short line"


def test_an_output_gradients_geometry_is_written_once_and_again_after_forget():
    describer = CallDescriber({"pid": 1, "started": "then"})
    first = describer.gradient_lines(0, torch.randn(2, 4, 3).transpose(0, 1))
    again = describer.gradient_lines(1, torch.randn(2, 4, 3).transpose(0, 1))  # same geometry, new tensor
    other = describer.gradient_lines(2, torch.randn(4, 2, 3))
    assert [json.loads(line) for line in first] == [
        {"gradient_geometry": 0, "tensor": {"shape": [4, 2, 3], "stride": [3, 12, 1], "storage_offset": 0,
                                            "dtype": "float32", "device": "cpu",
                                            "storage": {"id": 0, "nbytes": 96}, "requires_grad": False}},
        {"gradient_of": 0, "geometry": 0}]
    assert again == ['{"gradient_of":1,"geometry":0}\n'] and len(other) == 2
    describer.forget()  # its lines may not be in the file: described again, under a new number
    assert json.loads(describer.gradient_lines(3, torch.randn(2, 4, 3).transpose(0, 1))[0])["gradient_geometry"] == 2
