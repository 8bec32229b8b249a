"""Were two runs the same model at all (issue 42, `attn_doctor.tracing.upstream`)? Each finding on both sides:
weights the same, the same up to rounding, of other shapes, different (with the cause and the fix Megatron's
TP initialisation calls for), not recorded; data; dropout (settings, modules, calls; not in eval mode); the
softmax scale and the settings that change the rounding only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from attn_doctor.tracing.store import CapturedCall, model_facts_path
from attn_doctor.tracing.upstream import check_upstream
from attn_doctor.tracing.weights import shard_prints

WEIGHTS = {"decoder.layers.0.self_attention.linear_qkv.weight": torch.randn(12, 4),
           "decoder.layers.0.input_layernorm.weight": torch.ones(4),
           "embedding.word_embeddings.weight": torch.randn(16, 4)}
MEGATRON = {"framework": "megatron", "training": True, "attention_dropout": 0.0, "hidden_dropout": 0.0,
            "softmax_in_fp32": True, "softmax_scale": None, "query_key_layer_scaling": False,
            "use_cpu_initialization": True, "dropout_modules": None, "seeds": {"torch": 1, "megatron": 1234}}
DATA = {"argument": "argument 0", "shape": [2, 16], "dtype": "int64", "sha256": "a" * 64}


def _capture(root: Path, weights: dict[str, torch.Tensor] | None = None, tp: int = 1, data: dict | None = DATA,
             **settings) -> Path:
    """A capture folder holding only what each TP rank recorded of the model (`model-<PID>.json`)."""
    for rank in range(tp):
        named = [(name, t) for name, t in (weights or WEIGHTS).items()]
        facts = {"rank": rank, "parallel": {"tp": tp, "tp_rank": rank, "cp": 1},
                 "weights": [p.to_dict() for p in shard_prints(named, tp, rank)],
                 "settings": {**MEGATRON, **settings}, "data": data}
        path = model_facts_path(root, rank, 100 + rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(facts))
    return root


def _check(a: Path, b: Path, calls=([], [])):
    upstream = check_upstream((a, b), calls, ("A", "B"))
    return upstream, {f.topic: f for f in upstream.findings}


def test_the_same_model_data_and_settings_differ_nowhere(tmp_path):
    upstream, found = _check(_capture(tmp_path / "a"), _capture(tmp_path / "b"))
    assert not upstream.differs and upstream.differing == []
    assert found["weights"].text == "same weights (3 tensors)" and found["data"].differs is False
    assert found["dropout"].text == "no dropout in either run" and "settings" not in found


def test_weights_drawn_again_on_the_gpu_differ_and_the_fix_is_said(tmp_path):
    redrawn = {name: torch.randn_like(t) if t.dim() == 2 else t for name, t in WEIGHTS.items()}
    upstream, found = _check(_capture(tmp_path / "a"), _capture(tmp_path / "b", redrawn, use_cpu_initialization=False))
    assert upstream.differing == ["weights"]
    text = found["weights"].text
    assert text.startswith("the runs' weights differ: 2 of 3 tensors, first decoder.layers.0.self_attention.linear_qkv")
    assert "not rounding" in text and "(use_cpu_initialization off in B)" in text and "--use-cpu-initialization" in text


def test_weights_in_bf16_are_the_same_up_to_rounding(tmp_path):
    in_bf16 = {name: t.bfloat16() for name, t in WEIGHTS.items()}
    upstream, found = _check(_capture(tmp_path / "a"), _capture(tmp_path / "b", in_bf16))
    assert not upstream.differs
    assert found["weights"].text == "same weights (3 tensors; 2 only up to their dtypes' rounding)"


def test_a_padded_vocabulary_is_listed_not_compared_and_a_parameter_of_one_run_differs(tmp_path):
    padded = {**WEIGHTS, "embedding.word_embeddings.weight": torch.randn(32, 4)}
    upstream, found = _check(_capture(tmp_path / "a"), _capture(tmp_path / "b", padded))
    assert not upstream.differs
    assert "1 of other shapes, not compared (embedding.word_embeddings.weight: [16, 4] against [32, 4], a " \
           "vocabulary padded" in found["weights"].text
    extra = {**WEIGHTS, "decoder.layers.1.input_layernorm.weight": torch.ones(4)}
    upstream, found = _check(_capture(tmp_path / "c"), _capture(tmp_path / "d", extra))
    assert "1 only in B (first decoder.layers.1.input_layernorm.weight)" in found["weights"].text


def test_facts_not_recorded_are_said_and_never_blamed(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    upstream, found = _check(_capture(tmp_path / "a"), bare)
    assert not upstream.differs and found["weights"].differs is None and "not recorded in B" in found["weights"].text
    assert found["data"].differs is None


def test_data_differ_and_context_parallel_chunks_are_not_compared(tmp_path):
    other = {**DATA, "sha256": "b" * 64}
    upstream, found = _check(_capture(tmp_path / "a"), _capture(tmp_path / "b", data=other))
    assert upstream.differing == ["data"] and "feed both runs the same data" in found["data"].text
    cp = _capture(tmp_path / "cp", data=other)
    for path in cp.glob("rank*/model-*.json"):
        facts = json.loads(path.read_text())
        facts["parallel"]["cp"] = 2
        path.write_text(json.dumps(facts))
    assert _check(tmp_path / "a", cp)[1]["data"].differs is None


def test_dropout_in_settings_or_calls_is_not_repeatable_and_eval_mode_draws_none(tmp_path):
    upstream, found = _check(_capture(tmp_path / "a"), _capture(tmp_path / "b", attention_dropout=0.1))
    assert upstream.differing == ["dropout"] and found["dropout"].text.startswith("B trains with attention dropout 0.1")
    assert not _check(tmp_path / "a", _capture(tmp_path / "e", attention_dropout=0.1, training=False))[0].differs
    call = CapturedCall(tmp_path, {"arguments": {"dropout_p": 0.2}})
    upstream, found = _check(tmp_path / "a", _capture(tmp_path / "c"), ([], [call]))
    assert "B trains with attention calls with dropout 0.2" in found["dropout"].text


def test_another_softmax_scale_differs_and_rounding_settings_are_said(tmp_path):
    upstream, found = _check(_capture(tmp_path / "a", softmax_scale=0.25), _capture(tmp_path / "b", softmax_scale=0.5))
    assert upstream.differing == ["settings"]
    upstream, found = _check(_capture(tmp_path / "c"), _capture(tmp_path / "d", softmax_in_fp32=False))
    assert not upstream.differs and found["settings"].text == ("settings that change the rounding only differ: "
                                                              "softmax in fp32 True and False")


def test_compare_of_runs_that_differ_upstream_prints_no_empty_table(tmp_path, run_cli):
    """Runs that are not the same model judge no kernel; where no layer was recorded by both, there is no table to
    print, and none is printed (before: a table of headers alone)."""
    from attn_doctor.tracing import store

    redrawn = {name: t + 1 for name, t in WEIGHTS.items()}
    runs = [_capture(tmp_path / "a"), _capture(tmp_path / "b", redrawn)]
    for root in runs:  # the header a capture starts with, and no call recorded with values
        store.write_json(root / store.HEADER, {"format": store.FORMAT, "format_version": store.FORMAT_VERSION})
    result = run_cli(["compare", *runs])
    assert result.exit_code == 1, result.output
    assert "the runs' weights differ" in result.output
    assert "A vs B" not in result.output and "inputs' part" not in result.output
