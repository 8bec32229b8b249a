"""Megatron-Core as a first-class client (issue 32), with a real megatron-core GPT on the CPU
(`tests/models/megatron_gpt.py`, Megatron's own local attention: TE needs a GPU): every layer's core attention
call is captured and the run stays bitwise the same; the calls replay on every path; TP=1 against TP=2 (torchrun,
gloo) is the same computation, and a faulty attention on one rank is named by layer and rank. And a module a user
names (`--module`): its hand-written attention is captured, replayed and compared; a named module that is never
called, or whose arguments the mapping does not find, is bad input. And (issue 42) runs that are not the same
model: TP=2 drawn per rank as Megatron's GPU initialisation draws it, attention dropout, other data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attn_doctor
from attn_doctor.tracing.clients import ModuleSpec, parse_module_spec
from attn_doctor.tracing.compare import compare_captures
from attn_doctor.tracing.replay_case import case_of
from attn_doctor.tracing.store import read_capture, read_model_facts
from attn_doctor.tracing.weights import SAME, joined

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "models" / "megatron_gpt.py"
TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
GPT = ["--impl", "local", "--layers", "3", "--steps", "2"]
HAND = "tests.models.hand_attention.CoreAttention:q=query,k=key,v=value,layout=bshd,causal=true"


def _capture(run_cli, out: Path, *command: str):
    return run_cli(["capture", "--out", out, "--values", "--", *command])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cli_runner) -> dict[str, Path]:
    """TP=1, TP=2 and TP=2 with rank 1's layer 2 attention wrong, each a capture of two training steps; and runs
    that are not the same model as TP=1: TP=2 initialised as on a GPU, attention dropout 0.1, other data."""
    from attn_doctor.cli import cli

    root = tmp_path_factory.mktemp("megatron")
    commands = {"tp1": [sys.executable, str(MODEL), *GPT, "--losses", str(root / "tp1.losses")],
                "tp2": [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(MODEL), *GPT, "--tp", "2"],
                "tp2-faulty": [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(MODEL), *GPT, "--tp", "2",
                               "--faulty-rank", "1", "--faulty-layer", "2"],
                # Megatron's GPU initialisation: each TP rank draws its own shards (seed + 2718 + rank)
                "tp2-gpu-init": [TORCHRUN, "--standalone", "--nproc-per-node", "2", str(MODEL), *GPT, "--tp", "2",
                                 "--init", "gpu"],
                "dropout": [sys.executable, str(MODEL), *GPT, "--attention-dropout", "0.1"],
                "other-data": [sys.executable, str(MODEL), *GPT, "--data-seed", "2"]}
    for name, command in commands.items():
        result = cli_runner.invoke(cli, ["capture", "--out", str(root / name), "--values", "--", *command],
                                   catch_exceptions=False)
        assert result.exit_code == 0, result.output
    return {**{name: root / name for name in commands}, "root": root}


@pytest.mark.slow
def test_every_layers_local_attention_is_captured_and_the_run_is_bitwise_unchanged(runs, tmp_path):
    plain = tmp_path / "plain.losses"
    subprocess.run([sys.executable, str(MODEL), *GPT, "--losses", str(plain)], check=True, capture_output=True)
    assert (runs["root"] / "tp1.losses").read_text() == plain.read_text()  # both steps' losses, to the bit
    calls = read_capture(runs["tp1"])
    assert {c.meta["api"] for c in calls} == {"megatron.DotProductAttention"}
    first_step = sorted((c for c in calls if c.meta["step"] == calls[0].meta["step"]), key=lambda c: c.meta["layer"])
    assert [c.meta["layer"] for c in first_step] == [0, 1, 2]
    assert [c.meta["module"] for c in first_step] == [f"decoder.layers.{i}.self_attention.core_attention"
                                                      for i in range(3)]
    module = first_step[0].meta["arguments"]["module"]
    assert [c.meta["arguments"]["module"]["layer_number"] for c in first_step] == [1, 2, 3]
    assert module["softmax_in_fp32"] is True and module["attn_mask_type"] == "causal"
    assert module["softmax_scale"] == pytest.approx(16 ** -0.5) and module["fused_softmax"] is False
    assert module["config"]["tensor_model_parallel_size"] == 1
    assert all(c.values_path is not None and c.dout_path is not None for c in calls)
    case = case_of(first_step[0], runs["tp1"])
    assert (case.qkv_format, case.mask, case.heads, case.head_dim, case.seq) == ("sbhd", "causal", 4, 16, 16)


def _kernel_errors(capture: Path) -> list[float]:
    """Each recorded out, dQ, dK, dV against float64 attention on the call's own inputs, with the semantics the
    capture recorded: a correct kernel in fp32 is at 1e-6, a wrong scale or mask at 1e-1."""
    return [e for layer in compare_captures(capture, capture).layers for m in layer.measured for e in m.e]


@pytest.mark.slow
def test_what_megatron_computed_is_what_the_recorded_settings_say(runs, tmp_path):
    assert max(_kernel_errors(runs["tp1"])) < 1e-5
    scaled = tmp_path / "scaled"  # apply_query_key_layer_scaling: the scale divided by the layer number, the
    subprocess.run([sys.executable, "-m", "attn_doctor", "capture", "--out", str(scaled), "--values", "--",  # softmax
                    sys.executable, str(MODEL), "--impl", "local", "--layers", "3", "--qk-layer-scaling"],  # times it
                   check=True, capture_output=True, cwd=ROOT)
    calls = sorted(read_capture(scaled), key=lambda c: c.meta["layer"])
    modules = [c.meta["arguments"]["module"] for c in calls]
    assert [(m["layer_number"], m["softmax_coeff"]) for m in modules] == [(1, 1), (2, 2), (3, 3)]
    assert modules[2]["softmax_scale"] == pytest.approx(16 ** -0.5 / 3)
    assert case_of(calls[2], scaled).softmax_scale == pytest.approx(16 ** -0.5)
    assert max(_kernel_errors(scaled)) < 1e-5


@pytest.mark.slow
def test_the_captured_calls_replay_and_pass_on_every_path(run_cli, runs, tmp_path):
    result = run_cli(["replay", runs["tp1"], "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 0, result.output
    rows = json.loads((tmp_path / "r" / "results.json").read_text())["results"]
    tested = {(row["backend"], row["layout"]) for row in rows if row["verdict"] == "PASS"}
    assert {("local", "captured"), ("local", "contiguous"), ("sdpa.math", "contiguous")} <= tested
    assert all(row["verdict"] in ("PASS", "SKIP") for row in rows)


@pytest.mark.slow
@pytest.mark.torchrun
def test_tp1_and_tp2_are_the_same_computation(run_cli, runs):
    result = run_cli(["compare", runs["tp1"], runs["tp2"]])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert text.startswith("- same weights (41 tensors) - same data (the token ids of the first forward pass, "
                           "[2, 16]) - no dropout in either run")  # the model's facts first, before the table
    assert "same within rounding" in text
    assert "attention on its own inputs: right in both runs" in text
    assert "the runs' difference: what their inputs' difference and each kernel's rounding explain" in text
    comparison = compare_captures(runs["tp1"], runs["tp2"])
    assert [layer.layer_numbers for layer in comparison.layers if layer.step == 1] == [(1, 1), (2, 2), (3, 3)]


@pytest.mark.slow
@pytest.mark.torchrun
def test_a_faulty_attention_on_one_tp_rank_is_named_by_layer_and_rank(run_cli, runs):
    result = run_cli(["compare", runs["tp1"], runs["tp2-faulty"]])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "differs from layer 1 (layer_number 2) (step 0) on: megatron.DotProductAttention" in text
    assert text.endswith("on rank 1"), text
    assert "q, k, v: bitwise the same up to layer 0" in text  # the inputs agree: the fault is in attention


@pytest.mark.slow
@pytest.mark.torchrun
def test_tp2_drawn_per_rank_as_on_a_gpu_is_not_the_same_model_and_no_kernel_is_blamed(run_cli, runs, tmp_path):
    result = run_cli(["compare", runs["tp1"], runs["tp2-gpu-init"], "--json", tmp_path / "c.json"])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert text.startswith("- the runs' weights differ: 20 of 41 tensors, first embedding.word_embeddings.weight "
                           "(fingerprints "), text
    assert ("Megatron without --use-cpu-initialization draws each TP shard from its own seed (TP=1 and TP=2); rerun "
            "with --use-cpu-initialization, or load one checkpoint in both runs") in text
    assert text.endswith("not the same run: they differ upstream of attention (weights, said above), so no attention "
                         "kernel is judged; make them the same and compare again")
    assert " far " not in text and "differs from layer" not in text
    document = json.loads((tmp_path / "c.json").read_text())
    assert [f["topic"] for f in document["upstream"] if f["differs"]] == ["weights"]
    assert all(t["far"] is None for layer in document["layers"] for t in layer["tensors"])


@pytest.mark.slow
@pytest.mark.torchrun
def test_the_fingerprint_is_tp_invariant_on_megatrons_model_and_tells_two_draws_apart(runs):
    whole, split, drawn = (joined(read_model_facts(runs[name])).prints for name in ("tp1", "tp2", "tp2-gpu-init"))
    assert set(whole) == set(split) == set(drawn) and len(whole) == 41
    assert max(whole[name].distance(split[name]) for name in whole) <= SAME
    redrawn = [name for name in whole if whole[name].distance(drawn[name]) > 0.3]
    assert len(redrawn) == 20 and "decoder.layers.0.self_attention.linear_qkv.weight" in redrawn
    assert all(whole[name].distance(drawn[name]) <= SAME for name in whole if name not in redrawn)  # norms, biases


@pytest.mark.slow
def test_a_run_with_attention_dropout_or_other_data_is_flagged(run_cli, runs):
    dropout = run_cli(["compare", runs["tp1"], runs["dropout"]])
    text = " ".join(dropout.output.split())
    assert dropout.exit_code == 1 and "- same weights (41 tensors)" in text
    assert "trains with attention dropout 0.1: dropout draws random masks, so the run is not repeatable" in text
    data = run_cli(["compare", runs["tp1"], runs["other-data"]])
    text = " ".join(data.output.split())
    assert data.exit_code == 1 and "the runs' data differ: the token ids of their first forward pass" in text
    assert "differs from layer" not in text


class _TEStandIn(torch.nn.Module):
    """TE's DotProductAttention as a capture sees it (its constructor's attributes, its forward's signature),
    computed with SDPA on sbhd tensors."""

    def __init__(self, num_attention_heads: int, layer_number: int):
        super().__init__()
        self.num_attention_heads = self.num_gqa_groups = num_attention_heads
        self.qkv_format, self.attn_mask_type, self.layer_number = "sbhd", "causal", layer_number
        self.attention_dropout, self.softmax_type, self.attention_type = 0.0, "vanilla", "self"

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, attn_mask_type=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))  # sbhd -> bhsd
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).flatten(2)


class TEDotProductAttention(_TEStandIn):
    """Megatron's TE spec's core attention as Megatron writes it: a subclass of TE's that keeps its
    TransformerConfig and calls TE's forward."""

    def __init__(self, config, layer_number: int):
        self.config = config
        super().__init__(config.num_attention_heads, layer_number)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None):
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type)


