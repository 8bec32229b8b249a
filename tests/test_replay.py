"""Replaying captured calls (issue 17, second part): the exact views and values come back, every path is judged
on them, identical calls are checked once, a faulty --kernel is named, and the rows feed report and bisect."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attn_doctor
from attn_doctor.core.layouts import CAPTURED
from attn_doctor.numerics.inputs import make_inputs
from attn_doctor.tracing.replay_case import case_of
from attn_doctor.tracing.replay_source import CAPTURED_SOURCE, captured_dout, captured_views, view_geometry
from attn_doctor.tracing.store import load_values, read_capture
from tests.models import tiny_gpt

ROOT = Path(__file__).resolve().parents[1]
FAULTY = f"{ROOT / 'tests' / 'models' / 'tiny_gpt.py'}:faulty_kernel"


@pytest.fixture(scope="module")
def capture_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("capture")
    with attn_doctor.capture(root, values=True, layers=[1], steps=[1]):
        tiny_gpt.train(steps=2, layers=3)
    return root


def _with_values(root: Path):
    (call,) = [c for c in read_capture(root) if c.values_path is not None]
    return call


def test_the_captured_views_come_back_with_the_same_shapes_strides_offsets_and_storage(capture_dir):
    call = _with_values(capture_dir)
    case = case_of(call, capture_dir)
    x = make_inputs(case, torch.device("cpu"), CAPTURED_SOURCE)
    qkv = captured_views(case, x.q, x.k, x.v, "bshd")
    for name, view in zip("qkv", (qkv.q, qkv.k, qkv.v)):
        captured = call.meta["tensors"][name]
        geometry = view_geometry(view.transpose(1, 2))  # what SDPA's transpose hands the kernel
        assert geometry == {"shape": captured["shape"], "stride": captured["stride"],
                            "storage_offset": captured["storage_offset"],
                            "storage_nbytes": captured["storage"]["nbytes"]}
    assert len(qkv.leaves) == 1  # q, k, v share one storage, as they did
    values = load_values(call.values_path)
    assert torch.equal(qkv.q.transpose(1, 2), values["q"]) and torch.equal(x.q.transpose(1, 2), values["q"])
    assert torch.equal(x.dout.transpose(1, 2), load_values(call.dout_path)["dout"])


def test_the_output_gradient_comes_back_with_the_geometry_the_runs_backward_gave_it(capture_dir, monkeypatch):
    """The captured layout hands the path's backward dO as the run's did (a bhsd view of a bshd buffer here),
    holding the same values as the reference's; without a recorded geometry, or with one whose elements share
    memory (an expanded gradient), dO stands contiguous."""
    call = _with_values(capture_dir)
    case = case_of(call, capture_dir)
    x = make_inputs(case, torch.device("cpu"), CAPTURED_SOURCE)
    dout = captured_dout(case, x.dout)
    captured = call.meta["tensors"]["dout"]
    assert captured["stride"] != torch.empty(captured["shape"]).stride()  # not contiguous in the run
    assert view_geometry(dout.transpose(1, 2)) == {  # what SDPA's transpose hands the kernel's backward
        "shape": captured["shape"], "stride": captured["stride"], "storage_offset": captured["storage_offset"],
        "storage_nbytes": captured["storage"]["nbytes"]}
    assert torch.equal(dout, x.dout)
    for geometry in (None, {**captured, "stride": [0, 0, 0, 1]}):
        tensors = {**call.meta["tensors"], "dout": geometry} if geometry else {
            name: t for name, t in call.meta["tensors"].items() if name != "dout"}
        changed = type(call)(call.folder, {**call.meta, "tensors": tensors})
        monkeypatch.setattr("attn_doctor.tracing.replay_source.load_call", lambda reference, changed=changed: changed)
        assert captured_dout(case, x.dout) is None


class _TwoUsesOfTheOutput(torch.nn.Module):
    """SDPA on contiguous bhsd q, k, v, twice: an output used head-major, whose gradient is contiguous bhsd (not
    the transpose of a contiguous bshd tensor, which a replay's contiguous layout hands the backward); and one
    used token-major, whose gradient is that transpose, strided unlike the (contiguous bhsd) output."""

    def forward(self, q, k, v):
        b, h, s, d = q.shape
        return F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(
            q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h * d)


@pytest.mark.slow
def test_a_replayed_paths_backward_gets_the_output_gradient_laid_out_as_in_the_run(run_cli, tmp_path, monkeypatch):
    q, k, v = (torch.randn(2, 3, 8, 4, requires_grad=True) for _ in range(3))
    weight = torch.randn(2, 3, 8, 4)
    with attn_doctor.capture(tmp_path / "cap"):
        head_major, token_major = _TwoUsesOfTheOutput()(q, k, v)
        ((head_major * weight).sum() + (token_major * weight.reshape(2, 8, 12)).sum()).backward()
    calls = read_capture(tmp_path / "cap")
    assert [(c.meta["tensors"]["out"]["stride"], c.meta["tensors"]["dout"]["stride"]) for c in calls] == [
        ([96, 32, 4, 1], [96, 32, 4, 1]), ([96, 32, 4, 1], [96, 4, 12, 1])]
    log = tmp_path / "dout.log"
    monkeypatch.setenv("TINY_GPT_DOUT_LOG", str(log))
    kernel = f"{ROOT / 'tests' / 'models' / 'tiny_gpt.py'}:dout_recording_kernel"
    result = run_cli(["replay", tmp_path / "cap", "--kernel", f"recording={kernel}", "--device", "cpu", "--out",
                      tmp_path / "r"])
    assert result.exit_code == 0, result.output
    seen = set(log.read_text().splitlines())
    assert seen == {"[2, 3, 8, 4] [96, 32, 4, 1]", "[2, 3, 8, 4] [96, 4, 12, 1]"}  # captured, contiguous layouts
    # the known defects beside the rows see the second call's dO in its captured layout as strided unlike out
    from attn_doctor.cli.known import probe_with_capture as row_probe
    from attn_doctor.machine.fingerprint import collect_env
    from attn_doctor.results.report import read_report

    report = read_report(tmp_path / "r" / "results.json")
    env = collect_env(read_te=False)
    strided = sorted((row.layout, row_probe(row, env).context.dout_strided) for row in report.rows
                     if row.backend == "recording")
    assert strided == [(CAPTURED, False), (CAPTURED, True), ("contiguous", False), ("contiguous", False)]


@pytest.mark.slow
def test_replay_judges_each_distinct_call_once_and_every_path_passes(run_cli, capture_dir, tmp_path):
    result = run_cli(["replay", capture_dir, "--backend", "sdpa", "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 0, result.output
    assert "6 calls, 1 distinct" in result.output and "6 calls: torch.sdpa" in result.output
    assert "captured values" in result.output
    rows = json.loads((tmp_path / "r" / "results.json").read_text())["results"]
    layouts = {(r["backend"], r["layout"]) for r in rows if r["verdict"] == "PASS"}
    assert {("sdpa.math", CAPTURED), ("sdpa.math", "contiguous"), ("local", "contiguous")} <= layouts
    report = run_cli(["report", tmp_path / "r", "--format", "markdown"])
    assert report.exit_code == 0 and "call 0." in report.output  # the replayed call, named in the case


@pytest.mark.slow
def test_replay_with_a_faulty_kernel_names_it_and_bisect_starts_from_its_row(run_cli, capture_dir, tmp_path):
    result = run_cli(["replay", capture_dir, "--kernel", f"faulty={FAULTY}", "--device", "cpu", "--layer", "1",
                      "--out", tmp_path / "r"])
    assert result.exit_code == 1, result.output
    assert "Faulty: faulty" in result.output and "captured, contiguous" in result.output
    bisected = run_cli(["bisect", "--from", tmp_path / "r", "--device", "cpu", "--json", tmp_path / "b.json"])
    assert bisected.exit_code == 0, bisected.output
    found = json.loads((tmp_path / "b.json").read_text())
    assert "replay" not in found["minimal_case"]  # seeded inputs of its shapes fail too: the capture is not needed


@pytest.mark.slow
def test_a_replayed_rows_results_render_and_bisect_from_their_rows_when_the_capture_is_gone(run_cli, capture_dir,
                                                                                           tmp_path):
    """A results row names its captured call, but is whole without it: the report renders, and bisect starts
    from seeded inputs of the call's shapes, saying that the capture is gone."""
    moved = tmp_path / "capture"
    shutil.copytree(capture_dir, moved)
    result = run_cli(["replay", moved, "--kernel", f"faulty={FAULTY}", "--device", "cpu", "--layer", "1",
                      "--out", tmp_path / "r"])
    assert result.exit_code == 1, result.output
    shutil.rmtree(moved)
    report = run_cli(["report", tmp_path / "r", "--format", "markdown"])
    assert report.exit_code == 0, report.output
    assert "faulty" in report.output and "captured" in report.output
    bisected = run_cli(["bisect", "--from", tmp_path / "r", "--device", "cpu", "--json", tmp_path / "b.json"])
    assert bisected.exit_code == 0, bisected.output
    assert f"the capture {moved} of this replayed row is gone" in " ".join(bisected.output.split())
    assert "replay" not in json.loads((tmp_path / "b.json").read_text())["start_case"]


@pytest.mark.slow
def test_a_bisect_that_needs_the_captured_values_says_they_are_missing(run_cli, tmp_path):
    """A fault that only the captured values trigger: without the capture folder, bisect says that the values
    are needed and missing, and finds nothing to bisect on seeded inputs (exit 1)."""
    q = torch.randn(1, 2, 8, 4) * 4 * tiny_gpt.LARGE_INPUT  # far beyond any seeded standard-normal entry
    with attn_doctor.capture(tmp_path / "cap", values=True):
        torch.nn.functional.scaled_dot_product_attention(q, q.flip(2), q.flip(3))
    kernel = f"{ROOT / 'tests' / 'models' / 'tiny_gpt.py'}:faulty_on_large_inputs_kernel"
    result = run_cli(["replay", tmp_path / "cap", "--kernel", f"large={kernel}", "--device", "cpu",
                      "--out", tmp_path / "r"])
    assert result.exit_code == 1 and "Faulty: large" in result.output, result.output
    shutil.rmtree(tmp_path / "cap")
    bisected = run_cli(["bisect", "--from", tmp_path / "r", "--device", "cpu"])
    assert bisected.exit_code == 1, bisected.output
    said = " ".join(bisected.output.split())
    assert "nothing to bisect" in said and "which are needed and missing" in said and str(tmp_path / "cap") in said


@pytest.mark.slow
def test_run_replay_checks_one_call_and_refuses_other_shapes(run_cli, capture_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # run writes its results under ./attn-doctor-results
    call = _with_values(capture_dir)
    reference = case_of(call, capture_dir).replay
    result = run_cli(["run", "--replay", reference, "--backend", "sdpa.math", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "captured" in result.output
    refused = run_cli(["run", "--replay", reference, "--batch", "1", "--device", "cpu"])
    assert refused.exit_code == 2 and "captured shapes" in refused.stderr
    missing = run_cli(["run", "--replay", f"{capture_dir}@0.1.999", "--device", "cpu"])
    assert missing.exit_code == 2 and "names no call" in missing.stderr


def test_calls_that_cannot_be_replayed_say_why(run_cli, tmp_path):
    q = torch.randn(1, 2, 8, 4)
    with attn_doctor.capture(tmp_path / "cap"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(8, 8, dtype=torch.bool))
        torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    result = run_cli(["replay", tmp_path / "cap", "--device", "cpu"])
    assert result.exit_code == 2 and "can be replayed yet" in result.stderr
    assert "an attn_mask whose values were not captured (capture with --values)" in result.output
    assert "dropout 0.1" in result.output


@pytest.mark.slow
def test_a_custom_scale_and_q_k_v_that_are_one_tensor_replay_on_seeded_values_through_their_storage(run_cli,
                                                                                                  tmp_path):
    q = torch.randn(1, 2, 8, 4)
    with attn_doctor.capture(tmp_path / "cap"):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.3)
    (call,) = read_capture(tmp_path / "cap")
    case = case_of(call, tmp_path / "cap")
    assert case.scale == 0.3 and "scale 0.3" in case.short()
    x = make_inputs(case, torch.device("cpu"), CAPTURED_SOURCE)
    assert torch.equal(x.q, x.k) and torch.equal(x.k, x.v)  # one tensor in the run: one tensor's values here
    result = run_cli(["replay", tmp_path / "cap", "--backend", "sdpa.math", "--device", "cpu", "--out",
                      tmp_path / "r"])
    assert result.exit_code == 0, result.output
    assert "seeded values (through the shared storage)" in result.output


@pytest.mark.slow
def test_sdpa_masks_replay_as_the_captured_mask_and_bias_per_head_ones_say_why(run_cli, tmp_path):
    q, k, v = (torch.randn(2, 4, 12, 8, requires_grad=True) for _ in range(3))
    lengths = torch.tensor([12, 7])
    keys = torch.arange(12)[None, :] < lengths[:, None]  # key padding, HF style: [b, 1, 1, s_kv]
    left = (torch.arange(12)[None, :] >= 12 - lengths[:, None])  # left padding under a causal mask: [b, 1, s, s]
    causal_left = torch.tril(torch.ones(12, 12, dtype=torch.bool)) & left[:, None, :] & left[:, :, None]
    # An additive mask: a relative-position bias per head with -inf above the diagonal.
    additive = torch.randn(1, 4, 12, 12).masked_fill(~torch.tril(torch.ones(12, 12, dtype=torch.bool)), -math.inf)
    per_head = torch.ones(2, 4, 12, 12, dtype=torch.bool)
    per_head[:, 1, :, 0] = False
    with attn_doctor.capture(tmp_path / "cap", values=True):
        for mask in (keys[:, None, None, :], causal_left[:, None], additive):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=per_head)
    result = run_cli(["replay", tmp_path / "cap", "--backend", "sdpa.math", "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 0, result.output
    assert "a per-head attn_mask" in result.output
    rows = json.loads((tmp_path / "r" / "results.json").read_text())["results"]
    judged = [r for r in rows if r["verdict"] == "PASS"]
    assert {r["case"]["mask_source"] for r in judged} == {"captured"} and len({r["case"]["replay"] for r in judged}) == 3
    assert any(r["tensors"]["out"].get("empty_rows") for r in judged)  # left padding: rows that see no key
    (biased,) = {r["case"]["replay"]: r["case"] for r in judged if r["case"].get("bias")}.values()
    assert biased["bias"] == "post_scale_bias:1hss"
    case = case_of([c for c in read_capture(tmp_path / "cap") if c.index == 2][0], tmp_path / "cap")
    semantics = make_inputs(case, torch.device("cpu"), CAPTURED_SOURCE).semantics
    assert torch.equal(semantics.allowed[0, 0], additive[0, 0] != -math.inf)
    assert torch.equal(semantics.bias, additive.masked_fill(additive == -math.inf, 0))


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="torchrun with gloo")
def test_a_tp2_capture_replays_each_ranks_shards(run_cli, tmp_path):
    import shutil

    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    captured = run_cli(["capture", "--out", tmp_path / "cap", "--values", "--", torchrun, "--nproc-per-node", "2",
                        ROOT / "tests" / "models" / "tiny_gpt.py", "--tp", "2", "--steps", "1", "--layers", "2"])
    assert captured.exit_code == 0, captured.output
    result = run_cli(["replay", tmp_path / "cap", "--backend", "sdpa.math", "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 0, result.output
    assert "4 calls, 1 distinct" in result.output and "ranks 0-1" in result.output
    assert f"h{tiny_gpt.HEADS // 2} " in result.output  # each rank's heads


class _TEStandIn(torch.nn.Module):
    """TE's DotProductAttention as far as a capture sees it: its constructor's attributes, its forward's
    signature; computed with SDPA on sbhd tensors."""

    def __init__(self, num_attention_heads, kv_channels, qkv_format="sbhd", attn_mask_type="causal",
                 window_size=None, attention_dropout=0.0):
        super().__init__()
        self.num_attention_heads, self.num_gqa_groups = num_attention_heads, num_attention_heads
        self.qkv_format, self.attn_mask_type, self.window_size = qkv_format, attn_mask_type, window_size
        self.attention_dropout, self.softmax_type, self.attention_type = attention_dropout, "vanilla", "self"

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, qkv_format=None,
                cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None,
                window_size=None, core_attention_bias_type="no_bias", core_attention_bias=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query_layer, key_layer, value_layer))  # sbhd -> bhsd
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=self.attn_mask_type == "causal")
        return out.permute(2, 0, 1, 3).reshape(query_layer.shape[0], query_layer.shape[1], -1)


@pytest.mark.slow
def test_a_te_call_is_recorded_with_its_module_settings_and_replays_as_its_case(run_cli, tmp_path, monkeypatch):
    import types

    fake = types.ModuleType("transformer_engine.pytorch")
    fake.DotProductAttention = _TEStandIn
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", fake)
    monkeypatch.chdir(tmp_path)  # run writes its results under ./attn-doctor-results
    module = _TEStandIn(4, 8, qkv_format="sbhd", attn_mask_type="causal")
    qkv = torch.randn(16, 2, 3, 4, 8, requires_grad=True)  # [s, b, 3, h, d]: Megatron's packed sbhd
    with attn_doctor.capture(tmp_path / "cap", values=True):
        out = fake.DotProductAttention.forward(module, qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        out.sum().backward()
    (call,) = read_capture(tmp_path / "cap")
    assert call.meta["api"] == "te.DotProductAttention" and call.meta["te"]["backend"].startswith("unknown")
    assert call.meta["arguments"]["module"]["qkv_format"] == "sbhd"
    assert call.meta["tensors"]["q"]["stride"] == [2 * 3 * 4 * 8, 3 * 4 * 8, 8, 1]
    case = case_of(call, tmp_path / "cap")
    assert case.short().startswith("b2 s16 h4 d8 fp32 causal")
    result = run_cli(["run", "--replay", case.replay, "--backend", "sdpa.math", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "captured views are sbhd" in result.output  # SDPA takes bshd: its captured row is a SKIP that says so


@pytest.mark.slow
def test_a_repro_that_still_needs_its_capture_reruns_attn_doctor_on_it(capture_dir, tmp_path):
    from attn_doctor.backends import select
    from attn_doctor.bisect.repro import write_repro
    from attn_doctor.core.coords import Coords

    case = case_of(_with_values(capture_dir), capture_dir)
    for spec, expected in ((select(["sdpa.math"])[0], 0), (select([], [f"faulty={FAULTY}"])[0], 1)):
        path = write_repro(tmp_path / spec.name, Coords.call(case, spec, CAPTURED), None, "test", "attn-doctor replay")
        text = path.read_text()
        assert "--replay" in text and str(capture_dir.resolve()) in text
        done = subprocess.run([sys.executable, path], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == expected, done.stdout + done.stderr


def test_a_damaged_values_file_is_bad_input_said_before_any_work(run_cli, capture_dir, tmp_path):
    damaged = tmp_path / "damaged"
    shutil.copytree(capture_dir, damaged)
    call = _with_values(damaged)
    call.values_path.write_bytes(call.values_path.read_bytes()[:40])  # cut off, as a full disk leaves it
    result = run_cli(["replay", damaged, "--backend", "sdpa", "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 2, result.output
    (line,) = [text for text in result.output.splitlines() if text.startswith("attn-doctor: error:")]
    assert call.values_path.name in line and "capture again" in line and "Traceback" not in result.output
    assert not (tmp_path / "r").exists()


def test_a_call_whose_inputs_are_not_finite_replays_as_cannot_tell(run_cli, tmp_path):
    """A call captured after the values diverged (a NaN in q): the float64 reference is NaN there too, so no
    path can be judged. Every row says INCONCLUSIVE with the reason and the check that would decide, and the
    run exits 1: a path that could not be judged is not a pass."""
    q, k, v = (torch.randn(2, 4, 12, 8, requires_grad=True) for _ in range(3))
    with torch.no_grad():
        q[0, 1, 3, 2] = math.nan
    with attn_doctor.capture(tmp_path / "cap", values=True):
        F.scaled_dot_product_attention(q, k, v).sum().backward()
    result = run_cli(["replay", tmp_path / "cap", "--backend", "sdpa.math", "--device", "cpu", "--out", tmp_path / "r"])
    assert result.exit_code == 1, result.output
    assert "Cannot tell for local, sdpa.math" in " ".join(result.output.split())
    rows = json.loads((tmp_path / "r" / "results.json").read_text())["results"]
    assert {r["verdict"] for r in rows} == {"INCONCLUSIVE"}
    assert all("float64 reference holds" in r["reason"] and "check: " in r["reason"] for r in rows)
    report = run_cli(["report", tmp_path / "r", "--format", "markdown"])
    assert "**INCONCLUSIVE**" in report.output and "why some could not be judged" in report.output
    issue = run_cli(["report", tmp_path / "r", "--format", "issue"])
    assert issue.output.startswith("No issue to file yet: no path was found wrong, and some could not be judged")
