"""`attn-doctor report --format issue`, and bisects through `report`.

Fixtures are real documents, read where they are committed: the H200 evidence under reports/h200
(redesign/run-default/results.json: TE 2.20.2's FusedAttention wrong on transposed views; two bisects made
before bisect recorded rows, bisect-te-fused and api/bisect-flash-causal), tests/data/results-fixed.json (the
goldens' document), and a run and bisect made here on the CPU with the test kernel that is wrong only in fp16
(one module fixture, about 15 s).
"""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
from cli_checks import one_line_error
from test_report import md_table, md_tables, parse_html, strip_code

from attn_doctor.cli import known as cli_known
from attn_doctor.render.fit import GITHUB_LIMIT, cap
from attn_doctor.render.issue import ISSUE_LIMIT
from attn_doctor.render.format import sci
from attn_doctor.results.bisect_record import noted_verdicts
from attn_doctor.results.report import RunReport

HERE = Path(__file__).resolve().parent
EVIDENCE = HERE.parent / "reports" / "h200"  # committed GPU evidence: read, never written
H200_RUN = EVIDENCE / "redesign" / "run-default" / "results.json"  # TE 2.20.2's FusedAttention, transposed views
FIXED = HERE / "data" / "results-fixed.json"
OLD_BISECT = EVIDENCE / "bisect-te-fused"  # the stride fault, notes in the oldest wording
CUT_BISECT = EVIDENCE / "api" / "bisect-flash-causal"  # notes cut at 200 characters
COND = HERE / "kernels" / "conditional.py"

TEMPLATE_ORDER = ["**Describe the bug**", "**Minimal case**", "**Steps/Code to reproduce bug**",
                  "**Expected behavior**", "**Known issue**", "**Environment overview**", "**Environment details**",
                  "**Additional context**"]
TEMPLATE_FIELDS = ["GPU model", "NVIDIA driver", "CUDA version", "cuDNN version", "Transformer Engine version",
                   "PyTorch version", "Python version", "OS version"]
MD_ALLOWED_TAGS = {"details", "summary", "sub", "br"}
SOURCE = ("https://github.com/NVIDIA/TransformerEngine/blob/d0067d0da6cb01811b8072a7d304f0e00344ce2b/"
          "transformer_engine/pytorch/attention/dot_product_attention/utils.py#L1000-L1010")
KNOWN = [f"EXAMPLE (test fixture): TE reads non-dense views as dense; see {SOURCE} (fixed in 9.9)"]


@pytest.fixture
def fixed_known(monkeypatch):
    monkeypatch.setattr(cli_known, "known_defects", lambda report: list(KNOWN))


@pytest.fixture
def no_known(monkeypatch):
    monkeypatch.setattr(cli_known, "known_defects", lambda report: [])


@pytest.fixture
def report_of(run_cli):
    """report_of(path, *flags) -> stdout of `attn-doctor report PATH --format issue FLAGS`, which must exit 0."""

    def go(path, *flags: str) -> str:
        flags = flags or ("--format", "issue")
        result = run_cli(["report", path, *flags])
        assert result.exit_code == 0, result.output
        # stderr holds the advice for the reporter alone (never in the body): lines a reporter copies
        assert all(line.split()[0] in ("paste:", "bisect:", "attach:") for line in result.stderr.splitlines()), \
            result.stderr
        return result.stdout

    return go


def write_doc(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def headings(issue: str) -> list[str]:
    return [line for line in issue.splitlines() if re.fullmatch(r"\*\*[A-Z][^*]+\*\*", line)]


def fenced(issue: str, language: str) -> list[str]:
    """The bodies of the code fences of `language` (a fence of 3 or more backticks)."""
    return [m.group(2) for m in re.finditer(rf"^(`{{3,}}){language}\n(.*?)\n\1$", issue, flags=re.DOTALL | re.MULTILINE)]


def well_formed(issue: str) -> None:
    """GitHub-safe: within the limit, every table well formed, only the tags the renderer writes."""
    assert len(issue) <= GITHUB_LIMIT
    md_tables(issue)
    text = strip_code(issue)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)
    tags = {m.group(1).lower() for m in re.finditer(r"</?([A-Za-z][A-Za-z0-9-]*)", text)}
    assert tags <= MD_ALLOWED_TAGS, tags - MD_ALLOWED_TAGS
    assert issue.count("<details>") == issue.count("</details>")


# --- a run's results: the worst fault ------------------------------------------------------------------------

