"""Comparing two captures layer by layer (issue 17, third part): TP=1 against TP=2 (gloo, torchrun) of the same
model and seed is the same within rounding; a faulty attention call on one rank is named with its layer and
rank; the thresholds come from the float64 replay of each run's own calls."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import attn_doctor
from attn_doctor.tracing.compare import FACTOR, compare_captures
from attn_doctor.tracing.store import read_capture
from tests.models import tiny_gpt

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "models" / "tiny_gpt.py"
TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")

pytestmark = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun not installed")


@pytest.fixture(scope="module")
def captures(tmp_path_factory, cli_runner) -> dict[str, Path]:
    from attn_doctor.cli import cli

    root = tmp_path_factory.mktemp("captures")
    with attn_doctor.capture(root / "tp1", values=True):
        tiny_gpt.train(steps=2, layers=3)
    for name, extra in (("tp2", []), ("tp2-faulty", ["--faulty-rank", "1"])):
        result = cli_runner.invoke(cli, ["capture", "--out", str(root / name), "--values", "--", TORCHRUN,
                                         "--nproc-per-node", "2", str(MODEL), "--tp", "2", "--steps", "2",
                                         "--layers", "3", *extra], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    return {name: root / name for name in ("tp1", "tp2", "tp2-faulty")}


@pytest.mark.torchrun
@pytest.mark.slow
def test_tp1_and_tp2_of_the_same_model_are_the_same_within_rounding(run_cli, captures, tmp_path):
    result = run_cli(["compare", captures["tp1"], captures["tp2"], "--json", tmp_path / "c.json"])
    assert result.exit_code == 0, result.output
    assert "same within rounding" in result.output
    found = json.loads((tmp_path / "c.json").read_text())
    assert len(found["layers"]) == 6 and all(len(layer["tensors"]) == 4 for layer in found["layers"])
    for layer in found["layers"]:
        for t in layer["tensors"]:  # the runs differ (TP splits the matmuls), but every part is rounding
            assert t["far"] is None and t["e_a"] < 1e-5 and t["e_b"] < 1e-5
            assert t["d"] <= 1.01 * (t["e_in"] + t["e_a"] + t["e_b"])  # the decomposition bounds the difference


@pytest.mark.slow
@pytest.mark.torchrun
def test_a_faulty_call_on_one_rank_is_named_with_its_layer_and_rank(run_cli, captures):
    result = run_cli(["compare", captures["tp1"], captures["tp2-faulty"]])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "differs from layer 1 (step 0) on: flash_attn.flash_attn_func" in text
    assert "is the one far from float64" in text and text.endswith("on rank 1")


@pytest.mark.slow
@pytest.mark.torchrun
def test_the_faulty_run_is_named_whichever_side_it_is_on(captures):
    forward = compare_captures(captures["tp2-faulty"], captures["tp1"])
    layer, measured = forward.first_fault()
    assert (layer.layer, measured.faulty_run) == (1, 0)
    assert measured.e[0] > FACTOR * max(measured.e[1], measured.floor)
    assert compare_captures(captures["tp2"], captures["tp1"]).same


@pytest.mark.slow
@pytest.mark.torchrun
def test_captures_without_common_values_are_bad_input(run_cli, captures, tmp_path):
    with attn_doctor.capture(tmp_path / "meta-only"):  # the same model and data: nothing differs upstream
        tiny_gpt.train(steps=1, layers=3)
    result = run_cli(["compare", captures["tp1"], tmp_path / "meta-only"])
    assert result.exit_code == 2 and "--values" in result.stderr


def test_a_shard_of_a_one_process_tp_simulation_is_named_by_its_tp_rank(tmp_path, monkeypatch):
    import torch
    import torch.nn.functional as F

    from attn_doctor.tracing import record

    monkeypatch.setattr(record, "_parallel", {})  # describe_parallel's state, restored after the test
    q, k, v = (torch.randn(1, 4, 16, 8) for _ in range(3))

    class Layer(torch.nn.Module):  # both TP shards in this process, as te_model.py's simulation runs them
        def __init__(self, faulty: bool):
            super().__init__()
            self.faulty = faulty

        def forward(self, q, k, v):
            for tp_rank in (0, 1):
                attn_doctor.describe_parallel(tp=2, tp_rank=tp_rank)
                shard = [t[:, 2 * tp_rank:2 * tp_rank + 2].clone().requires_grad_() for t in (q, k, v)]
                attend = tiny_gpt.faulty_attention if self.faulty and tp_rank == 1 else F.scaled_dot_product_attention
                attend(*shard).sum().backward()

    class Model(torch.nn.Module):
        def __init__(self, faulty: bool):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(faulty)])

        def forward(self, q, k, v):
            self.layers[0](q, k, v)

    for name, faulty in (("a", False), ("b", True)):
        with attn_doctor.capture(tmp_path / name, values=True):
            Model(faulty)(q, k, v)
    answer = compare_captures(tmp_path / "a", tmp_path / "b").answer()
    assert answer.startswith("differs from layer 0") and answer.endswith("on rank 0 (tp_rank 1)"), answer


def _capture_whole_and_over_two_cp_ranks(root: Path, layer: type[torch.nn.Module]) -> tuple[Path, Path]:
    """A model of one `layer(cp)` (which runs both simulated CP ranks' calls itself when cp is 2) captured with
    values at cp 1 into root/whole and at cp 2 into root/cp."""
    class Model(torch.nn.Module):
        def __init__(self, cp: int):
            super().__init__()
            self.layers = torch.nn.ModuleList([layer(cp)])

        def forward(self):
            self.layers[0]()

    for name, cp in (("whole", 1), ("cp", 2)):
        with attn_doctor.capture(root / name, values=True):
            Model(cp)()
    return root / "whole", root / "cp"


def _cp_captures(root: Path, faulty_cp_rank: int | None, monkeypatch) -> tuple[Path, Path]:
    """One causal attention run whole, and split over two simulated CP ranks the load-balanced way (rank r holds
    sequence chunks r and 3 - r, with the keys all-gathered and its rows of the causal mask)."""
    import torch
    import torch.nn.functional as F

    from attn_doctor.tracing import record

    monkeypatch.setattr(record, "_parallel", {})
    generator = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 2, 16, 8, generator=generator) for _ in range(4))
    causal = torch.ones(16, 16, dtype=torch.bool).tril()
    plain, faulty = F.scaled_dot_product_attention, {"on": False}

    def kernel(*args, **kwargs):  # a kernel that is wrong on one rank's calls
        out = plain(*args, **kwargs)
        return out * 1.01 if faulty["on"] else out

    monkeypatch.setattr(F, "scaled_dot_product_attention", kernel)

    class Layer(torch.nn.Module):
        def __init__(self, cp: int):
            super().__init__()
            self.cp = cp

        def forward(self):
            if self.cp == 1:
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(dout)
                return
            for cp_rank in range(2):
                attn_doctor.describe_parallel(cp=2, cp_rank=cp_rank)
                first, second = 4 * cp_rank, 12 - 4 * cp_rank  # chunks r and 3 - r of four
                rows = torch.cat([torch.arange(first, first + 4), torch.arange(second, second + 4)])
                leaves = [q[:, :, rows].clone().requires_grad_(), *(t.clone().requires_grad_() for t in (k, v))]
                faulty["on"] = cp_rank == faulty_cp_rank
                F.scaled_dot_product_attention(*leaves, attn_mask=causal[rows][None, None]).backward(dout[:, :, rows])
                faulty["on"] = False

    return _capture_whole_and_over_two_cp_ranks(root, Layer)


def test_cp_chunks_are_put_back_in_sequence_order_and_match_the_whole_run(tmp_path, monkeypatch):
    whole, cp = _cp_captures(tmp_path, None, monkeypatch)
    comparison = compare_captures(whole, cp)
    assert comparison.same, comparison.answer()
    (layer,) = comparison.layers
    assert [m.tensor for m in layer.measured] == ["out", "dq", "dk", "dv"]
    assert all(m.d < 1e-5 and m.e_in < 1e-12 for m in layer.measured)  # the same inputs: nothing to explain


def test_a_faulty_cp_rank_is_named(tmp_path, monkeypatch):
    whole, cp = _cp_captures(tmp_path, 1, monkeypatch)
    answer = compare_captures(whole, cp).answer()
    assert answer.startswith("differs from layer 0 (step 0) on: torch.sdpa, out"), answer
    assert answer.endswith("on rank 0 (cp_rank 1)"), answer


def test_runs_whose_inputs_differ_from_the_start_are_not_called_the_same(tmp_path, monkeypatch):
    whole, cp = _cp_captures(tmp_path, None, monkeypatch)
    monkeypatch.setattr("attn_doctor.tracing.compare._load_balanced",
                        lambda parts, dim: torch.cat(parts, dim=dim))  # chunks out of order
    comparison = compare_captures(whole, cp)
    assert not comparison.same and comparison.first_fault() is None
    assert comparison.answer().startswith("no attention call is at fault, but the runs' inputs differ")


def test_a_call_whose_output_holds_nan_is_the_one_far_from_float64(tmp_path, monkeypatch):
    import torch.nn.functional as F

    plain, broken = F.scaled_dot_product_attention, {"on": False}

    def kernel(*args, **kwargs):  # NaN in one output row: a kernel that reads uninitialised memory
        out = plain(*args, **kwargs)
        return out.index_fill(2, torch.tensor([3]), float("nan")) if broken["on"] else out

    monkeypatch.setattr(F, "scaled_dot_product_attention", kernel)
    q, k, v = (torch.randn(1, 2, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))

    for name, on in (("a", False), ("b", True)):
        broken["on"] = on
        with attn_doctor.capture(tmp_path / name, values=True):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            F.scaled_dot_product_attention(*leaves, is_causal=True).nan_to_num().sum().backward()
    comparison = compare_captures(tmp_path / "a", tmp_path / "b")
    layer, measured = comparison.first_fault()
    assert measured.tensor == "out" and measured.faulty_run == 1, comparison.answer()
    assert comparison.answer().endswith("on rank 0")


class _PackedAttention(torch.nn.Module):
    """TE's DotProductAttention as a capture sees it, for packed (thd) sequences: each sequence of its slot
    attended causally with SDPA, slot padding left as garbage; `scale` lets one run be wrong."""

    def __init__(self, heads: int, scale: float | None = None):
        super().__init__()
        self.num_attention_heads, self.num_gqa_groups, self.qkv_format = heads, heads, "thd"
        self.attn_mask_type, self.window_size, self.attention_dropout = "padding_causal", None, 0.0
        self.softmax_type, self.attention_type, self.scale = "vanilla", "self", scale

    def forward(self, query_layer, key_layer, value_layer, cu_seqlens_q=None, cu_seqlens_kv=None,
                cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None):
        return _attend_packed(query_layer, key_layer, value_layer, cu_seqlens_q, cu_seqlens_q_padded, self.scale)


def _attend_packed(query_layer, key_layer, value_layer, cu_seqlens, cu_seqlens_padded, scale=None):
    """Each sequence of its slot attended causally with SDPA, slot padding left as garbage; heads flattened."""
    pieces = []
    for b in range(len(cu_seqlens) - 1):
        start, length = int(cu_seqlens_padded[b]), int(cu_seqlens[b + 1] - cu_seqlens[b])
        slot = int(cu_seqlens_padded[b + 1]) - start
        q, k, v = (t[start:start + length].transpose(0, 1) for t in (query_layer, key_layer, value_layer))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        pieces += [out.transpose(0, 1), 7.0 + query_layer[start + length:start + slot]]  # garbage in padding
    return torch.cat(pieces).reshape(query_layer.shape[0], -1)


def test_packed_thd_calls_are_compared_token_for_token_and_a_wrong_run_is_named(tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = _PackedAttention
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    generator = torch.Generator().manual_seed(5)
    buffer = torch.randn(24, 3, 2, 8, generator=generator)
    offsets, slots = torch.tensor([0, 5, 14], dtype=torch.int32), torch.tensor([0, 8, 24], dtype=torch.int32)

    class Model(torch.nn.Module):
        def __init__(self, scale: float | None):
            super().__init__()
            self.layers = torch.nn.ModuleList([_PackedAttention(2, scale)])

        def forward(self):
            packed = buffer.clone().requires_grad_()
            out = self.layers[0](packed[:, 0], packed[:, 1], packed[:, 2], cu_seqlens_q=offsets,
                                 cu_seqlens_kv=offsets, cu_seqlens_q_padded=slots, cu_seqlens_kv_padded=slots,
                                 max_seqlen_q=16, max_seqlen_kv=16)
            out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(6)))

    for name, scale in (("a", None), ("b", None), ("wrong", 0.6)):
        with attn_doctor.capture(tmp_path / name, values=True):
            Model(scale)()
    comparison = compare_captures(tmp_path / "a", tmp_path / "b")
    assert comparison.answer().startswith("same within rounding"), comparison.answer()
    errors = [e for layer in comparison.layers for m in layer.measured for e in m.e]
    assert len(errors) == 8 and max(errors) < 1e-5  # fp32 rounding: the garbage in slot padding is not compared
    differs = compare_captures(tmp_path / "a", tmp_path / "wrong").answer()
    assert differs.startswith("differs from layer 0") and "is the one far from float64" in differs, differs
    assert compare_captures(tmp_path / "a", tmp_path / "wrong").labels[1] in differs.split(" is the one")[0]


def _te_cp_share(cu_seqlens_padded: torch.Tensor, cp: int, cp_rank: int) -> torch.Tensor:
    """The packed tokens TE gives CP rank `cp_rank`, in its order, as tex.thd_get_partitioned_indices computes
    them (TransformerEngine transformer_engine/common/fused_attn/context_parallel.cu:82-90): local token i of a
    sequence whose local slot is L (its padded length / cp) is token i + rank * L/2 of that sequence when i < L/2,
    else i + (2cp - 2 - rank) * L/2."""
    local = (cu_seqlens_padded // cp).tolist()
    indices = []
    for b in range(len(local) - 1):
        slot = local[b + 1] - local[b]
        for i in range(slot):
            offset = cp_rank if i < slot // 2 else 2 * (cp - 1) - cp_rank
            indices.append(i + local[b] * cp + slot // 2 * offset)
    return torch.tensor(indices)


class _PackedCPAttention(_PackedAttention):
    """TE's DotProductAttention under context parallelism, one CP rank's call as a capture sees it: the rank's
    share of the packed tokens (`_te_cp_share`) with the whole batch's cu_seqlens, padded cu_seqlens and
    max_seqlen (what TE's CP test hands every rank). It computes the rank's rows of the whole attention over
    every rank's keys and values (`ring`: what TE's p2p exchange brings), so the backward gives each rank's
    keys the gradient of every rank's queries, as TE's does. `faulty_rank`'s output is 1% off."""

    def __init__(self, heads: int, cp: int, faulty_rank: int | None = None):
        super().__init__(heads)
        self.cp, self.faulty_rank, self.cp_rank = cp, faulty_rank, 0
        self.ring: list[tuple[torch.Tensor, torch.Tensor]] = []  # every rank's (k, v), set before the calls

    def forward(self, query_layer, key_layer, value_layer, cu_seqlens_q=None, cu_seqlens_kv=None,
                cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, max_seqlen_q=None, max_seqlen_kv=None):
        shares = [_te_cp_share(cu_seqlens_q_padded, self.cp, rank) for rank in range(self.cp)]
        tokens = int(cu_seqlens_q_padded[-1])

        def whole(parts):
            return sum(torch.zeros(tokens, *part.shape[1:]).index_copy(0, share, part)
                       for share, part in zip(shares, parts))

        q = whole([query_layer if rank == self.cp_rank else torch.zeros_like(query_layer) for rank in range(self.cp)])
        k, v = whole([k for k, _ in self.ring]), whole([v for _, v in self.ring])
        out = _attend_packed(q, k, v, cu_seqlens_q, cu_seqlens_q_padded)[shares[self.cp_rank]]
        return out * 1.01 if self.cp_rank == self.faulty_rank else out


def _thd_cp_captures(root: Path, faulty_cp_rank: int | None, monkeypatch) -> tuple[Path, Path]:
    """One packed causal attention (sequences of lengths 5, 11, 2 in slots of 8, 12, 8: padding between them)
    run whole, and over two simulated CP ranks the way TE splits it (each rank's call its share of the tokens,
    the whole batch's cu_seqlens, one backward through both)."""
    import types

    from attn_doctor.tracing import record

    monkeypatch.setattr(record, "_parallel", {})
    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = _PackedCPAttention
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    generator = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(28, 2, 8, generator=generator) for _ in range(4))
    dout = dout.reshape(28, 16)
    offsets = torch.tensor([0, 5, 16, 18], dtype=torch.int32)
    slots = torch.tensor([0, 8, 20, 28], dtype=torch.int32)

    class Layer(torch.nn.Module):
        def __init__(self, cp: int):
            super().__init__()
            self.cp = cp
            self.attention = _PackedCPAttention(2, cp, faulty_cp_rank)

        def forward(self):
            shares = [_te_cp_share(slots, self.cp, rank) for rank in range(self.cp)]
            leaves = [[t[share].clone().requires_grad_() for t in (q, k, v)] for share in shares]
            self.attention.ring = [(k_, v_) for _, k_, v_ in leaves]
            outs = []
            for cp_rank, (q_, k_, v_) in enumerate(leaves):
                if self.cp > 1:
                    attn_doctor.describe_parallel(cp=self.cp, cp_rank=cp_rank)
                self.attention.cp_rank = cp_rank
                outs.append(self.attention(q_, k_, v_, cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                                           cu_seqlens_q_padded=slots, cu_seqlens_kv_padded=slots,
                                           max_seqlen_q=12, max_seqlen_kv=12))
            torch.autograd.backward(outs, [dout[share] for share in shares])

    return _capture_whole_and_over_two_cp_ranks(root, Layer)


