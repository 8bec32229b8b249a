"""`attn-doctor run` and `attn-doctor report` through click's CliRunner (worker processes are real).

Every test runs in its own temporary working directory: `run` writes attn-doctor-results/<run-id>/results.json there.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from attn_doctor.verdict.rule import CORE_TENSORS as TENSORS
from cli_checks import one_line_error

TENSOR_KEYS = {"rel_err", "max_abs_err", "cosine", "baseline_rel_err", "ratio", "verdict"}
ROW_KEYS = {"backend", "layout", "ran", "verdict", "reason", "case", "tensors"}
PASSING_LAYOUTS = ["contiguous", "transposed"]




@pytest.fixture(scope="module")
def passing_run(tmp_path_factory, run_cli, small_flags):
    """One default `run` (every built-in backend) on two layouts: the result, the JSON path and the document."""
    workdir = tmp_path_factory.mktemp("passing")
    json_path = workdir / "out" / "results.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        args = [*small_flags, "--json", json_path]
        for layout in PASSING_LAYOUTS:
            args += ["--layout", layout]
        result = run_cli(["run", *args])
    return result, json_path, json.loads(json_path.read_text())


# --- a passing run ----------------------------------------------------------------------------------------

def _table_verdicts(stdout: str, backends) -> dict[tuple[str, str], str]:
    """(backend, layout) -> verdict, read from the table rows rich printed (the last word of each row)."""
    found = {}
    for line in stdout.splitlines():
        words = [w for w in line.replace("│", " ").replace("┃", " ").split()]
        if len(words) >= 3 and words[0] in backends:
            found[(words[0], words[1])] = words[-1]
    return found


@pytest.mark.slow
def test_run_exit_0_prints_env_table_and_summary(passing_run):
    result, json_path, doc = passing_run
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Environment" in out and torch.__version__ in out
    assert "b2 s64 h4 d16 bf16 causal on cpu" in out
    for header in ("backend", "layout", "ran", "out err", "dQ err", "dK err", "dV err", "verdict"):
        assert header in out, header
    backends = {r["backend"] for r in doc["results"]}
    table = _table_verdicts(out, backends)
    for row in doc["results"]:
        layout = row["layout"] if (row["backend"], row["layout"]) in table else "all"
        assert table[(row["backend"], layout)] == row["verdict"], row["backend"]
    assert {v for v in table.values()} == {"PASS", "SKIP"}
    assert "TE attention needs a CUDA GPU" in out  # the reason of the TE SKIP rows is shown
    tested = sum(r["verdict"] != "SKIP" for r in doc["results"])
    assert tested == 3 * len(PASSING_LAYOUTS)  # local, sdpa.math, sdpa.flash
    assert f"All {tested} tested paths agree with float64" in out
    assert doc["summary"] in " ".join(out.split())
    assert str(json_path) in out


def test_run_json_document_shape(passing_run):
    _, json_path, doc = passing_run
    assert {"env", "results", "faulty"} <= set(doc)
    assert doc["faulty"] == []
    assert doc["env"]["torch"]["value"] == torch.__version__
    assert doc["results"], "no rows"
    for row in doc["results"]:
        assert ROW_KEYS <= set(row), row.keys()
        assert row["case"]["batch"] == 2 and row["case"]["seq"] == 64 and row["case"]["dtype"] == "bf16"
        if row["verdict"] == "PASS":
            assert set(row["tensors"]) == set(TENSORS)
            for name, t in row["tensors"].items():
                assert TENSOR_KEYS <= set(t), (name, t.keys())
                assert t["verdict"] == "PASS"
                assert 0 < t["rel_err"] < 0.05 and 0.99 < t["cosine"] <= 1.0 + 1e-12
                # the ratio is to the yardstick: the baseline's error, or rounding noise where that is larger
                assert t["ratio"] == pytest.approx(t["scaled_err"] / t["yardstick"])
                if t["yardstick_kind"] == "baseline":
                    assert t["ratio"] == pytest.approx(t["rel_err"] / t["baseline_rel_err"])
        else:
            assert row["verdict"] == "SKIP" and row["tensors"] == {} and row["reason"], row
    assert not list(json_path.parent.glob("*.tmp"))  # the atomic write left no temp file


def test_run_json_rows_cover_backends_and_layouts(passing_run):
    _, _, doc = passing_run
    rows = {(r["backend"], r["layout"]): r for r in doc["results"]}
    for backend in ("sdpa.math", "sdpa.flash", "local"):
        for layout in PASSING_LAYOUTS:
            assert rows[(backend, layout)]["verdict"] == "PASS", (backend, layout)
    assert "flash" in rows[("sdpa.flash", "contiguous")]["ran"].lower()
    baseline = rows[("local", "contiguous")]
    assert all(t["ratio"] == 1.0 if t["yardstick_kind"] == "baseline" else t["ratio"] < 1.0
               for t in baseline["tensors"].values())
    assert {r["layout"] for r in doc["results"]} == set(PASSING_LAYOUTS)


def test_te_rows_skip_on_cpu_with_a_reason(passing_run):
    _, _, doc = passing_run
    te_rows = [r for r in doc["results"] if r["backend"].startswith("te.")]
    assert {r["backend"] for r in te_rows} >= {"te.flash", "te.fused", "te.unfused"}
    for row in te_rows:
        assert row["verdict"] == "SKIP", row
        assert "CUDA" in row["reason"] or "not installed" in row["reason"], row["reason"]
    for row in doc["results"]:
        if row["backend"] in ("sdpa.efficient", "sdpa.cudnn"):
            assert row["verdict"] == "SKIP" and "CPU" in row["reason"]


# --- faulty, crashing and hanging kernels -----------------------------------------------------------------

@pytest.mark.slow
def test_faulty_kernel_exit_1_and_default_json_location(tmp_path, monkeypatch, run_cli, small_flags, faulty_path):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["run", *small_flags, "--kernel", f"{faulty_path}:dq_two_percent",
                      "--kernel", f"good={faulty_path}:correct_fp32", "--layout", "contiguous"])
    assert result.exit_code == 1, result.output
    (written,) = tmp_path.glob("attn-doctor-results/*/results.json")
    doc = json.loads(written.read_text())
    rows = {r["backend"]: r for r in doc["results"]}
    table = _table_verdicts(result.stdout, set(rows))
    assert table == {("local", "contiguous"): "PASS", ("dq_two_percent", "contiguous"): "FAIL",
                     ("good", "contiguous"): "PASS"}
    summary = " ".join(result.stdout.split())  # rich wraps the long sentence
    assert doc["summary"].startswith("Faulty: dq_two_percent ") and "good" not in doc["summary"]
    assert "wrong dq " in doc["summary"] and doc["summary"] in summary
    assert set(rows) == {"local", "dq_two_percent", "good"}  # only the --kernel ones and the baseline
    assert rows["good"]["verdict"] == "PASS"
    assert rows["dq_two_percent"]["verdict"] == "FAIL"
    assert {n: t["verdict"] for n, t in rows["dq_two_percent"]["tensors"].items()} == {
        "out": "PASS", "dq": "FAIL", "dk": "PASS", "dv": "PASS"}
    assert [(f["backend"], f["tensors"]) for f in doc["faulty"]] == [("dq_two_percent", ["dq"])]


@pytest.mark.slow
def test_kernel_given_as_module_is_named_with_its_target(tmp_path, monkeypatch, run_cli, small_flags,
                                                         faulty_path):
    """TARGET as an importable module; the summary names what ran ([module:func]) next to the row name."""
    monkeypatch.chdir(tmp_path)
    kernels_dir = str(faulty_path.parent)
    monkeypatch.syspath_prepend(kernels_dir)  # the CLI checks the target here...
    monkeypatch.setenv("PYTHONPATH", kernels_dir)  # ...and the worker imports it there
    result = run_cli(["run", *small_flags, "--layout", "head_slice", "--json", "r.json",
                      "--kernel", "shifted=faulty:causal_shift_backward"])
    assert result.exit_code == 1, result.output
    doc = json.loads((tmp_path / "r.json").read_text())
    (row,) = [r for r in doc["results"] if r["backend"] == "shifted"]
    assert row["ran"] == "faulty:causal_shift_backward" and row["verdict"] == "FAIL"
    assert row["tensors"]["out"]["verdict"] == "PASS"
    summary = " ".join(result.stdout.split())
    assert "shifted [faulty:causal_shift_backward] computes wrong dq, dk, dv" in summary
    assert doc["summary"] in summary


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory, run_cli, small_flags, broken_path, faulty_path):
    """Kernels that abort, _exit and hang, then a correct one, all in the same (restarted) kernel worker."""
    workdir = tmp_path_factory.mktemp("broken")
    json_path = workdir / "r.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        result = run_cli(["run", *small_flags, "--layout", "contiguous", "--timeout", "3", "--json", json_path,
                          "--kernel", f"{broken_path}:aborts", "--kernel", f"{broken_path}:exits",
                          "--kernel", f"{broken_path}:hangs", "--kernel", f"after={faulty_path}:correct_fp32"])
    return result, {r["backend"]: r for r in json.loads(json_path.read_text())["results"]}


@pytest.mark.slow
def test_crashing_and_hanging_kernels_become_error_rows(broken_run):
    result, rows = broken_run
    assert result.exit_code == 1, result.output
    for name in ("aborts", "exits"):
        assert rows[name]["verdict"] == "ERROR", rows[name]
        assert rows[name]["reason"].startswith("worker kernel"), rows[name]["reason"]
        assert rows[name]["tensors"] == {}
    assert rows["hangs"]["verdict"] == "ERROR" and "--timeout 3" in rows["hangs"]["reason"]
    # The rows after them still ran, in a fresh worker, and the baseline was unaffected.
    assert rows["after"]["verdict"] == "PASS" and set(rows["after"]["tensors"]) == set(TENSORS)
    assert rows["local"]["verdict"] == "PASS"
    summary = " ".join(result.stdout.split())  # rich may wrap the sentence
    for name in ("aborts", "exits", "hangs"):
        assert f"{name} crashed or hung on layout contiguous" in summary, name
    assert "after crashed" not in summary
    assert "Traceback" not in result.stdout


def test_crash_reason_says_how_the_worker_died(broken_run):
    _, rows = broken_run
    assert "SIGABRT" in rows["aborts"]["reason"]
    assert "exit code 9" in rows["exits"]["reason"]


# --- recipes ------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_recipe_is_loaded_and_flags_override_it(tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "tiny.toml"
    recipe.write_text(
        'description = "tiny GQA"\n[case]\nbatch = 1\nseq = 64\nheads = 4\nkv_heads = 2\nhead_dim = 16\n'
        'dtype = "fp16"\nmask = "none"\nseed = 7\n'
    )
    json_path = tmp_path / "r.json"
    result = run_cli(["run", "--recipe", recipe, "--seq", "32", "--device", "cpu", "--backend", "local",
                      "--layout", "contiguous", "--layout", "head_slice", "--json", json_path])
    assert result.exit_code == 0, result.output
    doc = json.loads(json_path.read_text())
    assert {r["layout"] for r in doc["results"]} == {"contiguous", "head_slice"}
    for row in doc["results"]:
        assert row["verdict"] == "PASS"
        assert row["case"] == {"batch": 1, "seq": 32, "heads": 4, "head_dim": 16, "kv_heads": 2, "seq_kv": 32,
                               "dtype": "fp16", "mask": "no_mask", "window": None, "seed": 7}
    assert "b1 s32 h4 kv2 d16 fp16 no_mask" in result.stdout


# --- bad input: exit 2, one line, nothing run ---------------------------------------------------------------

BAD_RUNS = [
    pytest.param(["--heads", "6", "--kv-heads", "4"], "divisible by kv-heads", id="heads-not-divisible"),
    pytest.param(["--dtype", "fp64"], "fp64", id="unknown-dtype"),
    pytest.param(["--batch", "0"], "batch must be at least 1", id="zero-batch"),
    pytest.param(["--seq", "0"], "seq must be at least 1", id="zero-seq"),
    pytest.param(["--head-dim", "0"], "head_dim must be at least 1", id="zero-head-dim"),
    pytest.param(["--kv-heads", "0"], "kv_heads must be at least 1", id="zero-kv-heads"),
    pytest.param(["--backend", "sdpa.bogus"], "unknown backend 'sdpa.bogus'", id="unknown-backend"),
    pytest.param(["--layout", "diagonal"], "diagonal", id="unknown-layout"),
    pytest.param(["--kernel", "no_such_file.py:attn"], "no file no_such_file.py", id="kernel-missing-file"),
    pytest.param(["--kernel", "no_such_module_xyz:attn"], "no module 'no_such_module_xyz'", id="kernel-missing-module"),
    pytest.param(["--kernel", "{faulty}:no_such_function"], "defines no top-level 'no_such_function'",
                 id="kernel-missing-function"),
    pytest.param(["--kernel", "{faulty}"], "expected [NAME=]TARGET:FUNC", id="kernel-no-function"),
    pytest.param(["--recipe", "no-such-recipe"], "no recipe 'no-such-recipe'", id="unknown-recipe"),
    pytest.param(["--window", "8"], "LEFT,RIGHT", id="bad-window"),
]


@pytest.mark.parametrize("args, message", BAD_RUNS)
def test_bad_run_input_exits_2_with_one_line(args, message, tmp_path, monkeypatch, run_cli, faulty_path):
    monkeypatch.chdir(tmp_path)
    args = [a.replace("{faulty}", str(faulty_path)) for a in args]
    line = one_line_error(run_cli(["run", "--device", "cpu", *args]))
    assert message in line
    assert not (tmp_path / "attn-doctor-results").exists()


BAD_RECIPES = [
    pytest.param('[case]\nbatch = 2\nseq = = 64\n', "not valid TOML", id="invalid-toml"),
    pytest.param('[case]\nbatch = 2\nsequence = 64\n', "unknown case field(s) sequence", id="unknown-field"),
    pytest.param('[case]\ndtype = "fp64"\n', "unknown dtype 'fp64'", id="unknown-dtype"),
    pytest.param('[case]\nheads = 6\nkv_heads = 4\n', "divisible", id="heads-not-divisible"),
    pytest.param('case = 3\n', "must be tables", id="case-not-a-table"),
]


@pytest.mark.parametrize("text, message", BAD_RECIPES)
def test_broken_recipe_exits_2_with_one_line(text, message, tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    recipe = tmp_path / "broken.toml"
    recipe.write_text(text)
    line = one_line_error(run_cli(["run", "--device", "cpu", "--recipe", recipe]))
    assert message in line
    assert not (tmp_path / "attn-doctor-results").exists()


def test_bad_input_in_a_real_process_prints_no_traceback(tmp_path):
    """The console entry point, not CliRunner: what a user's terminal shows."""
    proc = subprocess.run([sys.executable, "-m", "attn_doctor", "run", "--heads", "6", "--kv-heads", "4"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "divisible" in proc.stderr


# --- report -------------------------------------------------------------------------------------------------

def test_report_renders_markdown(passing_run, run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, json_path, doc = passing_run
    result = run_cli(["report", json_path])
    assert result.exit_code == 0, result.output
    md = result.stdout
    assert md.startswith("## attn-doctor report")
    assert f"**Verdict:** {doc['summary']}" in md
    assert "### Environment" in md and torch.__version__ in md
    assert "| backend |" in md and "| --- |" in md
    for backend in ("sdpa.math", "sdpa.flash", "local", "te.fused"):
        assert f"| {backend} |" in md, backend
    assert "Why each failing row failed" not in md


def test_report_output_file_and_newest_default(passing_run, run_cli, tmp_path, monkeypatch):
    _, json_path, _ = passing_run
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "attn-doctor-results" / "run-1"
    run_dir.mkdir(parents=True)
    (run_dir / "results.json").write_text(json_path.read_text())
    result = run_cli(["report", "--output", "r.md"])  # no argument: the newest run under attn-doctor-results/
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.md").read_text().startswith("## attn-doctor report")
    assert run_cli(["report", run_dir]).stdout.startswith("## attn-doctor report")  # a run folder works too


def test_report_lists_failing_rows(tmp_path, monkeypatch, run_cli, passing_run):
    """A FAIL row edited into a real document is listed before the PASS rows, bold, with its reason."""
    monkeypatch.chdir(tmp_path)
    doc = json.loads(passing_run[1].read_text())
    row = next(r for r in doc["results"] if r["backend"] == "sdpa.math")
    row["verdict"], row["reason"] = "FAIL", "dq: error 0.02 > 3 x baseline 0.004"
    row["tensors"]["dq"]["verdict"] = "FAIL"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    result = run_cli(["report", path])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    first_fail = next(i for i, line in enumerate(lines) if "**FAIL**" in line)
    first_pass = next(i for i, line in enumerate(lines) if line.startswith("|") and "| PASS |" in line)
    assert first_fail < first_pass
    assert "<summary>Why each failing row failed</summary>" in result.stdout
    assert "dq: error 0.02 > 3 x baseline 0.004" in result.stdout


def _truncated(passing_run) -> str:
    text = passing_run[1].read_text()
    return text[: len(text) // 2]


BAD_REPORTS = [
    pytest.param(None, "no results file", id="missing"),
    pytest.param(_truncated, "not valid JSON", id="truncated"),
    pytest.param('{"hello": "world"}', "not an attn-doctor results document", id="foreign-object"),
    pytest.param("[1, 2, 3]", "not an attn-doctor results document", id="foreign-list"),
    pytest.param('{"format": "attn-doctor/results", "results": [{"backend": "x"}]}', "field results[0].layout is missing",
                 id="damaged"),
    pytest.param(b"\xff\xfe\x00garbage", "cannot read", id="not-utf8"),
]


@pytest.mark.parametrize("content, message", BAD_REPORTS)
def test_report_bad_file_exits_2(content, message, passing_run, tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "results.json"
    if callable(content):
        content = content(passing_run)
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    line = one_line_error(run_cli(["report", path]))
    assert message in line


def test_report_without_any_run_exits_2(tmp_path, monkeypatch, run_cli):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(run_cli(["report"]))
    assert "no results under attn-doctor-results/" in line


@pytest.mark.slow
def test_run_on_deep_layer_inputs_passes_a_flash_kernel_and_says_why(run_cli, tmp_path):
    """`run --inputs deep-layer`: PyTorch's flash kernel's dQ is several times the baseline's error, yet right; the
    run exits 0 and the line under the table says the yardstick was a flash-style backward's own rounding."""
    result = run_cli(["run", "--backend", "sdpa", "--inputs", "deep-layer", "--batch", "2", "--seq", "512",
                      "--heads", "4", "--layout", "contiguous", "--device", "cpu", "--json", tmp_path / "r.json"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "flash-style sdpa.flash (contiguous) dq " in text
    assert "within what a correct flash-style backward gets here" in text and "the unfused baseline gets" in text
    rows = {row["backend"]: row for row in json.loads((tmp_path / "r.json").read_text())["results"]}
    dq = rows["sdpa.flash"]["tensors"]["dq"]
    assert dq["yardstick_kind"] == "flash-style backward" and dq["flash_style_err"] > 3 * dq["baseline_scaled_err"]
    assert "flash_style_err" not in rows["sdpa.math"]["tensors"]["dq"]  # not flash-style: judged as before
