"""Capturing a model's own attention calls (issue 17, first part): what is recorded, that recording never changes
the run, the values selection and budget, interrupted captures, flash-attn-style wrappers, the CLI and torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attn_doctor
from attn_doctor.core.errors import BadInput
from attn_doctor.tracing import store
from attn_doctor.tracing.store import load_values, read_capture
from tests.models import tiny_gpt

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "models" / "tiny_gpt.py"


def test_capture_never_changes_the_numbers_of_the_run_it_observes(tmp_path):
    plain = tiny_gpt.train(steps=2, layers=3)
    with attn_doctor.capture(tmp_path / "cap", values=True) as recorder:  # values and dout hooks: the most
        captured = tiny_gpt.train(steps=2, layers=3)
    assert recorder.calls == 6
    assert len(plain) == len(captured) and all(torch.equal(a, b) for a, b in zip(plain, captured))


def test_every_call_is_recorded_with_its_exact_views_module_layer_and_step(tmp_path):
    with attn_doctor.capture(tmp_path):
        tiny_gpt.train(steps=2, layers=3)
    calls = read_capture(tmp_path)
    assert [(c.meta["step"], c.meta["layer"], c.meta["module"]) for c in calls] == [
        (step, layer, f"layers.{layer}.attention") for step in (0, 1) for layer in range(3)]
    b, s, h, d = tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.HEADS, tiny_gpt.HIDDEN // tiny_gpt.HEADS
    tensors = calls[0].meta["tensors"]
    for position, name in enumerate("qkv"):  # head-sliced views of one [b, s, 3, h, d] buffer, as bhsd
        assert tensors[name]["shape"] == [b, h, s, d]
        assert tensors[name]["stride"] == [s * 3 * h * d, d, 3 * h * d, 1]
        assert tensors[name]["storage_offset"] == position * h * d
        assert tensors[name]["storage"] == tensors["q"]["storage"]  # one storage, one id
    assert tensors["q"]["storage"]["nbytes"] == b * s * 3 * h * d * 4
    assert tensors["out"]["storage"]["id"] != tensors["q"]["storage"]["id"]
    assert calls[0].meta["api"] == "torch.sdpa" and calls[0].meta["arguments"]["is_causal"] is True
    assert (calls[0].meta["rank"], calls[0].meta["world_size"]) == (0, 1)
    assert json.loads((tmp_path / "rank0" / "env.json").read_text())["python"]


class _Attention(torch.nn.Module):
    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x)


class _WrittenSoFar(torch.nn.Module):
    """Counts the calls in the capture's files when the model's forward pass reaches it (at its end)."""

    def __init__(self, root: Path, seen: list[int]):
        super().__init__()
        self.root, self.seen, self.fail = root, seen, False

    def forward(self, x):
        self.seen.append(len(read_capture(self.root)))
        if self.fail:
            raise RuntimeError("a forward pass that raises")
        return x


def test_a_forward_pass_under_autograd_has_its_calls_written_when_it_ends_and_otherwise_at_each_call(tmp_path):
    seen: list[int] = []
    probe = _WrittenSoFar(tmp_path, seen)
    model = torch.nn.Sequential(_Attention(), _Attention(), probe)
    x = torch.randn(1, 2, 4, 8, requires_grad=True)
    with attn_doctor.capture(tmp_path):
        model(x).sum().backward()  # the first pass makes the model known: its calls are written as they come
        model(x).sum().backward()  # autograd holds q, k, v until the backward: described at the pass's end
        assert len(read_capture(tmp_path)) == 4
        with torch.no_grad():  # nothing held by autograd: holding them would cost memory
            model(x)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):  # e.g. checkpointing
            model(x).sum().backward()
        probe.fail = True
        with pytest.raises(RuntimeError, match="raises"):
            model(x).sum().backward()
        assert len(read_capture(tmp_path)) == 10  # a pass that raises keeps its calls
    assert seen == [2, 2, 6, 8, 8]


def test_the_output_gradients_geometry_is_recorded_as_the_backward_gave_it(tmp_path, capfd):
    """dO is the model's: the gradient of `sdpa(...).transpose(1, 2).reshape(...)` reaches SDPA as a bhsd view of
    a bshd buffer. It is written once per call site (module path and signature), at its first backward, and read
    back for every call of the site. A forward without gradients has none; a backward run after the capture
    ended writes nothing (and says nothing); a process capturing twice into one folder numbers its calls (and
    signatures) from 0 again, and each gradient goes to its own capture's calls."""
    with attn_doctor.capture(tmp_path):
        tiny_gpt.train(steps=2, layers=3)
    model = torch.nn.Sequential(tiny_gpt.Block(1, 0, torch.Generator().manual_seed(0)))
    x = torch.randn(tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.HIDDEN)
    with attn_doctor.capture(tmp_path):
        with torch.no_grad():
            model(x)
        after = model(x)
    after.square().mean().backward()  # the capture has ended
    calls = read_capture(tmp_path)
    b, s, h, d = tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.HEADS, tiny_gpt.HIDDEN // tiny_gpt.HEADS
    trained = [c for c in calls if c.meta["module"].startswith("layers.")]
    assert len(trained) == 6 and all(c.meta["tensors"]["dout"] == {
        "shape": [b, h, s, d], "stride": [s * h * d, d, h * d, 1], "storage_offset": 0, "dtype": "float32",
        "device": "cpu", "storage": {"id": 0, "nbytes": b * s * h * d * 4}, "requires_grad": False}
        for c in trained)
    assert [("dout" in c.meta["tensors"]) for c in calls if c not in trained] == [False, False]
    lines = (tmp_path / "rank0" / f"calls-{os.getpid()}.jsonl").read_text().splitlines()
    assert sum('"gradient_geometry"' in line for line in lines) == 1  # one geometry, written once
    assert sum('"gradient_of"' in line for line in lines) == 3  # once per call site: step 1's calls set no hook
    assert "attn-doctor" not in capfd.readouterr().err


