"""The weights' fingerprint (issue 42, `attn_doctor.tracing.weights`): the same weights give the same fingerprint
at any TP size, however Megatron splits them (dimension, stride); two draws are far apart; one draw kept in
bf16 is apart by bf16's rounding only; names match across wrappers, pipeline stages and the TE and local
layer specs. And what `attn_doctor.tracing.model_facts` reads of a model: its settings and its data."""

from __future__ import annotations

import pytest
import torch

from attn_doctor.tracing.model_facts import data_of, model_facts, settings_of
from attn_doctor.tracing.weights import (INDEPENDENT, SAME, canonical_name, joined, layer_numbers,
                                         partition_of, shard_prints)


def _shard(full: torch.Tensor, dim: int, tp: int, rank: int, stride: int = 1) -> torch.Tensor:
    """TP rank `rank`'s shard as Megatron's _initialize_affine_weight_cpu makes it, with its attributes."""
    per_block = full.shape[dim] // (tp * stride)
    shard = torch.cat(torch.split(full, per_block, dim=dim)[rank::tp], dim=dim).clone()
    shard.tensor_model_parallel, shard.partition_dim, shard.partition_stride = True, dim, stride
    return shard


FULL = {  # name: (the whole tensor, the dimension TP splits, its stride; -1: held whole)
    "qkv": (torch.randn(48, 16, generator=torch.Generator().manual_seed(1)), 0, 2),
    "proj": (torch.randn(16, 32, generator=torch.Generator().manual_seed(2)), 1, 1),
    "bias": (torch.randn(24, generator=torch.Generator().manual_seed(3)), 0, 1),
    "norm": (torch.randn(16, generator=torch.Generator().manual_seed(4)), -1, 1),
    "experts": (torch.randn(4, 8, 6, generator=torch.Generator().manual_seed(5)), 1, 1),
}


def _fingerprints(tp: int, full: dict | None = None, dtype: torch.dtype = torch.float32):
    records = []
    for rank in range(tp):
        named = [(name, (_shard(t, dim, tp, rank, stride) if dim >= 0 else t).to(dtype))
                 for name, (t, dim, stride) in (full or FULL).items()]
        for (name, tensor), (_, dim, stride) in zip(named, (full or FULL).values()):
            if dim >= 0:
                tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = True, dim, stride
        records.append({"parallel": {"tp": tp, "tp_rank": rank},
                        "weights": [p.to_dict() for p in shard_prints(named, tp, rank)]})
    return joined(records).prints


@pytest.mark.parametrize("tp", [2, 4])
def test_the_same_weights_give_the_same_fingerprint_at_any_tp_size(tp):
    whole, split = _fingerprints(1), _fingerprints(tp)
    assert set(split) == set(whole)
    for name in whole:
        assert split[name].shape == whole[name].shape == tuple(FULL[name][0].shape)
        assert split[name].distance(whole[name]) <= SAME
        assert split[name].norm == pytest.approx(float(FULL[name][0].double().norm()), rel=1e-6)


def test_two_draws_are_far_apart_and_one_draw_in_bf16_only_by_its_rounding():
    other = {name: (torch.randn_like(t), dim, stride) for name, (t, dim, stride) in FULL.items()}
    whole, drawn_again, in_bf16 = _fingerprints(1), _fingerprints(2, other), _fingerprints(2, dtype=torch.bfloat16)
    for name in whole:
        assert whole[name].distance(drawn_again[name]) > 0.5, name
        assert SAME < whole[name].distance(in_bf16[name]) <= 2 ** -7, name
    assert sum(whole[n].distance(drawn_again[n]) > INDEPENDENT for n in whole) >= 3


def test_a_shard_taken_from_the_wrong_place_is_told_apart():
    """Rank 1 holding rank 0's block (a wrong QKV interleave, a misplaced shard) is not the same weights."""
    full, dim, stride = FULL["qkv"]
    records = []
    for rank in range(2):
        shard = _shard(full, dim, 2, 0, stride)  # both ranks hold rank 0's blocks
        shard.tensor_model_parallel, shard.partition_dim, shard.partition_stride = True, dim, stride
        records.append({"parallel": {"tp": 2, "tp_rank": rank},
                        "weights": [p.to_dict() for p in shard_prints([("qkv", shard)], 2, rank)]})
    assert joined(records).prints["qkv"].distance(_fingerprints(1)["qkv"]) > 0.5