def test_issue_of_a_run_follows_tes_template(report_of, fixed_known):
    issue = report_of(H200_RUN)
    well_formed(issue)
    first = issue.splitlines()[0]
    assert first == ("**Title:** [PyTorch] FusedAttention (sub-backend 1: F16_arbitrary_seqlen) computes wrong out, "
                     "dQ, dK and dV (forward) on b4 s1024 h16 d64 bf16 causal, transposed q/k/v (TE 2.20.2, cuDNN "
                     "9.14.0, NVIDIA H200)")
    found = headings(issue)
    assert [h for h in found if h in TEMPLATE_ORDER] == TEMPLATE_ORDER
    # one screen: beside the short repro (8,000 characters at b4 s1024 h16) the known issue comes first; the lists
    # without room are named, in the results file the body names
    assert "**Known issue**" in found and "**Paths that are right on the same inputs**" not in found
    assert found.index("**Suspected code location**") == found.index("**Known issue**") + 1
    assert "_Left out (one screen), in the attached results.json: paths that are right on the same inputs._" in issue
    assert len(issue) <= ISSUE_LIMIT


def test_issue_summary_says_what_how_much_and_what_is_right(report_of, no_known):
    issue = report_of(H200_RUN)
    paragraph = issue.split("**Describe the bug**\n\n", 1)[1].split("\n", 1)[0]
    assert paragraph.startswith("te.fused — FusedAttention (sub-backend 1: F16_arbitrary_seqlen) — computes a wrong "
                                "out, dQ, dK and dV on b4 s1024 h16 d64 bf16 causal with q, k, v in the transposed "
                                "layout; the fault is in the forward (out is already wrong).")
    report = RunReport.from_dict(json.loads(H200_RUN.read_text()))
    (row,) = report.failing_rows
    out = row.tensors["out"]
    assert (f"out's relative error is {out.rel_err:.3g} where a correct bf16 implementation gets "
            f"{out.threshold / 3:.3g} (the local baseline's error on them): {out.ratio:.0f}× that") in paragraph
    assert "sdpa.cudnn" in paragraph and "te.unfused" in paragraph
    assert "and so is te.fused itself on the contiguous, sb3hd_packed, sbh3d_packed, head_slice layouts." in paragraph


def test_issue_expected_against_measured_per_tensor(report_of, no_known):
    issue = report_of(H200_RUN)
    header, body = md_table(issue, "tensor", "correct bf16 error")
    (row,) = RunReport.from_dict(json.loads(H200_RUN.read_text())).failing_rows
    assert [cells[0] for cells in body] == ["out", "dQ", "dK", "dV"]
    for cells, (name, t) in zip(body, row.tensors.items()):
        assert cells[header.index("measured")] == f"**{sci(t.rel_err)}**"
        assert cells[header.index("verdict")] == "**FAIL**"
        assert float(cells[header.index("correct bf16 error")]) == pytest.approx(t.threshold / 3, rel=0.05)


def test_issue_lists_the_paths_right_on_the_same_inputs(no_known):
    """The list (which a body keeps while it has room: the repro comes first)."""
    from attn_doctor.render.issue import right_paths_section
    from attn_doctor.render.report_data import ReportData
    from attn_doctor.results.log import load_source

    source = load_source(H200_RUN)
    fault = ReportData(source.report, source.directory, source=source.source).fault
    section = right_paths_section(fault)
    _, body = md_table("\n".join(section.render(section.size())), "path", "ran")
    report = RunReport.from_dict(json.loads(H200_RUN.read_text()))
    passing = {(r.backend, r.layout) for r in report.rows if r.verdict == "PASS"}
    shown = [(cells[0], cells[2]) for cells in body]
    assert set(shown) <= passing
    assert ("sdpa.cudnn", "transposed") in shown and ("te.unfused", "transposed") in shown  # the same views
    assert {layout for backend, layout in shown if backend == "te.fused"} == {
        "contiguous", "sb3hd_packed", "sbh3d_packed", "head_slice"}  # the faulty path, right on other layouts
    assert ("local", "contiguous") in shown  # the yardstick
    assert ("sdpa.cudnn", "contiguous") not in shown  # another path on other views adds nothing
    layouts = [layout for _, layout in shown]
    assert layouts[: layouts.count("transposed")] == ["transposed"] * layouts.count("transposed")  # same views first


def test_issue_folds_a_standalone_repro_of_the_failing_row(report_of, no_known):
    issue = report_of(H200_RUN)
    (script,) = fenced(issue, "python")
    compile(script, "repro.py", "exec")
    assert "b4 s1024" in script and "B, S, SKV, H, HKV, D, DV, SEED = 4, 1024," in script  # the short repro
    assert "views = lambda q, k, v: [leaf(t).transpose(0, 1)" in script  # its own layout: bshd storage, sbhd views
    assert re.search(r"<details><summary>repro_te\.fused_[0-9a-f]{8}\.py \(\d+ lines\)</summary>", issue)
    assert issue.index("<details><summary>repro_te.fused_") < issue.index("**Expected behavior**")
    assert not [c for c in fenced(issue, "bash") if c.startswith("attn-doctor")]  # the script is the check


