"""Comparing two captures layer by layer (issue 17, third part): TP=1 against TP=2 (gloo, torchrun) of the same
model and seed is the same within rounding; a faulty attention call on one rank is named with its layer and
rank; the thresholds come from the float64 replay of each run's own calls."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

import attn_doctor
from attn_doctor.tracing.compare import FACTOR, compare_captures
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


def test_a_faulty_call_on_one_rank_is_named_with_its_layer_and_rank(run_cli, captures):
    result = run_cli(["compare", captures["tp1"], captures["tp2-faulty"]])
    assert result.exit_code == 1, result.output
    text = " ".join(result.output.split())
    assert "differs from layer 1 (step 0) on: flash_attn.flash_attn_func" in text
    assert "is the one far from float64" in text and text.endswith("on rank 1")


def test_the_faulty_run_is_named_whichever_side_it_is_on(captures):
    forward = compare_captures(captures["tp2-faulty"], captures["tp1"])
    layer, measured = forward.first_fault()
    assert (layer.layer, measured.faulty_run) == (1, 0)
    assert measured.e[0] > FACTOR * max(measured.e[1], measured.floor)
    assert compare_captures(captures["tp2"], captures["tp1"]).same


def test_captures_without_common_values_are_bad_input(run_cli, captures, tmp_path):
    with attn_doctor.capture(tmp_path / "meta-only"):
        tiny_gpt.train(steps=1, layers=1)
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