def test_cp_token_places_are_te_s_split_of_every_padded_sequence():
    from attn_doctor.tracing.compare import _cp_token_places

    for cp in (2, 4):
        slots = torch.tensor([0, 8, 16, 40], dtype=torch.int32)
        for cp_rank in range(cp):
            assert torch.equal(_cp_token_places((8, 8, 24), cp, cp_rank), _te_cp_share(slots, cp, cp_rank))
    with pytest.raises(ValueError, match=r"divide by 2 x CP size \(4\)"):
        _cp_token_places((8, 6), 2, 0)


def test_packed_cp_shares_are_put_back_per_sequence_and_match_the_whole_run(tmp_path, monkeypatch):
    whole, cp = _thd_cp_captures(tmp_path, None, monkeypatch)
    calls = read_capture(cp)
    assert [c.meta["tensors"]["q"]["shape"] for c in calls] == [[14, 2, 8]] * 2  # each rank: half the tokens
    comparison = compare_captures(whole, cp)
    assert comparison.answer().startswith("same within rounding"), comparison.answer()
    (layer,) = comparison.layers
    assert [m.tensor for m in layer.measured] == ["out", "dq", "dk", "dv"]
    for m in layer.measured:  # the same inputs, the same tokens: nothing to explain, fp32 rounding apart
        assert m.d < 1e-5 and m.e_in < 1e-12 and max(m.e) < 1e-5, (m.tensor, m.d, m.e_in, m.e)
        assert [rank for rank, _ in m.shard_e[1]] == ["0 (cp_rank 0)", "0 (cp_rank 1)"]


