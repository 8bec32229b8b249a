"""The default case sized to a CPU with slow matrix products (`core/cpu_sizing.py`, from the rate
`machine/matmul_rate.py` measures), and the heartbeat a long command prints where no terminal watches
(`render/progress.py`'s HeartbeatProgress, chosen by `cli/app.py`)."""

from __future__ import annotations

import io
import json
import math
import time

import pytest

from attn_doctor.core import cpu_sizing
from attn_doctor.core.case import make_case
from attn_doctor.core.cpu_sizing import MIN_SEQ, PRODUCT_SECONDS_BUDGET, product_seconds, size_for_cpu
from attn_doctor.machine import matmul_rate
from attn_doctor.render import progress as progress_view
from conftest import KERNELS_DIR

DEFAULT = make_case()
PROBES = 15  # the default run's probes on a CPU: local, sdpa.flash and sdpa.math on five layouts each
SLOW = 4.0  # GFLOP/s: bf16 with oneDNN held to AVX2 on the development machine
FAST = 300.0  # GFLOP/s: bf16 with AMX on the same machine
SMALL = ["--heads", "2", "--head-dim", "8", "--device", "cpu", "--backend", "sdpa.math", "--layout", "contiguous"]
SLOW_KERNEL = f"{KERNELS_DIR / 'slow.py'}:sleeps"


# --- the sizing decision ---------------------------------------------------------------------------------

def test_a_slow_rate_shrinks_the_batch_then_the_sequence_until_the_products_fit():
    sizing = size_for_cpu(DEFAULT, "cpu", set(), PROBES, SLOW)
    assert (sizing.case.batch, sizing.case.seq, sizing.case.seq_kv) == (1, 512, 512)
    assert product_seconds(sizing.case, PROBES, SLOW) <= PRODUCT_SECONDS_BUDGET
    assert product_seconds(make_case(batch=1, seq=1024), PROBES, SLOW) > PRODUCT_SECONDS_BUDGET  # the largest that fits
    assert sizing.note == ("CPU bf16 matmul at 4.0 GFLOP/s: the default case is shrunk to batch 1, seq 512 "
                           "(give --batch/--seq to choose)")


def test_only_the_sizes_change_never_the_dtype_mask_heads_or_seed():
    case = make_case(heads=8, kv_heads=2, head_dim=128, dtype="fp16", mask="no_mask", window=(64, 64), seed=7)
    sized = size_for_cpu(case, "cpu", {"heads", "kv_heads", "head_dim", "dtype", "mask", "window", "seed"},
                         PROBES, 0.5).case
    assert (sized.batch, sized.seq) != (case.batch, case.seq)
    for name in ("heads", "kv_heads", "head_dim", "dtype", "mask", "window", "seed", "inputs"):
        assert getattr(sized, name) == getattr(case, name), name


def test_the_slowest_machine_gets_the_smallest_case_and_is_told_so():
    sizing = size_for_cpu(DEFAULT, "cpu", set(), PROBES, 0.01)
    assert (sizing.case.batch, sizing.case.seq) == (1, MIN_SEQ)
    assert "seq 128, as far as it goes (give" in sizing.note


def test_a_fast_rate_keeps_the_default_case():
    assert size_for_cpu(DEFAULT, "cpu", set(), PROBES, FAST) == cpu_sizing.Sizing(DEFAULT, None)


@pytest.mark.parametrize("given", [{"seq"}, {"batch"}, {"seq_kv"}, {"batch", "seq"}])
def test_a_case_whose_lengths_the_user_gave_is_run_as_given(given):
    """--seq 8192 asks for that case, batch included: nothing of it is shrunk."""
    assert size_for_cpu(DEFAULT, "cpu", given, PROBES, SLOW) == cpu_sizing.Sizing(DEFAULT, None)


def test_a_recipe_key_counts_as_given_and_an_absent_flag_does_not(tmp_path):
    from attn_doctor.cli.options import given_case_fields

    recipe = tmp_path / "r.toml"
    recipe.write_text('description = "x"\n[case]\nseq = 256\n')
    given = given_case_fields({"recipe": str(recipe), "batch": None, "seq": None, "heads": 4})
    assert given == {"seq", "heads"}
    assert size_for_cpu(make_case(seq=256, heads=4), "cpu", given, PROBES, 0.01).case.seq == 256


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_a_gpu_run_is_never_sized(device):
    assert size_for_cpu(DEFAULT, device, set(), PROBES, 0.01).note is None


def test_lengths_per_sequence_or_an_unknown_rate_keep_the_case():
    ragged = make_case(seqlens=(1024, 900), mask="padding_causal")
    assert size_for_cpu(ragged, "cpu", {"seqlens", "mask"}, PROBES, 0.01).case == ragged
    assert size_for_cpu(DEFAULT, "cpu", set(), PROBES, None).case == DEFAULT