def test_a_sites_output_gradient_is_not_read_into_a_later_captures_calls_of_the_same_site(tmp_path):
    """A second capture into the same folder by the same process numbers its signatures from 0 again: the call
    site ("0.attention", signature 0) of the first (trained) is not the second's (a forward without gradients)."""
    model = torch.nn.Sequential(tiny_gpt.Block(1, 0, torch.Generator().manual_seed(0)))
    x = torch.randn(tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.HIDDEN)
    with attn_doctor.capture(tmp_path):
        for _ in range(2):
            model(x).square().mean().backward()
    with attn_doctor.capture(tmp_path), torch.no_grad():
        model(x)
    calls = read_capture(tmp_path)
    assert [(c.meta["module"], "dout" in c.meta["tensors"]) for c in calls] == [("0.attention", True)] * 2 + [
        ("0.attention", False)]


def test_values_are_recorded_for_the_selection_only_with_the_output_gradient(tmp_path):
    with attn_doctor.capture(tmp_path, values=True, layers=[1], steps=[1]):
        tiny_gpt.train(steps=2, layers=3)
    calls = read_capture(tmp_path)
    chosen = [c for c in calls if c.values_path is not None]
    assert [(c.meta["step"], c.meta["layer"]) for c in chosen] == [(1, 1)]
    assert all(c.meta["values"] is None for c in calls if c not in chosen)
    values, dout = load_values(chosen[0].values_path), load_values(chosen[0].dout_path)["dout"]
    meta = chosen[0].meta["tensors"]
    assert all(list(values[n].shape) == meta[n]["shape"] for n in ("q", "k", "v", "out"))
    assert torch.equal(F.scaled_dot_product_attention(values["q"], values["k"], values["v"], is_causal=True),
                       values["out"])  # the values are the call's own
    assert dout.shape == values["out"].shape and dout.abs().sum() > 0


def test_a_call_whose_q_k_and_v_are_one_tensor_is_recorded_with_its_values(tmp_path):
    """`sdpa(q, q, q)` on the CPU: the values file must hold q, k and v each (safetensors refuses one memory
    under several names, and the call was lost, metadata and all)."""
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    with attn_doctor.capture(tmp_path, values=True):
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    (call,) = read_capture(tmp_path)
    values = load_values(call.values_path)
    assert all(torch.equal(values[name], q.detach()) for name in "qkv")
    assert call.meta["tensors"]["q"]["storage"] == call.meta["tensors"]["k"]["storage"]