@pytest.mark.slow
def test_megatrons_te_spec_is_recorded_once_as_te_with_its_layer_number_and_config(tmp_path, monkeypatch):
    import types

    from megatron.core.transformer.transformer_config import TransformerConfig

    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = _TEStandIn
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    config = TransformerConfig(num_layers=4, hidden_size=32, num_attention_heads=4, attention_softmax_in_fp32=True,
                               apply_query_key_layer_scaling=False)
    attention = TEDotProductAttention(config, layer_number=3)
    q, k, v = (torch.randn(8, 2, 4, 8, requires_grad=True) for _ in range(3))
    with attn_doctor.capture(tmp_path / "cap", values=True):
        attention(q, k, v, None).sum().backward()
    (call,) = read_capture(tmp_path / "cap")  # TE's forward, reached through Megatron's: one call
    module = call.meta["arguments"]["module"]
    assert call.meta["api"] == "te.DotProductAttention" and module["layer_number"] == 3
    assert module["megatron"]["attention_softmax_in_fp32"] is True
    assert module["megatron"]["tensor_model_parallel_size"] == 1 and module["megatron"]["num_attention_heads"] == 4
    assert case_of(call, tmp_path / "cap").short().startswith("b2 s8 h4 d8 fp32 causal")


def test_a_module_spec_reads_its_mapping_and_refuses_a_bad_one():
    spec = parse_module_spec(HAND)
    assert spec == ModuleSpec("tests.models.hand_attention.CoreAttention", ("query", "key", "value"), "bshd", True)
    assert parse_module_spec(spec.to_text()) == spec
    assert parse_module_spec("pkg.Attention").arguments == ("0", "1", "2")
    for bad, said in (("Attention", "PKG.Class"), ("pkg.A:layout=hbsd", "layout"), ("pkg.A:scale=-1", "positive"),
                      ("pkg.A:causal=maybe", "true or false"), ("pkg.A:mask=m", "unknown key")):
        with pytest.raises(Exception, match=said):
            parse_module_spec(bad)