def test_issue_tells_the_reporter_to_bisect_when_none_was_run(run_cli, no_known):
    """The body states the fact to the maintainer; the advice (bisect first) is on the reporter's terminal,
    whole, and never in the body."""
    result = run_cli(["report", H200_RUN, "--format", "issue"])
    assert result.exit_code == 0
    section = result.stdout.split("**Minimal case**", 1)[1].split("**Steps/Code", 1)[0]
    assert section.strip() == "Not bisected: the case is the run's own, above."
    assert "attn-doctor bisect" not in result.stdout
    assert f"bisect:  attn-doctor bisect --from {H200_RUN}  (first:" in result.stderr.splitlines()[1]
    assert "attach:  results.json" in result.stderr


def test_issue_environment_has_the_fields_tes_template_asks_for(report_of, no_known):
    issue = report_of(H200_RUN)
    _, body = md_table(issue, "", "")
    labels = [cells[0] for cells in body]
    assert all(field in labels for field in TEMPLATE_FIELDS), labels
    values = {cells[0]: cells[1] for cells in body}
    assert values["GPU model"] == "NVIDIA H200 (sm_90, 143771 MiB)"
    assert values["cuDNN version"].startswith("9.14.0 (91400)") and "9.19.0 (91900) PyTorch's" in values["cuDNN version"]
    assert values["Transformer Engine version"].startswith("2.20.2")
    overview = issue.split("**Environment overview**", 1)[1].split("**Environment details**", 1)[0]
    assert "Environment location:" in overview and "transformer-engine-cu13 2.20.2" in overview


def test_issue_names_the_known_issue_and_the_code_location_it_names(report_of, fixed_known):
    issue = report_of(OLD_BISECT)  # its long repro is attached: the lists have room
    found = headings(issue)
    assert found.index("**Suspected code location**") == found.index("**Known issue**") + 1
    known = issue.split("**Known issue**", 1)[1].split("**Suspected code location**", 1)[0]
    assert "EXAMPLE (test fixture)" in known
    location = issue.split("**Suspected code location**", 1)[1].split("**", 1)[0]
    assert f"- {SOURCE}" in location


def test_issue_without_a_matching_known_issue_says_so(report_of, no_known):
    issue = report_of(H200_RUN)
    assert "No entry of attn-doctor's table of known TE/cuDNN defects" in issue
    assert "**Suspected code location**" not in issue


def test_issue_of_a_crash_gives_its_detail(report_of, doc_without, tmp_path, no_known):
    issue = report_of(doc_without(tmp_path, lambda r: r["verdict"] == "FAIL"))
    assert issue.startswith("**Title:** aborts crashes on b1 s32 h2 d8 bf16 causal")
    expected = issue.split("**Expected behavior**", 1)[1]
    assert "worker kernel died while running it (signal SIGABRT)" in expected
    assert "terminate called after throwing an instance of 'std::runtime_error'" in expected
    well_formed(issue)


@pytest.fixture
def doc_without():
    """doc_without(tmp_path, drop) -> the fixed document without the rows `drop` picks, written to a file."""

    def make(tmp_path: Path, drop) -> Path:
        document = json.loads(FIXED.read_text())
        document["results"] = [r for r in document["results"] if not drop(r)]
        return write_doc(tmp_path / "results.json", document)

    return make


def test_nothing_failed_no_issue_to_file(report_of, doc_without, tmp_path):
    issue = report_of(doc_without(tmp_path, lambda r: r["verdict"] in ("FAIL", "ERROR")))
    assert issue.startswith("No issue to file: no tested path computes anything wrong here. All 7 tested paths agree")
    assert issue.count("\n") == 1


def test_nothing_tested_no_issue_to_file(report_of, doc_without, tmp_path):
    issue = report_of(doc_without(tmp_path, lambda r: r["verdict"] != "SKIP"))
    assert issue.startswith("No issue to file: nothing was tested") and issue.count("\n") == 1


# --- size -----------------------------------------------------------------------------------------------------