def test_a_faulty_packed_cp_rank_is_named_with_its_layer(tmp_path, monkeypatch):
    whole, cp = _thd_cp_captures(tmp_path, 1, monkeypatch)
    comparison = compare_captures(whole, cp)
    answer = comparison.answer()
    assert answer.startswith("differs from layer 0 (step 0) on: te.DotProductAttention, out"), answer
    assert answer.endswith("on rank 0 (cp_rank 1)"), answer
    layer, out = comparison.first_fault()
    assert out.faulty_run == 1 and dict(out.shard_e[1])["0 (cp_rank 0)"] < 1e-5  # rank 0's tokens are right


class _PackedTE(torch.nn.Module):
    """TE >= 2.20's DotProductAttention as a capture sees it when MultiheadAttention calls it: q, k, v None and
    one packed [b, s, 3, h, d] qkv_layer; it computes causal attention on the views it selects."""

    def __init__(self, heads: int, faulty: bool = False):
        super().__init__()
        self.num_attention_heads, self.num_gqa_groups, self.faulty = heads, heads, faulty
        self.qkv_format, self.attn_mask_type, self.window_size = "bshd", "causal", None
        self.attention_dropout, self.softmax_type, self.attention_type = 0.0, "vanilla", "self"

    def forward(self, query_layer=None, key_layer=None, value_layer=None, qkv_layer=None, qkv_interleave_dim=-3):
        q, k, v = (qkv_layer.select(qkv_interleave_dim, i).transpose(1, 2) for i in range(3))  # bhsd
        attend = tiny_gpt.faulty_attention if self.faulty else torch.nn.functional.scaled_dot_product_attention
        out = attend(q, k, v, is_causal=True).transpose(1, 2)
        return out.reshape(*out.shape[:2], -1)


