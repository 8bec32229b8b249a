"""GitHub-flavoured markdown of a results document, for pasting into a TE / cuDNN / Megatron-LM issue.

A maintainer must see in ten seconds: which GPU and versions, which kernel path is wrong, on which case, how
wrong, and how to reproduce it. So: the verdict first, the environment as a compact table, the results
with failing rows first, the reproduce commands, and the long details folded into <details> blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

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


GITHUB_LIMIT = 65_536  # characters GitHub takes in an issue or comment body


@dataclass
class _Section:
    """A report section whose `items` (table rows, list entries) are shown in order while they fit its share
    of the page; `head` and `tail` are always shown. A table's items need `table=True`: a line after a table's
    rows must follow a blank line, or GitHub reads it as one more row."""

    head: list[str]
    items: list[str]
    tail: list[str]
    share: float
    table: bool = False

    def size(self, items: int | None = None) -> int:
        shown = self.items if items is None else self.items[:items]
        return sum(len(line) + 1 for line in (*self.head, *shown, *self.tail))

    def render(self, budget: int) -> list[str]:
        if self.size() <= budget:
            return [*self.head, *self.items, *self.tail]
        shown = 0
        while shown < len(self.items) and self.size(shown + 1) + 200 <= budget:
            shown += 1
        more = f"_… and {len(self.items) - shown} more, left out to fit GitHub's {GITHUB_LIMIT:,}-character limit: " \
               "`attn-doctor report RESULTS` shows them all._"
        return [*self.head, *self.items[:shown], *([""] if self.table else []), more, *self.tail]


def _fit(fixed: int, sections: list[_Section]) -> list[list[str]]:
    """Each section rendered within its share of what the fixed parts leave of GitHub's limit; what a section
    does not need goes to the others, in proportion to their shares."""
    room = max(GITHUB_LIMIT - fixed - 1_000, 0)  # 1,000: slack for the joins and the user's own words
    budgets = {i: room * s.share for i, s in enumerate(sections)}
    needy = {i for i, s in enumerate(sections) if s.size() > budgets[i]}
    spare = sum(budgets[i] - sections[i].size() for i in budgets if i not in needy)
    weight = sum(sections[i].share for i in needy)
    for i in needy:
        budgets[i] += spare * sections[i].share / weight
    return [s.render(int(budgets[i])) for i, s in enumerate(sections)]


def report_markdown(data: ReportData) -> str:
    """The whole report, within GitHub's limit: long lists are cut (failing rows come first) with a line
    saying how many were left out."""
    report = data.report
    top = ["## attn-doctor report", "", f"**Verdict:** {escape(report.summary)}", ""]
    if report.seconds.get("points"):
        top += [f"**Sweep:** {report.seconds['points']:.0f} cases in {report.seconds['wall']:.0f} s "
                f"({report.seconds['points per minute']:.1f} cases per minute).", ""]
    if data.known:
        top += ["**Known defects matching this machine and case:**", ""]
        top += [f"- {escape(text)}" for text in data.known] + [""]
    if report.env is not None:
        rows = [[escape(label), escape(value)] for label, value in compact_env(report.env)]
        top += ["### Environment", "", table(["", ""], rows), ""]
    cases = list(dict.fromkeys(row.case for row in report.rows))
    if len(cases) == 1:
        top += ["**Case:** " + escape(cases[0].short()) + ". " + escape("; ".join(describe(cases[0]))) + ".", ""]

    writes = _Section(["**Writes into padding** (flagged, not failed; TE's kernels write zeros there):", ""], [
        f"- {escape(row.backend)} on {escape(row.layout)} ({escape(row.case.short())}): " + ", ".join(
            f"{TENSOR_TITLES.get(n, n)} {nonzero} of {values} values" for n, (nonzero, values) in row.padding_writes.items())
        for row in report.rows if row.padding_writes], [""], share=0.05)
    results = results_markdown(report.rows).split("\n")
    results = _Section(["### Results", "",
                        "Relative L2 error against float64 (computed from the same low-precision inputs), in "
                        "parentheses its ratio to the Megatron-local baseline's error on the same inputs; ε is the "
                        f"dtype's machine epsilon. {rule_sentence()} {CANCELLED_NOTE}."
                        + (f" {REPEATS_NOTE}" if has_repeats(report.rows) else ""), "", *results[:2]],
                       results[2:], [""], share=0.40, table=True) if results != [""] else None
    depth = depth_markdown(report.rows).split("\n")
    depth = _Section(["### dQ against depth", "",
                      "dQ of a Megatron-style GPT stack with this backend as core attention, against the stack's "
                      "float64 replica; the last two columns are distances between implementations, the quantity "
                      "the bug reports measured.", "", *depth[:2]], depth[2:],
                     ["", f"![dQ error against depth]({data.plot_name})", ""] if data.plot_name else [""],
                     share=0.10, table=True) if depth != [""] else None
    failing = data.failing
    reproduce = _Section(["### Reproduce", ""], [f"{FENCE}bash\n{command}\n{FENCE}" for command in data.repro_commands],
                         [""], share=0.10)
    whys = []
    for row in failing:
        head = f"- {escape(row.backend)} on {escape(row.layout)} ({escape(row.case.short())})"
        failed = [(name, t.why) for name, t in row.tensors.items() if t.verdict == "FAIL" and t.why]
        # one entry per row: each failing tensor's error, its yardstick, and why that yardstick
        whys.append("\n".join([f"{head}:"] + [f"  - {name}: {escape(why)}" for name, why in failed]) if failed
                    else f"{head}: {escape(row.reason)}")
    whys = _Section(["<details><summary>Why each failing row failed</summary>", ""], whys, ["", "</details>", ""],
                    share=0.15)
    skipped = _Section(["<details><summary>Skipped paths and why</summary>", ""], [
        f"- {escape(row.backend)} ({'all layouts' if layout == 'all' else escape(layout)}): {escape(row.reason)}"
        for row, layout in data.skipped], ["", "</details>", ""], share=0.10)
    errors = _Section(["<details><summary>Error details</summary>", ""], [
        "\n".join([f"{escape(row.backend)} on {escape(row.layout)}:", "", FENCE,
                   row.detail.strip().replace(FENCE, "` ` `"), FENCE, ""]) for row in failing if row.detail],
        ["</details>", ""], share=0.10)
    bottom: list[str] = []
    if report.env is not None:
        bottom += ["<details><summary>Full environment</summary>", "", env_markdown(report.env), "", "</details>", ""]
    made = ", ".join(escape(x) for x in (f"attn-doctor {report.tool_version}" if report.tool_version else "",
                                         report.created) if x)
    bottom += [f"<sub>{escape(report.command)}{' — ' + made if made else ''}</sub>", ""]

    order = (writes, results, depth, reproduce if failing else None, whys, skipped, errors)
    sections = [s for s in order if s is not None and s.items]
    fitted = dict(zip(map(id, sections), _fit(sum(len(x) + 1 for x in top + bottom), sections)))
    return "\n".join(top + [line for s in order for line in fitted.get(id(s), [])] + bottom)


__all__ = ["depth_markdown", "escape", "report_markdown", "results_markdown", "table"]