def test_issue_of_a_huge_sweep_is_summarised_within_githubs_limit(report_of, tmp_path, fixed_known):
    """400 cases of the fixed document's rows (failing, NaN, crashing and passing): one section for the worst
    fault, every faulty path on one line, the page under 65,536 characters."""
    document = json.loads(FIXED.read_text())
    document["results"] = [dict(copy.deepcopy(row), case={**row["case"], "seq": 32 + step, "seq_kv": 32 + step})
                           for step in range(400) for row in document["results"]]
    path = write_doc(tmp_path / "huge.json", document)
    issue = report_of(path)
    well_formed(issue)
    assert issue.startswith("**Title:** tests/kernels/faulty.py:nan_one_head_dk computes wrong dK (backward)")
    faults = issue.split("**Every fault in this run**", 1)[1].split("**Environment overview**", 1)[0]
    lines = [line for line in faults.splitlines() if line.startswith("- ")]
    # one per faulty path, as many as one screen holds; the rest counted, in the attached document
    assert len(issue) <= ISSUE_LIMIT and 1 <= len(lines) <= 4
    assert len(lines) == 4 or f"_… and {4 - len(lines)} more, in the attached huge.json._" in faults
    assert all("; 400 cases (b1 s32 h2 d8 bf16 causal, b1 s33 h2 d8 bf16 causal, b1 s34 h2 d8 bf16 causal and 397 more)"
               in line for line in lines), lines
    markdown = report_of(path, "--format", "markdown")
    assert len(markdown) <= GITHUB_LIMIT and "passing and skipped rows are folded into these counts" in markdown


def test_issue_cuts_lists_that_do_not_fit_with_a_note(report_of, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_known, "known_defects", lambda report: [f"defect {i}: " + "x" * 400 for i in range(400)])
    issue = report_of(OLD_BISECT)  # its long repro is attached: the lists have room
    well_formed(issue)
    assert re.search(r"_… and \d+ more, in the attached [\w.-]+\.json\._", issue) and len(issue) <= ISSUE_LIMIT
    assert "- defect 0: " in issue


def test_a_repro_too_long_to_inline_is_named_for_attaching(report_of, tmp_path, no_known):
    folder = tmp_path / "bisect"
    shutil.copytree(OLD_BISECT, folder)
    script = folder / "repro_te.fused_1b7dbaf9.py"
    script.write_text(script.read_text() + "# padding\n" * 7_000)
    issue = report_of(folder)
    well_formed(issue)
    assert "The standalone repro script, repro_te.fused_1b7dbaf9.py (" in issue and "lines), is attached." in issue
    assert not fenced(issue, "python") and len(issue) <= ISSUE_LIMIT


def test_cap_closes_what_it_cuts_and_says_so():
    text = "\n".join(["<details><summary>s</summary>", "", "```python", *("x = 1" for _ in range(30_000))])
    capped = cap(text)
    assert len(capped) <= GITHUB_LIMIT
    lines = capped.splitlines()
    assert lines[-1].startswith("_… the rest is left out to fit GitHub's 65,536-character limit")
    assert [line for line in lines if line.startswith("```")] == ["```python", "```"]
    assert capped.count("<details>") == capped.count("</details>") == 1
    assert cap("short") == "short"


# --- bisects through report -------------------------------------------------------------------------------

def test_old_bisect_reports_its_minimal_case_conditions_and_repro(report_of, no_known):
    issue = report_of(OLD_BISECT)
    well_formed(issue)
    assert issue.splitlines()[0] == ("**Title:** [PyTorch] te.fused computes wrong out, dQ, dK and dV (forward) when "
                                     "layout transposed, batch ≥ 2, seq 2 (TE 2.20.2, cuDNN 9.14.0, NVIDIA H200)")
    section = issue.split("**Minimal case**", 1)[1].split("**Steps/Code", 1)[0]
    assert "shrank b4 s1024 h16 d64 bf16 causal layout=transposed to **b2 s2 h1 d8 fp16 no_mask layout=transposed**" \
        in section
    assert "- layout: fails at transposed, passes at contiguous" in section
    assert "- batch: fails at 2, passes at 1" in section
    # its repro is the long form (made before the short one existed): named to attach, not inlined
    assert not fenced(issue, "python") and "repro_te.fused_1b7dbaf9.py" in issue and len(issue) <= ISSUE_LIMIT
    # the figures the probe notes state, as the repro printed them on the H200 (repro-output.txt)
    header, body = md_table(issue, "tensor", "correct fp16 error")
    measured = {cells[0]: cells[header.index("measured")] for cells in body}
    assert measured == {"out": "**1.0e0**", "dQ": "**1.9e0**", "dK": "**1.0e0**", "dV": "**2.7e-1**"}
    assert "This bisect predates recorded rows" in issue
    _, env = md_table(issue, "", "")
    assert {c[0]: c[1] for c in env}["GPU model"] == "NVIDIA H200 (sm_90, 143771 MiB)"  # from the repro's header


