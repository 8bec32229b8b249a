"""GitHub-flavoured markdown of a results document, for pasting into a TE / cuDNN / Megatron-LM issue.

A maintainer must see in ten seconds: which GPU and versions, which kernel path is wrong, on which case, how
wrong, and how to reproduce it. So: the verdict first, the environment as a compact table, the results
with failing rows first, the reproduce commands, and the long details folded into <details> blocks.
"""

from __future__ import annotations

import re

from attn_doctor.numerics.masks import describe
from attn_doctor.render.env_view import env_markdown
from attn_doctor.render.fit import GITHUB_LIMIT, Section, fit_sections
from attn_doctor.render.format import (
    CANCELLED_NOTE,
    REPEATS_NOTE,
    TENSOR_TITLES,
    display_rows,
    has_repeats,
    md_escape,
    ratio,
    repeats_cell,
    sci,
    tensor_cell,
)
from attn_doctor.render.report_data import (
    ReportData,
    call_rows,
    compact_env,
    dq_in_eps,
    sort_rows,
    tensor_names,
)
from attn_doctor.results.bisect_record import BisectRecord
from attn_doctor.results.row import Row
from attn_doctor.verdict.depth import depth_lines
from attn_doctor.verdict.diagnosis import flash_style_notes, tally
from attn_doctor.verdict.rule import rule_sentence

escape = md_escape