def test_te_packed_qkv_layer_calls_of_tp1_and_tp2_compare_head_by_head(tmp_path, monkeypatch):
    """The dQ, dK, dV of TE's packed calls come from the packed argument's gradient (`record._save_values`):
    TP=2's head shards put back together are TP=1's within rounding, and a faulty shard is named."""
    import types

    from attn_doctor.tracing import record

    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = _PackedTE
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    monkeypatch.setattr(record, "_parallel", {})  # describe_parallel's state, restored after the test
    heads, packed = 4, torch.randn(1, 16, 3, 4, 8, generator=torch.Generator().manual_seed(0))

    class Layer(torch.nn.Module):  # every TP shard in this process, as te_model.py's simulation runs them
        def __init__(self, tp: int, faulty_rank: int | None):
            super().__init__()
            self.tp = tp
            self.attention = torch.nn.ModuleList(_PackedTE(heads // tp, r == faulty_rank) for r in range(tp))

        def forward(self):
            width = heads // self.tp
            for tp_rank, attention in enumerate(self.attention):
                attn_doctor.describe_parallel(tp=self.tp, tp_rank=tp_rank)
                shard = packed[:, :, :, tp_rank * width:(tp_rank + 1) * width].clone().requires_grad_()
                attention(qkv_layer=shard).sum().backward()

    class Model(torch.nn.Module):
        def __init__(self, tp: int, faulty_rank: int | None = None):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(tp, faulty_rank)])

        def forward(self):
            self.layers[0]()

    for name, tp, faulty_rank in (("tp1", 1, None), ("tp2", 2, None), ("tp2-faulty", 2, 1)):
        with attn_doctor.capture(tmp_path / name, values=True):
            Model(tp, faulty_rank)()
    for call in read_capture(tmp_path / "tp2"):  # each shard's dQ, dK, dV: its packed gradient's slices
        assert all(call.gradient(name) is not None for name in ("dq", "dk", "dv"))
    same = compare_captures(tmp_path / "tp1", tmp_path / "tp2").answer()
    assert same.startswith("same within rounding"), same
    differs = compare_captures(tmp_path / "tp1", tmp_path / "tp2-faulty").answer()
    assert differs.startswith("differs from layer 0") and differs.endswith("on rank 0 (tp_rank 1)"), differs