def test_old_bisect_leaves_out_a_clause_its_note_cut_short(report_of, no_known):
    note = json.loads((CUT_BISECT / "bisect.json").read_text())["probes"][-1]["note"]
    assert len(note) == 200 and note.endswith("; dv: error 1 (relative) > 3 x 0.000345 (rounding noise, 0.25 eps of the term")
    assert set(noted_verdicts(note)) == {"out"}
    # the older wording, its last clause cut mid-number ("0.000123" -> "0.0001") at the note's 200 characters
    head, cut_clause = "out: error 0.25 > 3 x baseline 0.00011; ", "dq: error 0.5 > 3 x baseline 0.0001"
    cut = head + "x" * (200 - len(head) - 2 - len(cut_clause)) + "; " + cut_clause
    assert len(cut) == 200 and set(noted_verdicts(cut)) == {"out"}
    assert set(noted_verdicts(cut[:-1] + ";")) == {"out", "dq"}  # a clause that ends before the cut is read
    issue = report_of(CUT_BISECT)
    _, body = md_table(issue, "tensor", "correct fp16 error")
    assert [cells[0] for cells in body] == ["out"]
    assert "Checked on a correct path: sdpa.math passes on it." in issue


def test_noted_verdicts_read_back_the_rule_s_own_words():
    from attn_doctor.verdict.rule import BASELINE_YARDSTICK, NOISE_YARDSTICK, _error_why

    why = _error_why("error", 0.02, 0.004, 3.0, BASELINE_YARDSTICK, 1.0, False, 0.001, "bf16")
    noise = _error_why("error", 0.5, 0.001, 3.0, NOISE_YARDSTICK, None, True, 0.001, "fp16")
    verdicts = {**noted_verdicts(f"dq: {why}"), **noted_verdicts(f"dk: {noise}"),
                **noted_verdicts("out: 0 NaN and 0 Inf where float64 has none; dv: 3 NaN and 0 Inf where float64 has none")}
    assert verdicts["dq"].rel_err == 0.02 and verdicts["dq"].threshold == pytest.approx(0.012)
    assert verdicts["dq"].yardstick_kind == BASELINE_YARDSTICK and verdicts["dq"].ratio == pytest.approx(5)
    assert verdicts["dk"].cancelled and verdicts["dk"].shown_err == 0.5 and verdicts["dk"].yardstick_kind == NOISE_YARDSTICK
    assert (verdicts["dv"].nan, verdicts["dv"].inf) == (3, 0) and math.isinf(verdicts["dv"].ratio)


@pytest.fixture(scope="module")
def cpu_bisect(tmp_path_factory, run_cli):
    """A run of the fp16-only kernel on two layouts, and `bisect --from` its first failing row (its document
    and repro land beside the results)."""
    workdir = tmp_path_factory.mktemp("issue-bisect")
    flags = ["--batch", 1, "--seq", 16, "--heads", 2, "--head-dim", 16, "--dtype", "fp16", "--device", "cpu"]
    results = workdir / "run" / "results.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        run = run_cli(["run", "--kernel", f"{COND}:fp16_only", *flags, "--layout", "transposed", "--layout",
                       "contiguous", "--json", results])
        assert run.exit_code == 1, run.output
        bisect = run_cli(["bisect", "--from", results, "--device", "cpu", "--json", workdir / "copy.json"])
    assert bisect.exit_code == 0, bisect.output
    (document,) = results.parent.glob("bisect_*.json")
    return results, document, bisect.output


@pytest.mark.slow
def test_bisect_writes_its_document_beside_its_repro(cpu_bisect):
    results, document, output = cpu_bisect
    doc = json.loads(document.read_text())
    assert doc["format"] == "attn-doctor/bisect" and doc["backend"] == "fp16_only"
    assert json.loads((results.parent.parent / "copy.json").read_text()) == doc  # --json: the same document
    assert (results.parent / Path(doc["repro"]).name).is_file()
    assert doc["env"]["torch"]["value"] and doc["command"].startswith("attn-doctor bisect --from")
    rows = [(r["backend"], r["case"]["seq"], r["verdict"]) for r in doc["results"]]
    assert rows == [("local", 16, "PASS"), ("fp16_only", 16, "FAIL"), ("local", 1, "PASS"), ("fp16_only", 1, "FAIL"),
                    ("sdpa.math", 1, "PASS")]
    assert f"issue:   attn-doctor report {document}" in output.replace("\n", "")


