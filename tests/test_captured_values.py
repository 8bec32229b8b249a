"""Captured values that are missing or do not fit (issue 44): a call whose recorded values file is gone, damaged,
or holds other tensors than the call's (by name or shape) is never judged on other numbers without saying so.
When no call can be judged: exit 2, one line naming the call and the file. When some can: those are judged, the
others listed as not judged, and the exit code is 1 even when every judged path passes."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import attn_doctor
from attn_doctor.tracing.store import read_capture
from tests.cli_checks import one_line_error
from tests.models import tiny_gpt

pytestmark = pytest.mark.slow  # replays run worker processes
REPLAY = ["--backend", "local", "--backend", "sdpa.math", "--layout", "contiguous", "--device", "cpu"]


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> Path:
    """Two layers' calls with values; the second made a call of its own (not causal), so that the two are two
    distinct calls, each replayed on its own values."""
    root = tmp_path_factory.mktemp("values") / "capture"
    with attn_doctor.capture(root, values=True, steps=[0]):
        tiny_gpt.train(steps=1, layers=2)
    calls_file = next(root.glob("rank0/calls-*.jsonl"))
    lines = [json.loads(line) for line in calls_file.read_text().splitlines() if line.strip()]
    signature = next(line for line in lines if "signature" in line and "index" not in line)
    other = {**signature, "signature": 1, "arguments": {**signature["arguments"], "is_causal": False}}
    second = next(i for i, line in enumerate(lines) if line.get("index") == 1)
    lines.insert(second, other)
    lines[second + 1]["signature"] = 1
    calls_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert len({call.signature() for call in read_capture(root)}) == 2
    return root


def _values_file(root: Path, index: int, suffix: str = "") -> Path:
    return next(root.glob(f"rank0/*-call-{index:06d}{suffix}.safetensors"))


def _rewrite(path: Path, change: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


def _gone(root: Path, index: int) -> str:
    path = _values_file(root, index)
    path.unlink()
    return f"its values file {path} is gone"


def _other_shape(root: Path, index: int) -> str:
    path = _values_file(root, index)
    _rewrite(path, lambda t: t.update(q=t["q"][:, :, :8].contiguous()))
    return f"{path} holds q of shape [2, 4, 8, 16], not the call's q of shape [2, 4, 16, 16]"


def _other_name(root: Path, index: int) -> str:
    path = _values_file(root, index)
    _rewrite(path, lambda t: t.update(query=t.pop("q")))
    return f"{path} holds no q"


def _cut_short(root: Path, index: int) -> str:
    path = _values_file(root, index)
    path.write_bytes(path.read_bytes()[:100])
    return f"its values file {path} is not readable"


def _no_output_gradient(root: Path, index: int) -> str:
    path = _values_file(root, index, ".dout")
    _rewrite(path, lambda t: t.update(grad=t.pop("dout")))
    return f"its output gradient's file {path} holds no output gradient of shape"


DAMAGES = [_gone, _other_shape, _other_name, _cut_short, _no_output_gradient]
IDS = [damage.__name__.lstrip("_") for damage in DAMAGES]


@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_no_call_judged_on_other_values_is_bad_input_naming_call_and_file(damage, capture, tmp_path, run_cli):
    root = shutil.copytree(capture, tmp_path / "capture")
    words = [damage(root, 0), damage(root, 1)][0]
    line = one_line_error(run_cli(["replay", root, *REPLAY, "--out", tmp_path / "out"]))
    assert "no call of" in line and "rank 0, call 0 of process" in line and words in line, line


@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_the_calls_that_can_be_read_are_judged_and_the_others_listed(damage, capture, tmp_path, run_cli):
    root = shutil.copytree(capture, tmp_path / "capture")
    words = damage(root, 1)
    out = tmp_path / "out"
    result = run_cli(["replay", root, *REPLAY, "--out", out])
    assert result.exit_code == 1, result.output  # every judged path passes: 1 for the call not judged
    assert "Traceback" not in result.output
    flat = " ".join(result.stdout.split())
    assert "not replayed (" in flat and " ".join(words.split()) in flat
    assert "Not judged: 1 captured call (rank 0, call 1 of process" in flat
    document = json.loads((out / "results.json").read_text())
    assert {row["verdict"] for row in document["results"]} == {"PASS"}
    assert len(document["not_judged"]) == 1 and words in document["not_judged"][0]
    assert "Not judged: 1 captured call" in run_cli(["report", out]).stdout  # the report reads it back


def test_run_replay_of_a_call_whose_values_are_gone_is_bad_input(capture, tmp_path, run_cli):
    root = shutil.copytree(capture, tmp_path / "capture")
    call = next(c for c in read_capture(root) if c.index == 0)
    words = _gone(root, 0)
    reference = f"{root}@0.{call.meta['process']['pid']}.0"
    line = one_line_error(run_cli(["run", "--replay", reference, "--device", "cpu", "--backend", "local"]))
    assert "this call cannot be replayed" in line and words in line, line


def test_an_intact_capture_is_judged_whole(capture, tmp_path, run_cli):
    out = tmp_path / "out"
    result = run_cli(["replay", capture, *REPLAY, "--out", out])
    assert result.exit_code == 0, result.output
    assert "not_judged" not in json.loads((out / "results.json").read_text())


def test_a_call_outside_any_numbered_layer_is_listed_with_those_inside_one(capture, tmp_path, run_cli):
    """A call whose layer is not known (null: no layer number in its module path) and one of layer 0 are one
    distinct call: replay lists its layers as "0, none" (it once sorted None against 0: a traceback)."""
    root = shutil.copytree(capture, tmp_path / "capture")
    calls_file = next(root.glob("rank0/calls-*.jsonl"))
    lines = [json.loads(line) for line in calls_file.read_text().splitlines() if line.strip()]
    for line in lines:
        if line.get("index") == 1:
            line.update(signature=0, layer=None)  # the same call as call 0's, outside any numbered layer
    calls_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = run_cli(["replay", root, *REPLAY, "--out", tmp_path / "out"])
    assert result.exit_code == 0, result.output
    assert "2 calls, 1 distinct" in result.stdout and "layers 0, none" in " ".join(result.stdout.split())


@pytest.mark.parametrize("damage", DAMAGES, ids=IDS)
def test_compare_reads_captured_values_through_the_same_check(damage, capture, tmp_path, run_cli):
    """compare judges nothing on values that are gone or do not fit either: one line naming the call and the file,
    exit 2 (before, a traceback, or the call silently left out)."""
    root = shutil.copytree(capture, tmp_path / "capture")
    words = damage(root, 1)
    line = one_line_error(run_cli(["compare", capture, root]))
    assert f"{root}: rank 0, call 1 of process" in line and words in line, line