def _hand_written(root: Path, kind: str) -> Path:
    """A capture (in-process, `modules=`) of the hand-written model with `kind` attention in bf16, its keys
    sharing a large direction (`tests/models/hand_attention.py`)."""
    from tests.models import hand_attention

    spec = "tests.models.hand_attention.CoreAttention:q=query,k=key,v=value,layout=bshd,causal=true"
    with attn_doctor.capture(root / kind, values=True, modules=[spec]):
        hand_attention.train(kind=kind, dtype="bf16", key_shift=5.0)
    return root / kind


@pytest.mark.slow
def test_a_flash_style_backward_is_not_called_a_fault_for_its_own_rounding_and_a_wrong_one_still_is(tmp_path):
    """Keys with a large common direction: a correct flash-style dQ is several times an unfused one's error
    (D from the rounded output), which a ratio to the other run alone calls a fault; a dQ 5% off still is one."""
    unfused, flash, wrong = (_hand_written(tmp_path, kind) for kind in ("unfused", "flash", "flash-wrong"))
    comparison = compare_captures(unfused, flash)
    dq = [m for layer in comparison.layers for m in layer.measured if m.tensor == "dq"]
    assert any(m.e[1] > FACTOR * max(m.e[0], m.floor) for m in dq)  # what the other run's error alone calls far
    assert comparison.same, comparison.answer()
    assert 1 in [m.flash_run for m in dq] and 0 not in [m.flash_run for m in dq]
    assert "which a flash-style backward makes on these inputs" in comparison.account()[1]
    faulty = compare_captures(unfused, wrong)
    assert not faulty.same
    layer, measured = faulty.first_fault()
    assert (layer.layer, measured.tensor, measured.faulty_run) == (1, "dq", 1)