def table(header: list[str], body: list[list[str]]) -> str:
    """A GitHub table; the cells must already be escaped (callers escape data, not their own markup)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


FENCE = "`" * 3  # a traceback could hold a fence of its own; it is broken up before being fenced


def tensor_text(row: Row, name: str) -> str:
    text = tensor_cell(row, name, parens=True)
    return f"**{text}**" if text and row.tensors[name].verdict == "FAIL" else text


def _verdict(row: Row) -> str:
    return f"**{row.verdict}**" if row.verdict in ("FAIL", "ERROR", "INCONCLUSIVE") else row.verdict


def _repeats(row: Row) -> str:
    text = escape(repeats_cell(row))
    return f"**{text}**" if row.differing_tensors else text


def results_markdown(rows: list[Row], only_failing: bool = False) -> str:
    """The results table, failing rows first (`only_failing`: those alone, the rest folded into counts by
    `counts_markdown`)."""
    names = tensor_names(rows)
    shown_rows = call_rows(rows)
    tp_distance = any("dq_vs_tp1" in r.extra for r in shown_rows)
    repeated = has_repeats(shown_rows)  # the column only when some call ran more than once (--repeats)
    header = ["backend", "ran", "layout", "case"] + [f"{TENSOR_TITLES[n]} err (×base)" for n in names] + [
        "dQ err / ε"] + (["‖dQ − dQ_TP1‖ / ‖dQ_TP1‖"] if tp_distance else []) + (
        ["repeats"] if repeated else []) + ["verdict"]
    body = []
    for row, layout in sort_rows(display_rows(shown_rows)):
        if only_failing and row.verdict not in ("FAIL", "ERROR", "INCONCLUSIVE"):
            continue
        ran = row.ran if row.tensors else ("skipped, see below" if row.verdict == "SKIP" else row.reason)
        knobs = row.case.short() + row.coords.text()
        distance = [sci(row.extra["dq_vs_tp1"]) if "dq_vs_tp1" in row.extra else ""] if tp_distance else []
        repeats = [_repeats(row)] if repeated else []
        body.append([escape(row.backend), escape(ran), escape(layout), escape(knobs)]
                    + [tensor_text(row, n) for n in names] + [dq_in_eps(row)] + distance + repeats + [_verdict(row)])
    return table(header, body) if body else ""


def counts_markdown(rows: list[Row]) -> str:
    """How many rows of each backend pass, fail, crash, could not be judged, are skipped and did not fit."""
    tallies = tally(call_rows(rows))
    undecided = any(t.inconclusive for t in tallies)
    too_big = any(t.too_big for t in tallies)
    body = [[escape(t.backend), str(t.passed), str(t.failed), str(t.errors)]
            + ([str(t.inconclusive)] if undecided else []) + [str(t.skipped)]
            + ([str(t.too_big)] if too_big else []) for t in tallies]
    header = (["backend", "PASS", "FAIL", "ERROR"] + (["INCONCLUSIVE"] if undecided else []) + ["SKIP"]
              + (["TOO-BIG"] if too_big else []))
    return table(header, body) if body else ""


def depth_markdown(rows: list[Row]) -> str:
    body = [[escape(d.backend), str(d.tp), str(d.layers), sci(d.dq_first), sci(d.dq_last), sci(d.baseline_dq_first),
             ratio(d.ratio), sci(d.vs_baseline), sci(d.vs_tp1) if d.vs_tp1 is not None else "", d.verdict]
            for d in depth_lines(rows)]
    if not body:
        return ""
    header = ["backend", "TP", "layers", "dQ err, layer 1", "dQ err, last layer", "local's dQ err, layer 1",
              "×base", "‖dQ − dQ_local‖ / ‖dQ_local‖", "‖dQ − dQ_TP1‖ / ‖dQ_TP1‖", "verdict"]
    return table(header, body)


def report_markdown(data: ReportData) -> str:
    """The whole report, within GitHub's limit: long lists are cut (failing rows come first) with a line
    saying how many were left out."""
    report = data.report
    top = ["## attn-doctor report", "", f"**Verdict:** {escape(report.summary)}", ""]
    if data.builds_sentence:
        top += [f"**Builds:** {escape(data.builds_sentence)}", ""]
    if report.seconds.get("points"):
        top += [f"**Sweep:** {report.seconds['points']:.0f} cases in {report.seconds['wall']:.0f} s from the "
                f"command's start ({report.seconds['points per minute']:.1f} cases per minute).", ""]
    if data.known:
        top += ["**Known defects matching this machine and case:**", ""]
        top += [f"- {escape(text)}" for text in data.known] + [""]
    if report.env is not None:
        rows = [[escape(label), escape(value)] for label, value in compact_env(report.env)]
        top += ["### Environment", "", table(["", ""], rows), ""]
    cases = list(dict.fromkeys(row.case for row in report.rows))
    if len(cases) == 1:
        top += ["**Case:** " + escape(cases[0].short()) + ". " + escape("; ".join(describe(cases[0]))) + ".", ""]
    top += [f"**Note:** {escape(note)}." for note in report.notes] + ([""] if report.notes else [])
    for bisect in data.bisects:
        top += [f"### Bisect of {escape(bisect.tested)}", "", *bisect_lines(bisect)]

    writes = Section(["**Writes into padding** (flagged, not failed; TE's kernels write zeros there):", ""], [
        f"- {escape(row.backend)} on {escape(row.layout)} ({escape(row.case.short())}): " + ", ".join(
            f"{TENSOR_TITLES.get(n, n)} {nonzero} of {values} values" for n, (nonzero, values) in row.padding_writes.items())
        for row in report.rows if row.padding_writes], [""], share=0.05)
    results = _results_section(report.rows)
    flash_style = Section(["**Flash-style paths judged with their own output rounding** (what a correct "
                           "flash-style backward gets on these inputs; see how a verdict is reached):", ""],
                          [f"- {escape(note)}" for note in flash_style_notes(report.rows)], [""], share=0.05)
    depth = depth_markdown(report.rows).split("\n")
    depth = Section(["### dQ against depth", "",
                     ("dQ of a Megatron-style GPT stack with this backend as core attention, against the stack's "
                      "float64 replica; the last two columns are distances between implementations, the quantity "
                      "the bug reports measured."), "", *depth[:2]], depth[2:],
                    ["", _plot_note(data), ""] if data.plot_path else [""], share=0.10,
                    table=True) if depth != [""] else None
    failing = data.failing
    reproduce = Section(["### Reproduce", ""], [f"{FENCE}bash\n{command}\n{FENCE}" for command in data.repro_commands],
                         [""], share=0.10)
    whys = []
    for row in [*failing, *data.undecided]:
        head = f"- {escape(row.backend)} on {escape(row.layout)} ({escape(row.case.short())})"
        layer = row.extra.get("layer")
        if isinstance(layer, dict) and layer.get("where"):  # a layer path's row: where in the layer
            head += f", {escape(layer['where'])}"
        failed = [(name, t.why) for name, t in row.tensors.items() if t.verdict == row.verdict and t.why]
        # one entry per row: each failing tensor's error, its yardstick, and why that yardstick
        whys.append("\n".join([f"{head}:"] + [f"  - {name}: {escape(why)}" for name, why in failed]) if failed
                    else f"{head}: {escape(row.reason)}")
    title = "Why each failing row failed" + (", and why some could not be judged" if data.undecided else "")
    whys = Section([f"<details><summary>{title}</summary>", ""], whys, ["", "</details>", ""], share=0.15)
    skipped = Section(["<details><summary>Skipped paths and why</summary>", ""], [
        f"- {escape(row.backend)} ({'all layouts' if layout == 'all' else escape(layout)}): {escape(row.reason)}"
        for row, layout in data.skipped], ["", "</details>", ""], share=0.10)
    errors = Section(["<details><summary>Error details</summary>", ""], [
        "\n".join([f"{escape(row.backend)} on {escape(row.layout)}:", "", *detail_lines(row.detail)])
        for row in failing if row.detail], ["</details>", ""], share=0.10)
    bottom: list[str] = []
    if report.env is not None:
        bottom += ["<details><summary>Full environment</summary>", "", env_markdown(report.env), "", "</details>", ""]
    made = ", ".join(escape(x) for x in (f"attn-doctor {report.tool_version}" if report.tool_version else "",
                                         report.created) if x)
    bottom += [f"<sub>{escape(report.command)}{' — ' + made if made else ''}</sub>", ""]

    repros = Section(["<details><summary>The bisects' standalone repro scripts</summary>", ""], [
        "\n".join(repro_lines(bisect.repro_name, bisect.repro)) for bisect in data.bisects if bisect.repro],
        ["</details>", ""], share=0.25)
    order = (writes, results, flash_style, depth, reproduce if failing else None, repros, whys, skipped, errors)
    sections = [s for s in order if s is not None and s.items]
    fitted = dict(zip(map(id, sections), fit_sections(sum(len(x) + 1 for x in top + bottom), sections)))
    return "\n".join(top + [line for s in order for line in fitted.get(id(s), [])] + bottom)


def detail_lines(detail: str) -> list[str]:
    """An error's detail (a traceback, a worker's last lines) fenced; a fence of its own is broken up."""
    return [FENCE, detail.strip().replace(FENCE, "` ` `"), FENCE, ""]


def bisect_lines(bisect: BisectRecord) -> list[str]:
    """What a bisect found: the minimal case, the conditions it needs, where the fault first shows, the
    check on a correct path, and its repro script."""
    lines = [(f"`attn-doctor bisect` shrank {escape(bisect.start.describe())} to "
              f"**{escape(bisect.minimal.describe())}**, which still fails the same way."), ""]
    if bisect.necessary:
        lines += ["Necessary conditions (simplifying any one of them makes the failure go away):", ""]
        lines += [f"- {escape(c.knob)}: {escape(c.clause())}" for c in bisect.necessary]
    else:
        lines.append("No condition is necessary among the knobs attn-doctor turns: it fails on the plainest case "
                     "tried.")
    if bisect.changes:
        lines += ["", "Simplifications that changed the failure instead of removing it (not conditions):", ""]
        lines += [f"- {escape(c.sentence())}" for c in bisect.changes]
    lines.append("")
    facts = [("First wrong", bisect.diagnosis.get("first_wrong")),
             ("TE releases", bisect.te_sentence()),
             ("cuDNN builds", bisect.cudnn_sentence()),
             ("Checked on a correct path", bisect.diagnosis.get("minimal_case_checked")),
             ("Standalone repro", bisect.repro_name + ("" if bisect.repro is not None else
                                                       " (not found beside the bisect document)"))]
    lines += [f"- {label}: {escape(value)}." for label, value in facts if value] + [""]
    return lines


def repro_lines(name: str, script: str) -> list[str]:
    """A standalone repro script, folded, in a fence no line of it can close."""
    longest = max((len(run) for run in re.findall(r"`+", script)), default=0)
    fence = "`" * max(3, longest + 1)
    return [f"<details><summary>{escape(name)} ({script.count(chr(10))} lines)</summary>", "", f"{fence}python",
            script.rstrip("\n"), fence, "", "</details>", ""]


def _results_section(rows: list[Row]) -> Section | None:
    """The results table; when it does not fit, its failing rows whole and the rest folded into counts."""
    whole = results_markdown(rows).split("\n")
    if whole == [""]:
        return None
    head = ["### Results", "",
            ("Relative L2 error against float64 (computed from the same low-precision inputs), in parentheses its "
             "ratio to the Megatron-local baseline's error on the same inputs; ε is the dtype's machine epsilon. "
             f"{rule_sentence()} {CANCELLED_NOTE}.") + (f" {REPEATS_NOTE}" if has_repeats(rows) else ""), ""]
    failing = results_markdown(rows, only_failing=True).split("\n")
    passing = sum(1 for row in call_rows(rows) if row.verdict not in ("FAIL", "ERROR", "INCONCLUSIVE"))
    fold_note = (f"_{passing} passing and skipped rows are folded into these counts to fit GitHub's "
                 f"{GITHUB_LIMIT:,}-character limit (`attn-doctor report RESULTS --format html` shows every row):_")
    counts = ["", fold_note, "", counts_markdown(rows), ""]
    folded = Section([*head, *failing[:2]], failing[2:], counts, share=0.40, table=True) if failing != [""] else \
        Section(head, [], counts, share=0.40)
    return Section([*head, *whole[:2]], whole[2:], [""], share=0.40, table=True, folded=folded)


def _plot_note(data: ReportData) -> str:
    """Where the depth plot is: a relative link breaks once the report is pasted, and GitHub shows no
    embedded image in an issue, so the file is named for attaching."""
    return (f"_The plot of dQ error against depth is not embedded: attach {escape(data.plot_name)} "
            f"({escape(data.plot_path)}) to the issue._")


__all__ = ["bisect_lines", "counts_markdown", "depth_markdown", "detail_lines", "escape", "report_markdown",
           "repro_lines", "results_markdown", "table"]