def test_values_over_the_budget_keep_their_metadata_and_say_why(tmp_path):
    with attn_doctor.capture(tmp_path, values=True, max_bytes=70_000):
        tiny_gpt.train(steps=1, layers=3)
    calls = read_capture(tmp_path)
    assert calls[0].values_path is not None
    assert all(c.values_path is None and "--max-bytes" in c.meta["values"] for c in calls[1:])


def test_a_gradient_that_cannot_be_saved_is_said_and_the_backward_goes_on(tmp_path, monkeypatch, capfd):
    save = store.save_values

    def save_forward_only(path, tensors):
        if any(name.startswith("d") for name in tensors):  # dout, dq, dk, dv: the disk is full by then
            raise OSError("No space left on device")
        return save(path, tensors)

    monkeypatch.setattr(store, "save_values", save_forward_only)
    with attn_doctor.capture(tmp_path, values=True):
        tiny_gpt.train(steps=1, layers=2)  # its backward must complete
    assert "a gradient not recorded (OSError: No space left on device)" in capfd.readouterr().err
    calls = read_capture(tmp_path)
    assert len(calls) == 2 and all(c.values_path is not None and c.dout_path is None for c in calls)


def test_an_output_gradient_whose_geometry_cannot_be_written_is_said_and_the_backward_goes_on(tmp_path,
                                                                                               monkeypatch, capfd):
    def refuse(self, index, gradient):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("attn_doctor.tracing.describe.CallDescriber.gradient_lines", refuse)
    plain = tiny_gpt.train(steps=1, layers=2)
    with attn_doctor.capture(tmp_path):
        captured = tiny_gpt.train(steps=1, layers=2)
    assert all(torch.equal(a, b) for a, b in zip(plain, captured))
    assert capfd.readouterr().err.count("output gradient not recorded (OSError") == 2
    assert not any("dout" in c.meta["tensors"] for c in read_capture(tmp_path))


