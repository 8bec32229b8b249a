"""GitHub-flavoured markdown of a results document, for pasting into a TE / cuDNN / Megatron-LM issue.

A maintainer must see in ten seconds: which GPU and versions, which kernel path is wrong, on which case, how
wrong, and how to reproduce it. So: the verdict first, the environment as a compact table, the results
with failing rows first, the reproduce commands, and the long details folded into <details> blocks.
"""

from __future__ import annotations

from attn_doctor.numerics.masks import describe
from attn_doctor.render.env_view import env_markdown
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
from attn_doctor.results.row import Row
from attn_doctor.verdict.depth import depth_lines
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
    return f"**{row.verdict}**" if row.verdict in ("FAIL", "ERROR") else row.verdict


def _repeats(row: Row) -> str:
    text = escape(repeats_cell(row))
    return f"**{text}**" if row.differing_tensors else text


def results_markdown(rows: list[Row]) -> str:
    names = tensor_names(rows)
    shown_rows = call_rows(rows)
    tp_distance = any("dq_vs_tp1" in r.extra for r in shown_rows)
    repeated = has_repeats(shown_rows)  # the column only when some call ran more than once (--repeats)
    header = ["backend", "ran", "layout", "case"] + [f"{TENSOR_TITLES[n]} err (×base)" for n in names] + [
        "dQ err / ε"] + (["‖dQ − dQ_TP1‖ / ‖dQ_TP1‖"] if tp_distance else []) + (
        ["repeats"] if repeated else []) + ["verdict"]
    body = []
    for row, layout in sort_rows(display_rows(shown_rows)):
        ran = row.ran if row.tensors else ("skipped, see below" if row.verdict == "SKIP" else row.reason)
        knobs = row.case.short() + row.coords.text()
        distance = [sci(row.extra["dq_vs_tp1"]) if "dq_vs_tp1" in row.extra else ""] if tp_distance else []
        repeats = [_repeats(row)] if repeated else []
        body.append([escape(row.backend), escape(ran), escape(layout), escape(knobs)]
                    + [tensor_text(row, n) for n in names] + [dq_in_eps(row)] + distance + repeats + [_verdict(row)])
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
    report = data.report
    parts = ["## attn-doctor report", "", f"**Verdict:** {escape(report.summary)}", ""]
    if report.seconds.get("points"):
        parts += [f"**Sweep:** {report.seconds['points']:.0f} cases in {report.seconds['wall']:.0f} s "
                  f"({report.seconds['points per minute']:.1f} cases per minute).", ""]
    if data.known:
        parts += ["**Known defects matching this machine and case:**", ""]
        parts += [f"- {escape(text)}" for text in data.known] + [""]
    if report.env is not None:
        rows = [[escape(label), escape(value)] for label, value in compact_env(report.env)]
        parts += ["### Environment", "", table(["", ""], rows), ""]
    cases = list(dict.fromkeys(row.case for row in report.rows))
    if len(cases) == 1:
        parts += ["**Case:** " + escape(cases[0].short()) + ". " + escape("; ".join(describe(cases[0]))) + ".", ""]
    writes = [row for row in report.rows if row.padding_writes]
    if writes:
        parts += ["**Writes into padding** (flagged, not failed; TE's kernels write zeros there):", ""]
        parts += [f"- {escape(row.backend)} on {escape(row.layout)} ({escape(row.case.short())}): " + ", ".join(
            f"{TENSOR_TITLES.get(n, n)} {nonzero} of {values} values" for n, (nonzero, values) in row.padding_writes.items())
            for row in writes] + [""]
    results = results_markdown(report.rows)
    if results:
        parts += ["### Results", "",
                  "Relative L2 error against float64 (computed from the same low-precision inputs), in parentheses "
                  "its ratio to the Megatron-local baseline's error on the same inputs; ε is the dtype's machine "
                  f"epsilon. {rule_sentence()} {CANCELLED_NOTE}." + (f" {REPEATS_NOTE}" if has_repeats(report.rows) else ""),
                  "", results, ""]
    depth = depth_markdown(report.rows)
    if depth:
        parts += ["### dQ against depth", "",
                  "dQ of a Megatron-style GPT stack with this backend as core attention, against the stack's "
                  "float64 replica; the last two columns are distances between implementations, the quantity the "
                  "bug reports measured.", "", depth, ""]
        if data.plot_name:
            parts += [f"![dQ error against depth]({data.plot_name})", ""]
    failing = data.failing
    if failing:
        parts += ["### Reproduce", ""]
        for command in data.repro_commands:
            parts += ["```bash", command, "```"]
        parts.append("")
        parts += ["<details><summary>Why each failing row failed</summary>", ""]
        for row in failing:
            head = f"- {escape(row.backend)} on {escape(row.layout)} ({escape(row.case.short())})"
            whys = [(name, t.why) for name, t in row.tensors.items() if t.verdict == "FAIL" and t.why]
            if whys:  # one line per failing tensor: its error, its yardstick, and why that yardstick
                parts.append(f"{head}:")
                parts += [f"  - {name}: {escape(why)}" for name, why in whys]
            else:
                parts.append(f"{head}: {escape(row.reason)}")
        parts += ["", "</details>", ""]
    skipped = data.skipped
    if skipped:
        parts += ["<details><summary>Skipped paths and why</summary>", ""]
        for row, layout in skipped:
            parts.append(f"- {escape(row.backend)} ({'all layouts' if layout == 'all' else escape(layout)}): "
                         f"{escape(row.reason)}")
        parts += ["", "</details>", ""]
    details = [row for row in failing if row.detail]
    if details:
        parts += ["<details><summary>Error details</summary>", ""]
        for row in details:
            parts += [f"{escape(row.backend)} on {escape(row.layout)}:", "", FENCE,
                      row.detail.strip().replace(FENCE, "` ` `"), FENCE, ""]
        parts += ["</details>", ""]
    if report.env is not None:
        parts += ["<details><summary>Full environment</summary>", "", env_markdown(report.env), "", "</details>", ""]
    made = ", ".join(escape(x) for x in (f"attn-doctor {report.tool_version}" if report.tool_version else "",
                                         report.created) if x)
    parts += [f"<sub>{escape(report.command)}{' — ' + made if made else ''}</sub>", ""]
    return "\n".join(parts)


__all__ = ["depth_markdown", "escape", "report_markdown", "results_markdown", "table"]