def test_a_split_parameter_missing_a_ranks_part_is_incomplete_and_a_replica_is_left_out():
    full, dim, stride = FULL["proj"]
    shard = _shard(full, dim, 2, 0)
    record = {"parallel": {"tp": 2, "tp_rank": 0},
              "weights": [p.to_dict() for p in shard_prints([("proj", shard)], 2, 0)]}
    replica = {**record, "parallel": {"tp": 2, "tp_rank": 1, "dp_rank": 1}}
    prints = joined([record, replica])
    assert prints.incomplete == ["proj"] and not prints.prints


def test_parameters_without_megatrons_attributes_are_whole():
    assert partition_of(torch.zeros(4, 4), 2, 1).dim == -1
    marked = torch.zeros(4, 4)
    marked.tensor_model_parallel, marked.partition_dim, marked.partition_stride = True, 1, 1
    assert partition_of(marked, 1, 0).dim == -1 and partition_of(marked, 2, 1).dim == 1


def test_names_match_across_wrappers_pipeline_stages_and_the_te_and_local_specs():
    assert canonical_name("module.module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == \
        "decoder.layers.0.input_layernorm.weight"
    assert canonical_name("decoder.layers.3.mlp.linear_fc1.layer_norm_bias") == \
        "decoder.layers.3.pre_mlp_layernorm.bias"
    assert canonical_name("decoder.layers.1.self_attention.linear_qkv.weight", {"decoder.layers.1": 5}) == \
        "decoder.layers.5.self_attention.linear_qkv.weight"

    class Layer(torch.nn.Module):
        def __init__(self, number: int):
            super().__init__()
            self.layer_number = number
            self.linear = torch.nn.Linear(2, 2)

    class Stage(torch.nn.Module):  # the second pipeline stage of a 4-layer model: its layers are 3 and 4
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(3), Layer(4)])

    wrapped = torch.nn.Sequential()
    wrapped.module = Stage()
    assert layer_numbers(wrapped) == {"layers.0": 2, "layers.1": 3}
    facts = model_facts(wrapped, (), {}, 0, {})
    assert [w["name"] for w in facts["weights"]] == ["layers.2.linear.weight", "layers.2.linear.bias",
                                                     "layers.3.linear.weight", "layers.3.linear.bias"]


class _HFStyle(torch.nn.Module):
    def __init__(self, attention_dropout: float):
        super().__init__()
        self.config = type("Config", (), {"attention_dropout": attention_dropout, "hidden_dropout_prob": 0.0,
                                          "to_dict": lambda self: {}})()
        self.embed = torch.nn.Embedding(10, 4)
        self.drop = torch.nn.Dropout(attention_dropout)


def test_settings_read_dropout_from_the_config_and_the_dropout_modules_in_training_only():
    model = _HFStyle(0.1)
    settings = settings_of(model)
    assert settings["framework"] == "huggingface" and settings["attention_dropout"] == 0.1
    assert settings["dropout_modules"] == {"count": 1, "first": "drop", "p": 0.1} and settings["training"]
    assert settings_of(model.eval())["dropout_modules"] is None
    assert settings_of(_HFStyle(0.0))["dropout_modules"] is None


def test_the_data_is_the_token_ids_hash_and_floats_are_not_data():
    tokens = torch.tensor([[1, 2, 3]])
    found = data_of((tokens,), {})
    by_name = data_of((), {"input_ids": tokens.clone()})
    assert found["shape"] == [1, 3] and by_name["argument"] == "input_ids" and by_name["sha256"] == found["sha256"]
    assert data_of((tokens + 1,), {})["sha256"] != found["sha256"]
    assert data_of((torch.randn(1, 3),), {}) is None