def test_a_killed_run_leaves_a_readable_capture_of_the_calls_that_finished(tmp_path):
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import attn_doctor
        from tests.models import tiny_gpt
        with attn_doctor.capture({str(tmp_path)!r}, values=True):
            model = tiny_gpt.TinyGPT(layers=3)
            tokens = __import__("torch").zeros(2, 8, dtype=__import__("torch").long)
            model.layers[0](model.embed[tokens])
            model.layers[1](model.embed[tokens])
            os._exit(3)  # killed: no clean-up runs
    """)
    assert subprocess.run([sys.executable, "-c", script]).returncode == 3
    calls = read_capture(tmp_path)
    assert [c.index for c in calls] == [0, 1] and all(load_values(c.values_path) for c in calls)
    (log,) = (tmp_path / "rank0").glob("calls-*.jsonl")
    with open(log, "ab") as handle:  # a line cut off mid-write
        handle.write(b'{"api": "torch.sd')
    assert [c.index for c in read_capture(tmp_path)] == [0, 1]
    whole_lines = log.read_bytes().rpartition(b"\n")[0]  # then a call naming a signature no line defines
    log.write_bytes(whole_lines + b'\n{"index":2,"module":"","layer":0,"step":0,"values":null,"signature":7}\n')
    with pytest.raises(BadInput, match="the capture is damaged"):
        read_capture(tmp_path)


def test_the_calls_file_grows_past_its_chunks_and_ends_at_its_last_line_once_closed(tmp_path, monkeypatch):
    monkeypatch.setattr(store.CallLog, "CHUNK", 256)  # a signature is longer than a chunk: it grows the map
    for seq in (4, 6):  # a second capture of this process into the same folder appends to its calls file
        q = torch.randn(1, 2, seq, 8)
        with attn_doctor.capture(tmp_path):
            for _ in range(200):
                F.scaled_dot_product_attention(q, q, q)
    (log,) = (tmp_path / "rank0").glob("calls-*.jsonl")
    text = log.read_bytes()
    assert text.endswith(b"}\n") and b"\0" not in text and len(text) > 40 * 256
    calls = read_capture(tmp_path)
    assert [c.index for c in calls] == [*range(200)] * 2  # by capture, then index
    # each capture's signature 0 is its own: a call names the latest signature of its number above it
    assert [c.meta["tensors"]["q"]["shape"][2] for c in calls] == [4] * 200 + [6] * 200


def test_a_line_that_could_not_be_written_leaves_the_calls_after_it_readable(tmp_path, monkeypatch, capfd):
    """A signature numbered but never written (the disk full at that moment) must not be named by later calls:
    a call naming a signature no line defines makes the whole capture unreadable."""
    append, failures = store.CallLog.append, []

    def append_or_fail(self, line: str) -> None:
        if '"signature"' in line and '"api"' in line and not failures:
            failures.append(line)
            raise OSError("No space left on device")
        append(self, line)

    monkeypatch.setattr(store.CallLog, "append", append_or_fail)
    q = torch.randn(1, 2, 4, 8)
    with attn_doctor.capture(tmp_path):
        for _ in range(3):
            F.scaled_dot_product_attention(q, q, q)
    assert failures and "call not recorded (OSError: No space left on device)" in capfd.readouterr().err
    assert [c.index for c in read_capture(tmp_path)] == [1, 2]  # the first call is lost, not the capture


def test_where_a_file_cannot_be_mapped_each_line_is_written(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("no shared maps here")

    monkeypatch.setattr(store.mmap, "mmap", refuse)
    q = torch.randn(1, 2, 4, 8)
    with attn_doctor.capture(tmp_path):
        F.scaled_dot_product_attention(q, q, q)
        F.scaled_dot_product_attention(q, q, q)
    assert [c.index for c in read_capture(tmp_path)] == [0, 1]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_process_forked_during_a_capture_records_into_a_file_of_its_own(tmp_path):
    # In a process of its own with one thread: a child forked after OpenMP ran in the parent hangs in its first
    # parallel region (GNU OpenMP), whatever the capture does.
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(ROOT)!r})
        import torch
        torch.set_num_threads(1)
        import attn_doctor
        q = torch.randn(1, 2, 4, 8)
        with attn_doctor.capture({str(tmp_path)!r}):
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
            child = os.fork()
            if child == 0:  # a data loader's worker would be one: a call, then gone without clean-up
                try:
                    torch.nn.functional.scaled_dot_product_attention(q, q, q)
                finally:
                    os._exit(0)
            os.waitpid(child, 0)
            torch.nn.functional.scaled_dot_product_attention(q, q, q)
        print(os.getpid(), child)
    """)
    parent, child = map(int, subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                            check=True, timeout=120).stdout.split())
    calls = read_capture(tmp_path)
    by_process = {pid: [c.index for c in calls if c.meta["process"]["pid"] == pid] for pid in (parent, child)}
    assert by_process == {parent: [0, 1], child: [1]} and len(calls) == 3
    assert {p.name for p in (tmp_path / "rank0").glob("calls-*.jsonl")} == {
        f"calls-{parent}.jsonl", f"calls-{child}.jsonl"}


def test_megatrons_parallel_layout_is_recorded_and_read_once_per_forward_pass(tmp_path, monkeypatch):
    reads = []

    def reader(name: str, value):
        def read():
            reads.append(name)
            return layout[value]
        return read

    layout = {"tp": 2, "tp_rank": 1, "cp": 1, "cp_rank": 0, "dp": 4, "dp_rank": 3}
    state = types.ModuleType("megatron.core.parallel_state")
    state.model_parallel_is_initialized = lambda: True
    for name, value in (("get_tensor_model_parallel_world_size", "tp"), ("get_tensor_model_parallel_rank", "tp_rank"),
                        ("get_context_parallel_world_size", "cp"), ("get_context_parallel_rank", "cp_rank"),
                        ("get_data_parallel_world_size", "dp"), ("get_data_parallel_rank", "dp_rank")):
        setattr(state, name, reader(name, value))
    monkeypatch.setitem(sys.modules, "megatron.core.parallel_state", state)
    first = {**layout}
    with attn_doctor.capture(tmp_path):
        model, tokens = tiny_gpt.TinyGPT(layers=3), torch.zeros(1, 4, dtype=torch.long)
        model(tokens)
        layout["tp_rank"] = 0  # re-initialised (as a test suite does): seen from the next forward pass on
        model(tokens)
        assert len(reads) == 6 * 2  # each of the six read once per forward pass of the model, not per call
        layout["dp_rank"] = 2
        tiny_gpt.TinyGPT(layers=3)(tokens)  # another model: its calls read the layout each
    parallel = [c.meta["parallel"] for c in read_capture(tmp_path)]
    assert parallel == [first] * 3 + [{**first, "tp_rank": 0}] * 3 + [layout] * 3


