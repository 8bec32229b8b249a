"""One self-contained HTML page of a results document: no external assets, the plot inlined, sortable
tables (a few lines of inline JavaScript), and every value taken from the results escaped."""

from __future__ import annotations

import base64
from html import escape

from attn_doctor.machine.env_rows import env_rows
from attn_doctor.render.format import (
    REPEATS_NOTE,
    TENSOR_TITLES,
    display_rows,
    error_text,
    has_repeats,
    ratio,
    ratio_text,
    repeats_cell,
    sci,
)
from attn_doctor.render.report_data import ReportData, call_rows, compact_env, dq_in_eps, sort_rows, tensor_names
from attn_doctor.results.bisect_record import BisectRecord
from attn_doctor.results.row import Row
from attn_doctor.verdict.depth import depth_lines

STYLE = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:0.9em}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3;cursor:pointer;user-select:none}
td.num{text-align:right;font-family:ui-monospace,monospace}
tr.FAIL td{background:#fde8e8} tr.ERROR td{background:#f6e6fa} tr.INCONCLUSIVE td{background:#fdf6e0}
tr.SKIP td{color:#888}
.FAILcell{color:#b00;font-weight:bold} .verdict{font-weight:bold}
pre{background:#f7f7f7;padding:8px;overflow-x:auto}
"""

SORT_SCRIPT = """
document.querySelectorAll('table.sortable th').forEach(function(th, col){
  th.addEventListener('click', function(){
    var table = th.closest('table'), body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var asc = th.dataset.dir !== 'asc'; th.dataset.dir = asc ? 'asc' : 'desc';
    rows.sort(function(a, b){
      var x = a.cells[col].dataset.sort || a.cells[col].textContent;
      var y = b.cells[col].dataset.sort || b.cells[col].textContent;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (!isNaN(nx) && !isNaN(ny)) ? nx - ny : x.localeCompare(y);
      return asc ? c : -c;
    });
    rows.forEach(function(r){ body.appendChild(r); });
  });
});
"""


def _cell(text: object, *, sort: float | None = None, css: str = "") -> str:
    attrs = f' class="{css}"' if css else ""
    if sort is not None and sort == sort:
        attrs += f' data-sort="{sort:.6g}"'
    return f"<td{attrs}>{escape(str(text))}</td>"


def _table(header: list[str], rows: list[str], sortable: bool = True) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    css = ' class="sortable"' if sortable else ""
    return f"<table{css}><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _results_table(rows: list[Row]) -> str:
    names = tensor_names(rows)
    repeated = has_repeats(rows)  # the column only when some call ran more than once (--repeats)
    header = ["backend", "ran", "layout", "case"] + [f"{TENSOR_TITLES[n]} err" for n in names] + [
        f"{TENSOR_TITLES[n]} ×base" for n in names] + ["dQ err / ε"] + (["repeats"] if repeated else []) + [
        "verdict"]
    out = []
    for row, layout in sort_rows(display_rows(call_rows(rows))):
        cells = [_cell(row.backend), _cell(row.ran if row.tensors else row.reason), _cell(layout),
                 _cell(row.case.short() + row.coords.text())]
        for n in names:
            t = row.tensors.get(n)
            cells.append(_cell(error_text(t) if t else "", sort=t.shown_err if t else None,
                               css="num FAILcell" if t and t.verdict == "FAIL" else "num"))
        for n in names:
            t = row.tensors.get(n)
            cells.append(_cell(ratio_text(t) if t else "", sort=t.ratio if t else None, css="num"))
        cells.append(_cell(dq_in_eps(row), css="num"))
        if repeated:
            cells.append(_cell(repeats_cell(row), css="FAILcell" if row.differing_tensors else ""))
        cells.append(_cell(row.verdict, css="verdict"))
        out.append(f'<tr class="{escape(row.verdict)}">{"".join(cells)}</tr>')
    return _table(header, out)


def _depth_table(rows: list[Row]) -> str:
    body = []
    for d in depth_lines(rows):
        body.append(f'<tr class="{escape(d.verdict)}">' + "".join([
            _cell(d.backend), _cell(d.tp, css="num"), _cell(d.layers, css="num"),
            _cell(sci(d.dq_first), sort=d.dq_first, css="num"), _cell(sci(d.dq_last), sort=d.dq_last, css="num"),
            _cell(sci(d.baseline_dq_first), sort=d.baseline_dq_first, css="num"),
            _cell(ratio(d.ratio), sort=d.ratio, css="num"), _cell(sci(d.vs_baseline), sort=d.vs_baseline, css="num"),
            _cell(sci(d.vs_tp1) if d.vs_tp1 is not None else "", css="num"), _cell(d.verdict, css="verdict"),
        ]) + "</tr>")
    if not body:
        return ""
    header = ["backend", "TP", "layers", "dQ err L1", "dQ err last", "local dQ err L1", "×base",
              "‖dQ−dQ_local‖", "‖dQ−dQ_TP1‖", "verdict"]
    return _table(header, body)


def _bisect_html(bisect: BisectRecord) -> str:
    """What a bisect found: the minimal case, the conditions it needs, its diagnosis and its repro, folded."""
    conditions = "".join(f"<li>{escape(c.knob)}: {escape(c.clause())}</li>" for c in bisect.necessary)
    changes = "".join(f"<li>{escape(c.sentence())}</li>" for c in bisect.changes)
    facts = "".join(f"<li>{escape(label)}: {escape(str(value))}</li>" for label, value in (
        ("First wrong", bisect.diagnosis.get("first_wrong")),
        ("Checked on a correct path", bisect.diagnosis.get("minimal_case_checked"))) if value)
    repro = (f"<details><summary>{escape(bisect.repro_name)}</summary><pre>{escape(bisect.repro)}</pre></details>"
             if bisect.repro else "")
    return (f"<h2>Bisect of {escape(bisect.tested)}</h2><p>Shrank {escape(bisect.start.describe())} to "
            f"<strong>{escape(bisect.minimal.describe())}</strong>, which still fails the same way.</p>"
            + (f"<p>Necessary conditions:</p><ul>{conditions}</ul>" if conditions else
               "<p>No condition is necessary among the knobs attn-doctor turns.</p>")
            + (f"<p>Simplifications that changed the failure (neither a condition nor kept):</p><ul>{changes}</ul>"
               if changes else "")
            + (f"<ul>{facts}</ul>" if facts else "") + repro)


def report_html(data: ReportData) -> str:
    report = data.report
    parts = [f"<h1>attn-doctor report</h1><p><strong>Verdict:</strong> {escape(report.summary)}</p>"]
    if data.builds_sentence:
        parts.append(f"<p><strong>Builds:</strong> {escape(data.builds_sentence)}</p>")
    parts += [f"<p><strong>Note:</strong> {escape(note)}.</p>" for note in report.notes]
    if data.known:
        items = "".join(f"<li>{escape(text)}</li>" for text in data.known)
        parts.append(f"<p><strong>Known defects matching this machine and case:</strong></p><ul>{items}</ul>")
    if report.env is not None:
        rows = [f"<tr>{_cell(label)}{_cell(value)}</tr>" for label, value in compact_env(report.env)]
        parts.append("<h2>Environment</h2>" + _table(["fact", "value"], rows, sortable=False))
    parts += [_bisect_html(bisect) for bisect in data.bisects]
    if call_rows(report.rows):
        parts.append("<h2>Results</h2><p>Relative L2 error against float64; ×base is the ratio to the Megatron-local "
                     "baseline's error on the same inputs. Click a column to sort."
                     + (f" {escape(REPEATS_NOTE)}" if has_repeats(report.rows) else "") + "</p>"
                     + _results_table(report.rows))
    depth = _depth_table(report.rows)
    if depth:
        parts.append("<h2>dQ against depth</h2>" + depth)
        if data.plot_path is not None:
            encoded = base64.b64encode(data.plot_path.read_bytes()).decode()
            parts.append(f'<img alt="dQ error against depth" src="data:image/png;base64,{encoded}">')
        elif data.refused_plot is not None:
            parts.append(f"<p>The results document names a plot outside its folder ({escape(data.refused_plot)}): "
                         "not embedded.</p>")
    failing = data.failing
    if failing:
        commands = "".join(f"<pre>{escape(c)}</pre>" for c in data.repro_commands)
        reasons = "".join(f"<li><code>{escape(r.backend)}</code> on <code>{escape(r.layout)}</code> "
                          f"({escape(r.case.short())}): {escape(r.reason)}</li>" for r in failing)
        parts.append(f"<h2>Reproduce</h2>{commands}<details><summary>Why each failing row failed</summary>"
                     f"<ul>{reasons}</ul></details>")
    skipped = data.skipped
    if skipped:
        items = "".join(f"<li><code>{escape(r.backend)}</code> ({escape('all layouts' if layout == 'all' else layout)}): "
                        f"{escape(r.reason)}</li>" for r, layout in skipped)
        parts.append(f"<details><summary>Skipped paths and why</summary><ul>{items}</ul></details>")
    details = "".join(f"<p><code>{escape(r.backend)}</code> on <code>{escape(r.layout)}</code>:</p>"
                      f"<pre>{escape(r.detail.strip())}</pre>" for r in failing if r.detail)
    if details:
        parts.append(f"<details><summary>Error details</summary>{details}</details>")
    if report.env is not None:
        rows = [f"<tr>{_cell(label)}{_cell(value)}</tr>" for label, value in env_rows(report.env)]
        parts.append("<details><summary>Full environment</summary>" + _table(["fact", "value"], rows, False)
                     + "</details>")
    parts.append(f"<p><small>{escape(report.command)} — attn-doctor {escape(report.tool_version)}, "
                 f"{escape(report.created)}</small></p>")
    body = "\n".join(parts)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>attn-doctor report</title>'
            f"<style>{STYLE}</style></head>\n<body>\n{body}\n<script>{SORT_SCRIPT}</script>\n</body></html>\n")