def test_bisect_document_through_report_issue(cpu_bisect, report_of, no_known):
    _, document, _ = cpu_bisect
    issue = report_of(document)
    well_formed(issue)
    assert issue.splitlines()[0] == ("**Title:** " + str(COND) + ":fp16_only computes wrong out (forward) when dtype "
                                     "fp16")
    assert "_fp16_only is not a Transformer Engine path" in issue
    section = issue.split("**Minimal case**", 1)[1].split("**Steps/Code", 1)[0]
    assert "to **b1 s1 h1 d8 fp16 no_mask layout=contiguous**" in section
    assert re.search(r"- dtype: fails at fp16, passes at (fp32, bf16|bf16, fp32)", section)
    assert "- First wrong: forward (out is already wrong)." in section
    (script,) = fenced(issue, "python")
    repro = json.loads(document.read_text())["repro"]
    assert script == (document.parent / Path(repro).name).read_text().rstrip("\n")
    header, body = md_table(issue, "tensor", "correct fp16 error")
    assert [c[header.index("verdict")] for c in body] == ["**FAIL**", "PASS", "PASS", "PASS"]
    _, right = md_table(issue, "path", "ran")
    assert {(c[0], c[3]) for c in right} >= {("sdpa.math", "b1 s1 h1 d8 fp16 no_mask"), ("local", "b1 s1 h1 d8 fp16 no_mask")}
    assert "**Every fault in this run**" not in issue  # the start and the minimal case are the one fault


def test_bisect_document_through_every_format(cpu_bisect, report_of, no_known):
    _, document, _ = cpu_bisect
    markdown = report_of(document, "--format", "markdown")
    assert len(markdown) <= GITHUB_LIMIT
    section = markdown.split("### Bisect of fp16_only", 1)[1].split("### Results", 1)[0]
    assert "to **b1 s1 h1 d8 fp16 no_mask layout=contiguous**" in section
    assert re.search(r"- dtype: fails at fp16, passes at", section)
    _, body = md_table(markdown, "backend", "ran")
    assert sum(1 for cells in body if "FAIL" in cells[-1]) == 2  # the start and the minimal case
    assert "<details><summary>The bisects' standalone repro scripts</summary>" in markdown
    page = report_of(document, "--format", "html")
    assert "Bisect of fp16_only" in page and "repro_fp16_only_" in page
    parse_html(page)
    assert report_of(document, "--format", "csv").count("fp16_only") >= 8
    assert len(RunReport.from_dict(json.loads(report_of(document, "--format", "json"))).rows) == 5


def test_results_with_their_bisect_beside_report_the_bisected_fault(cpu_bisect, report_of, no_known):
    results, _, _ = cpu_bisect
    issue = report_of(results.parent)
    section = issue.split("**Minimal case**", 1)[1].split("**Steps/Code", 1)[0]
    assert "Not bisected" not in section and ("`attn-doctor bisect` shrank b1 s16 h2 d16 fp16 causal "
                                              "layout=transposed to **b1 s1 h1 d8 fp16 no_mask layout=contiguous**") in section
    assert "**Every fault in this run**" in issue  # the contiguous row failed too
    markdown = report_of(results, "--format", "markdown")
    assert "### Bisect of fp16_only" in markdown


# --- exit codes -------------------------------------------------------------------------------------------------

def _folder_without_results(tmp_path):
    (tmp_path / "notes").mkdir()
    write_doc(tmp_path / "notes" / "notes.json", {"hello": 1})
    return tmp_path / "notes", "no results.json or results.jsonl (nor a bisect document)"


def _two_bisects(tmp_path):
    folder = tmp_path / "two"
    shutil.copytree(OLD_BISECT, folder)
    shutil.copy(folder / "bisect.json", folder / "bisect_other.json")
    return folder, "holds 2 bisect documents"


def _damaged_bisect(tmp_path):
    document = json.loads((OLD_BISECT / "bisect.json").read_text())
    document["minimal_case"]["case"]["heads"] = "many"
    return write_doc(tmp_path / "bisect.json", document), "is a damaged bisect document"


def _a_list(tmp_path):
    return write_doc(tmp_path / "list.json", [1, 2]), "not an attn-doctor results document"


@pytest.mark.parametrize("case", [_folder_without_results, _two_bisects, _damaged_bisect, _a_list],
                         ids=["folder-without-results", "two-bisects", "damaged-bisect", "json-list"])
@pytest.mark.parametrize("fmt", ["issue", "markdown"])
def test_a_path_that_is_not_results_exits_2_with_one_line(case, fmt, tmp_path, run_cli):
    path, needle = case(tmp_path)
    line = one_line_error(run_cli(["report", path, "--format", fmt]))
    assert needle in line, line


# --- every fact is the failing row's own (issue 50): the builds it read back, and the run's other builds ----------

TWO_BUILDS = HERE.parent / "reports" / "h200" / "cudnn" / "run-2" / "run-thd-head-dim.json"  # an H100 run