def _hand_written(faulty: bool = False) -> list[str]:
    return [sys.executable, "-c", f"from tests.models.hand_attention import train; train(faulty={faulty})"]


@pytest.mark.slow
def test_a_named_module_with_hand_written_attention_is_captured_replayed_and_compared(run_cli, tmp_path):
    for name, faulty in (("right", False), ("wrong", True)):
        result = run_cli(["capture", "--out", tmp_path / name, "--values", "--module", HAND, "--",
                          *_hand_written(faulty)])
        assert result.exit_code == 0, result.output
    calls = read_capture(tmp_path / "right")
    assert [c.meta["api"] for c in calls] == ["module:tests.models.hand_attention.CoreAttention"] * 2
    assert case_of(calls[0], tmp_path / "right").short().startswith("b2 s12 h2 d8 fp32 causal")
    replayed = run_cli(["replay", tmp_path / "right", "--device", "cpu", "--out", tmp_path / "r"])
    assert replayed.exit_code == 0, replayed.output
    compared = run_cli(["compare", tmp_path / "right", tmp_path / "wrong"])
    text = " ".join(compared.output.split())
    assert compared.exit_code == 1 and "differs from layer 1 (step 0) on: module:tests.models.hand_attention" in text
    assert "q, k, v: bitwise the same up to layer 1, apart from layer 2 on" in text
    assert "what B (" in text and "wrong attention at layer 1 passed on to the layers after it" in text


@pytest.mark.slow
def test_a_named_module_never_called_or_not_mappable_is_bad_input(run_cli, tmp_path):
    never = run_cli(["capture", "--out", tmp_path / "a", "--module", "tests.models.hand_attention.Nowhere", "--",
                     *_hand_written()])
    assert never.exit_code == 2 and "was never called" in never.stderr
    unmapped = run_cli(["capture", "--out", tmp_path / "b", "--module",
                        "tests.models.hand_attention.CoreAttention:q=query,k=keys,v=value", "--", *_hand_written()])
    assert unmapped.exit_code == 2 and "cannot be mapped" in unmapped.stderr and "'keys'" in unmapped.stderr