def test_the_cost_model_grows_with_the_scores_and_the_probes():
    base = product_seconds(make_case(batch=1, seq=256), PROBES, SLOW)
    assert math.isclose(product_seconds(make_case(batch=1, seq=512), PROBES, SLOW), 4 * base)
    assert math.isclose(product_seconds(make_case(batch=2, seq=256), PROBES, SLOW), 2 * base)
    assert math.isclose(product_seconds(make_case(batch=1, seq=256), 2 * PROBES, SLOW), 2 * base)
    assert math.isclose(product_seconds(make_case(batch=1, seq=256), PROBES, 2 * SLOW), base / 2)


# --- the rate measurement --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_the_rate_is_a_positive_finite_number_measured_in_well_under_a_second(dtype):
    import torch  # noqa: F401  (imported before the clock starts: the CLI has imported it by then)

    start = time.perf_counter()
    rate = matmul_rate.cpu_matmul_gflops(dtype)
    assert time.perf_counter() - start < 1.0
    assert rate is not None and 0 < rate < math.inf


def test_the_measurement_never_raises(monkeypatch):
    import torch

    assert matmul_rate.cpu_matmul_gflops("int4") is None

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this dtype")

    monkeypatch.setattr(torch, "bmm", broken)
    assert matmul_rate.cpu_matmul_gflops("bf16") is None


def test_the_measurement_leaves_torch_threads_as_they_were():
    import torch

    threads = torch.get_num_threads()
    matmul_rate.cpu_matmul_gflops("bf16")
    assert torch.get_num_threads() == threads


# --- the command line ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_run_says_what_it_shrank_and_records_it(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(matmul_rate, "cpu_matmul_gflops", lambda dtype="bf16": 1e-4)
    result = run_cli(["run", *SMALL, "--json", "r.json"])
    assert result.exit_code == 0, result.output
    note = f"CPU bf16 matmul at 0.0001 GFLOP/s: the default case is shrunk to batch 1, seq {MIN_SEQ}, as far as it"
    assert result.stdout.splitlines()[0].startswith(note)
    document = json.loads((tmp_path / "r.json").read_text())
    assert document["notes"][0].startswith(note)
    assert {(row["case"]["batch"], row["case"]["seq"], row["case"]["heads"]) for row in document["results"]} == {
        (1, MIN_SEQ, 2)}  # the given heads kept
    markdown = run_cli(["report", "r.json", "--format", "markdown"]).stdout
    assert f"**Note:** {note}" in markdown
    assert f"<strong>Note:</strong> {note}" in run_cli(["report", "r.json", "--format", "html"]).stdout


@pytest.mark.slow
def test_run_keeps_given_sizes_without_measuring(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def not_measured(dtype="bf16"):
        raise AssertionError("the rate is measured only when a size may shrink")

    monkeypatch.setattr(matmul_rate, "cpu_matmul_gflops", not_measured)
    result = run_cli(["run", *SMALL, "--batch", "1", "--seq", "16", "--json", "r.json"])
    assert result.exit_code == 0, result.output
    assert "shrunk" not in result.stdout
    assert "notes" not in json.loads((tmp_path / "r.json").read_text())


# --- the heartbeat ---------------------------------------------------------------------------------------

def test_the_heartbeat_counts_what_is_done_and_stops_with_the_work():
    stream = io.StringIO()
    sink = progress_view.HeartbeatProgress(stream, interval_s=0.05)
    sink.begin(40, "probes")
    sink.advance(12)
    time.sleep(0.3)
    sink.end()
    lines = stream.getvalue().splitlines()
    assert len(lines) >= 2
    assert all(line.startswith("attn-doctor: 12 of 40 probes done, ") and line.endswith(" elapsed") for line in lines)
    time.sleep(0.15)
    assert stream.getvalue().splitlines() == lines  # nothing after the end


def test_the_heartbeat_says_nothing_on_short_work():
    stream = io.StringIO()
    sink = progress_view.HeartbeatProgress(stream, interval_s=0.5)
    sink.begin(2, "probes")
    sink.advance(2)
    sink.end()
    time.sleep(0.6)
    assert stream.getvalue() == ""


@pytest.mark.parametrize("seconds, shown", [(0, "0s"), (45.9, "45s"), (90, "1m30s"), (3725, "1h02m")])
def test_elapsed_time_reads_short(seconds, shown):
    assert progress_view.duration(seconds) == shown


@pytest.mark.slow
def test_a_long_run_beats_on_stderr_not_stdout(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(progress_view, "HEARTBEAT_INTERVAL_S", 0.2)
    result = run_cli(["run", "--batch", "1", "--seq", "16", *SMALL[:-4], "--layout", "contiguous",
                      "--kernel", SLOW_KERNEL, "--json", "r.json"])
    assert result.exit_code == 0, result.output
    beats = [line for line in result.stderr.splitlines() if line.startswith("attn-doctor: ")]
    assert len(beats) >= 3, result.stderr
    assert all(" of 2 probes done, " in line for line in beats)
    assert "probes done" not in result.stdout


@pytest.mark.slow
def test_a_short_run_prints_no_heartbeat(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["run", "--batch", "1", "--seq", "16", *SMALL, "--json", "r.json"])
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