def _two_builds(tmp_path: Path, change=None) -> Path:
    """The committed run of the thd head-dim fault on cuDNN 9.14.0 (FAIL) and 9.19.0 (PASS), on a machine whose TE
    loads 9.19.0 by default; `change(rows)` edits its rows."""
    document = json.loads(TWO_BUILDS.read_text())
    if change is not None:
        change(document["results"])
    return write_doc(tmp_path / "results.json", document)


def _te_rows(rows: list[dict], build: str) -> list[dict]:
    return [r for r in rows if r["backend"] == f"te.fused@cudnn-{build}"]


def test_the_title_description_and_environment_name_the_failing_rows_build(tmp_path, report_of, no_known):
    issue = report_of(_two_builds(tmp_path))
    title, table_row = issue.splitlines()[0], next(l for l in issue.splitlines() if l.startswith("| cuDNN version"))
    assert "fails with cuDNN 9.14.0, passes with 9.19.0" in title and "cuDNN 9.19.0," not in title
    assert "ran on cuDNN 9.14.0 (read back" in issue
    assert table_row.startswith("| cuDNN version | 9.14.0, loaded by TE for the failing call (read back)")
    assert "the machine's: 9.19.0 (91900) loaded by TE" in table_row  # the default, said as such


def test_one_build_alone_is_named_as_read_back_not_the_machines_default(tmp_path, report_of, no_known):
    def drop_the_other_build(rows):
        rows[:] = [r for r in rows if r["backend"] != "te.fused@cudnn-9.19.0"]

    issue = report_of(_two_builds(tmp_path, drop_the_other_build))
    title = issue.splitlines()[0]
    assert "cuDNN 9.14.0" in title and "9.19.0" not in title and "passes with" not in issue


def test_the_other_side_a_fault_of_the_newer_build_is_not_called_fixed(tmp_path, report_of, no_known):
    """The same rows with the verdicts swapped: it fails with 9.19.0 and passes with 9.14.0."""
    def swap(rows):
        failing, passing = _te_rows(rows, "9.14.0"), _te_rows(rows, "9.19.0")
        for row in failing:
            row["verdict"], row["reason"] = "PASS", ""
            row["tensors"] = {name: {**t, "verdict": "PASS"} for name, t in row["tensors"].items()}
        for row, bad in zip(passing, failing):
            row["verdict"], row["reason"], row["tensors"] = "FAIL", "dv wrong", copy.deepcopy(bad["tensors"])
            row["tensors"]["dv"]["verdict"] = "FAIL"

    issue = report_of(_two_builds(tmp_path, swap))
    title = issue.splitlines()[0]
    assert "fails with cuDNN 9.19.0, passes with 9.14.0" in title and "fixed by" not in title


def test_markdown_and_html_state_the_same_builds(tmp_path, report_of, no_known):
    path = _two_builds(tmp_path)
    markdown = report_of(path, "--format", "markdown")
    html = report_of(path, "--format", "html")
    sentence = ("te.fused@cudnn-9.14.0 ran on cuDNN 9.14.0 (read back from the library in the failing call's "
                "process); on this run's other builds: fails with cuDNN 9.14.0, passes with 9.19.0: fixed by 9.19.0.")
    assert f"**Builds:** {sentence}" in markdown
    assert "<strong>Builds:</strong> " + sentence.replace("'", "&#x27;") in html


def test_rows_on_two_te_releases_are_not_taken_for_two_cudnn_builds_of_one():
    """The 9.19.0 row ran another TE release (`--te`): its pass says nothing of the 9.14.0 row's cuDNN."""
    from attn_doctor.render.report_data import row_builds

    report = RunReport.from_dict(json.loads(TWO_BUILDS.read_text()))
    failing = next(r for r in report.rows if r.backend == "te.fused@cudnn-9.14.0" and r.verdict == "FAIL")
    assert row_builds(failing, report.rows, env=report.env).elsewhere.startswith("fails with cuDNN 9.14.0")
    for row in report.rows:
        if row.backend == "te.fused@cudnn-9.19.0":
            row.extra["te"] = "2.20.2"
    assert row_builds(failing, report.rows, env=report.env).elsewhere == ""


TE_RELEASES = HERE.parent / "reports" / "h100" / "te-releases" / "run-1"  # TE 2.18.0 beside 2.20.2, on an H100