def test_a_library_wrapper_is_recorded_once_whether_imported_before_or_after_the_capture(tmp_path, monkeypatch):
    package = tmp_path / "pkgs" / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent("""
        import torch.nn.functional as F

        def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=causal, scale=softmax_scale)
            return out.transpose(1, 2)
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    saved = sys.modules.pop("flash_attn", None)  # this test's stand-in must not outlive it
    q = torch.randn(1, 8, 2, 4)
    try:
        for when in ("after", "before"):
            if when == "before":
                import flash_attn  # noqa: F401 - imported before the capture starts
            with attn_doctor.capture(tmp_path / when):
                import flash_attn

                flash_attn.flash_attn_func(q, q, q, causal=True)
            (call,) = read_capture(tmp_path / when)
            assert call.meta["api"] == "flash_attn.flash_attn_func" and call.meta["arguments"]["causal"] is True
            del sys.modules["flash_attn"]
        assert not hasattr(flash_attn.flash_attn_func, "_attn_doctor_original")  # unwrapped after the block
    finally:
        sys.modules.pop("flash_attn", None)
        if saved is not None:
            sys.modules["flash_attn"] = saved


def test_cli_captures_a_script_unchanged(run_cli, tmp_path):
    result = run_cli(["capture", "--out", tmp_path / "cap", "--values", "--layers", "0", "--", sys.executable,
                      MODEL, "--steps", "1", "--layers", "2"])
    assert result.exit_code == 0, result.output
    assert "2 attention calls recorded" in result.output and "1 with values" in result.output
    assert len(read_capture(tmp_path / "cap")) == 2


@pytest.mark.parametrize("args, says", [
    ([], "no command"),
    (["--", "no-such-program-xyz"], "not a program"),
    (["--layers", "0", "--", sys.executable, "-c", "pass"], "add --values"),
    (["--values", "--max-bytes", "lots", "--", sys.executable, "-c", "pass"], "--max-bytes"),
    (["--", sys.executable, "-c", "print('no attention here')"], "made no attention call"),
])
def test_cli_refuses_what_it_cannot_capture(run_cli, tmp_path, args, says):
    result = run_cli(["capture", "--out", tmp_path / "cap", *args])
    assert result.exit_code == 2 and says in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_refuses_to_mix_two_runs_in_one_capture(run_cli, tmp_path):
    with attn_doctor.capture(tmp_path / "cap"):
        tiny_gpt.train(steps=1, layers=1)
    result = run_cli(["capture", "--out", tmp_path / "cap", "--", sys.executable, "-c", "pass"])
    assert result.exit_code == 2 and "already holds a capture" in result.stderr


def test_cli_a_failing_command_exits_1_and_keeps_what_it_recorded(run_cli, tmp_path):
    script = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from tests.models import tiny_gpt; " \
             "tiny_gpt.train(steps=1, layers=2); sys.exit(5)"
    result = run_cli(["capture", "--out", tmp_path / "cap", "--", sys.executable, "-c", script])
    assert result.exit_code == 1 and "exited with 5" in result.stderr and "2 attention calls" in result.stderr


@pytest.mark.torchrun
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not installed")
def test_cli_captures_every_rank_of_a_torchrun_job_with_its_parallel_layout(run_cli, tmp_path):
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    result = run_cli(["capture", "--out", tmp_path / "cap", "--values", "--ranks", "1", "--", torchrun,
                      "--nproc-per-node", "2", MODEL, "--tp", "2", "--steps", "1", "--layers", "2"])
    assert result.exit_code == 0, result.output
    calls = read_capture(tmp_path / "cap")
    assert sorted((c.rank, c.meta["layer"]) for c in calls) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(c.meta["parallel"] == {"tp": 2, "tp_rank": c.rank} and c.meta["world_size"] == 2 for c in calls)
    assert all((c.values_path is not None) == (c.rank == 1) for c in calls)
    assert all(c.meta["tensors"]["q"]["shape"][1] == tiny_gpt.HEADS // 2 for c in calls)  # this rank's heads


def test_capture_folder_that_is_not_one_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="not an attn-doctor capture"):
        read_capture(tmp_path)