def test_the_title_and_description_name_the_failing_rows_te_release_and_the_other_releases(report_of, no_known):
    """The H100's thd head-dim fault on TE 2.18.0 and 2.20.2, each on cuDNN 9.14.0 and 9.19.0: the filed row ran
    the prepared 2.18.0 (the machine's own TE is 2.20.2), and the title says what the releases and builds did."""
    issue = report_of(TE_RELEASES / "run-thd-head-dim.json")
    title = issue.splitlines()[0]
    assert "reproduced with TE 2.18.0 and 2.20.2" in title and "fails with cuDNN 9.14.0, passes with 9.19.0" in title
    assert "(TE 2.20.2" not in title
    assert "It ran on TE 2.18.0 and cuDNN 9.14.0 (read back from the library in the failing call's process)." in issue
    table_row = next(line for line in issue.splitlines() if line.startswith("| Transformer Engine version"))
    assert table_row.startswith("| Transformer Engine version | 2.18.0 for the failing call (read back); installed: 2.20.2")
    assert "`attn-doctor te add 2.18.0` beside transformer-engine-cu13 2.20.2" in issue.replace("\\`", "`")


def test_a_bisect_across_te_releases_says_so_in_the_title(report_of, no_known):
    """The bisect from TE 2.18.0 tried 2.20.2 (its te knob): reproduced with both, said in place of one release."""
    title = report_of(TE_RELEASES / "bisect-bias111s").splitlines()[0]
    assert "(reproduced with TE 2.18.0 and 2.20.2, cuDNN 9.14.0 and 9.19.0, NVIDIA H100 80GB HBM3)" in title


def test_one_release_alone_is_named_as_the_row_ran_it_not_the_machines():
    """The other side: a row on the prepared 2.18.0 with no other release beside it names 2.18.0 alone (the
    machine's own 2.20.2 never), and a row on no `--te` names no release of its own."""
    from attn_doctor.render.report_data import row_builds

    report = RunReport.from_dict(json.loads((TE_RELEASES / "run-thd-head-dim.json").read_text()))
    rows = [r for r in report.rows if "te-2.20.2" not in r.backend]
    failing = next(r for r in rows if r.backend == "te.fused@te-2.18.0@cudnn-9.14.0")
    builds = row_builds(failing, rows, env=report.env)
    assert builds.te == "2.18.0" and builds.te_elsewhere == ""
    local = next(r for r in rows if r.backend == "local")
    assert row_builds(local, rows, env=report.env).te is None


def test_a_path_that_reads_back_no_cudnn_is_not_given_one_it_did_not_use():
    from attn_doctor.render.report_data import row_builds

    report = RunReport.from_dict(json.loads(TWO_BUILDS.read_text()))
    local = next(r for r in report.rows if r.backend == "local")
    builds = row_builds(local, report.rows, env=report.env)
    assert builds.cudnn is None and builds.versions() == [] and builds.sentence("local") == ""


# --- one screen -------------------------------------------------------------------------------------------------

ONE_SCREEN = [EVIDENCE / "cudnn" / "run-2" / f"run-{name}.json" for name in ("thd-head-dim", "bias111s", "strided")] + [
    EVIDENCE / "run-default" / "results.json", H200_RUN] + [
    EVIDENCE / "cudnn" / "run-3" / f"bisect-{name}" for name in ("thd-head-dim", "bias111s", "strided")] + [
    HERE.parent / "reports" / "h100" / "te-releases" / "run-1" / f"{kind}{name}{suffix}"
    for name in ("thd-head-dim", "bias111s", "strided") for kind, suffix in (("run-", ".json"), ("bisect-", ""))]


@pytest.mark.parametrize("path", ONE_SCREEN, ids=[f"{p.parent.name}/{p.name}" for p in ONE_SCREEN])
def test_the_body_is_one_screen_with_the_short_repro_inline(path, run_cli, no_known):
    """The GPU runs' faults (TE's three, the default run's): TE's form in at most 12,000 characters, the short repro
    inline, nothing cut mid-way, nothing for the reporter in it (that is on stderr)."""
    result = run_cli(["report", path, "--format", "issue"])
    issue = result.stdout
    assert result.exit_code == 0 and len(issue) <= ISSUE_LIMIT, len(issue)
    well_formed(issue)
    (script,) = fenced(issue, "python")
    assert script.startswith("#!/usr/bin/env python3") and len(script.splitlines()) <= 120
    assert [h for h in headings(issue) if h in TEMPLATE_ORDER][:4] == TEMPLATE_ORDER[:4]
    assert "left out to keep this body one screen; the attached" not in issue  # never cut by the last guard
    assert "attn-doctor bisect --from" not in issue and "attn-doctor report" not in issue
    bisected = path.is_dir()
    assert ("bisect:  attn-doctor bisect --from" in result.stderr) != bisected
    if bisected:  # the bisect's facts, for the maintainer: its conditions and what confirmed them
        section = issue.split("**Minimal case**", 1)[1].split("**Steps/Code", 1)[0]
        assert "Necessary conditions" in section and "- Confirmed at the end: fails again; passes at " in section
