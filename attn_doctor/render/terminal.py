"""What `run`, `sweep` and `bisect` print, with rich: every number and every verdict fits an 80-column
terminal, a pipe and a CI log (`--wide` puts what ran back into a column, for a wide terminal).

The results table has one row per backend x layout and one column per tensor; each cell holds the
tensor's error against float64 over its ratio to the local baseline's error. What ran, the reasons of
SKIP and ERROR rows and the verdict sentence follow the table as lines, which wrap instead of being cut.
With --repeats, a row whose calls were not bitwise identical is marked "≠ repeats" under its layout, and a
line under the table gives the spread.
"""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from attn_doctor.numerics.masks import describe
from attn_doctor.render.format import (
    CANCELLED_NOTE,
    REPEATS_MARK,
    TENSOR_TITLES,
    display_rows,
    error_text,
    ratio,
    ratio_text,
    sci,
    tensor_cell,
)
from attn_doctor.render.report_data import tensor_names
from attn_doctor.results.row import Row
from attn_doctor.verdict.diagnosis import flash_style_notes
from attn_doctor.verdict.rule import TENSORS, floor_text, multiple_text

VERDICT_STYLE = {"PASS": "green", "FAIL": "bold red", "ERROR": "bold magenta", "INCONCLUSIVE": "bold yellow",
                 "SKIP": "dim", "TOO-BIG": "bold cyan"}


def _table(title: str | None = None, caption: str | None = None) -> Table:
    # Two spaces between columns and none at the edges: the widest row of every table here stays within 80.
    return Table(title=title, caption=caption, box=box.SIMPLE_HEAD, header_style="bold", padding=(0, 1, 0, 0),
                 pad_edge=False, show_edge=False)


def results_caption() -> str:
    return (f"err: relative L2 error vs float64, over ×: its ratio to the local baseline's error (never below "
            f"rounding noise, {floor_text()} of the terms' scale); FAIL above {multiple_text()}, on a systematic "
            f"error or on NaN/Inf; {CANCELLED_NOTE}")


def _cell(row: Row, name: str) -> Text:
    t = row.tensors.get(name)
    if t is None:
        return Text("")
    text = f"{error_text(t)}\n{ratio_text(t)}"
    if t.nan or t.inf:
        text += f"\nNaN {t.nan}\nInf {t.inf}"
    return Text(text, style="red" if t.verdict == "FAIL" else "")


def results_table(rows: list[Row], title: str | None = None, wide: bool = False) -> Table:
    """One row per backend x layout: error vs float64 and ratio to the baseline per tensor, and the verdict
    (`wide`: one line per row, with what ran in a column)."""
    if wide:
        return _wide_results_table(rows, title)
    table = _table(title, results_caption())
    table.add_column("backend", overflow="fold", max_width=24)
    table.add_column("layout", overflow="fold", min_width=12)
    names = tensor_names(rows)
    for name in names:
        table.add_column(f"{TENSOR_TITLES[name]} err\n×base", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for row, layout in display_rows(rows):
        where = f"{layout}\n{row.coords.label()}" if row.coords.label() else layout
        if row.differing_tensors:
            where += f"\n{REPEATS_MARK}"
        table.add_row(row.backend, where, *(_cell(row, name) for name in names),
                      Text(row.verdict, style=VERDICT_STYLE.get(row.verdict, "")))
    return table


def _wide_results_table(rows: list[Row], title: str | None) -> Table:
    table = Table(title=title, box=box.SIMPLE_HEAD, header_style="bold", caption=results_caption())
    table.add_column("backend", no_wrap=True)
    table.add_column("layout", no_wrap=True)
    table.add_column("ran", ratio=1, min_width=26)
    names = tensor_names(rows)
    for name in names:
        table.add_column(f"{TENSOR_TITLES[name]} err ×", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for row, layout in display_rows(rows):
        if row.tensors:
            cells = [Text(tensor_cell(row, name), style="red" if name in row.failing_tensors else "")
                     for name in names]
            ran = row.ran
        else:
            cells = [Text("")] * len(names)
            ran = Text("see below", style="dim")
        where = f"{layout}\n{REPEATS_MARK}" if row.differing_tensors else layout
        table.add_row(row.backend, where, ran, *cells, Text(row.verdict, style=VERDICT_STYLE.get(row.verdict, "")))
    return table


def ran_lines(rows: list[Row]) -> list[Text]:
    """What ran, read back from each library: one line per backend and distinct answer (its layouts when
    they differ)."""
    by_backend: dict[str, dict[str, list[str]]] = {}
    for row in rows:
        if row.ran and row.tensors:
            where = f"{row.layout}, {row.coords.label()}" if row.coords.label() else row.layout
            by_backend.setdefault(row.backend, {}).setdefault(row.ran, []).append(where)
    lines = []
    for backend, answers in by_backend.items():
        for ran, where in answers.items():
            on = f" (on {'; '.join(dict.fromkeys(where))})" if len(answers) > 1 else ""
            lines.append(Text.assemble(("ran ", "dim"), f"{backend}: {ran}{on}"))
    return lines


def notes_lines(rows: list[Row]) -> list[Text]:
    """The reasons of SKIP, ERROR and TOO-BIG rows, and of rows that could not be judged, one line each, for under
    the table."""
    lines = []
    for row, layout in display_rows(rows):
        if row.verdict in ("SKIP", "ERROR", "TOO-BIG") and not row.tensors or row.verdict == "INCONCLUSIVE":
            where = "all layouts" if layout == "all" else layout
            style = VERDICT_STYLE.get(row.verdict, "")
            lines.append(Text.assemble((f"{row.verdict} ", style), f"{row.backend} ({where}): {row.reason}"))
    return lines


def case_lines(rows: list[Row]) -> list[Text]:
    """What the call computes beyond its shapes (dropout, mask convention, slopes, lengths), for a run's one
    case."""
    cases = list(dict.fromkeys(row.case for row in rows))
    if len(cases) != 1:
        return []
    return [Text.assemble(("case ", "dim"), line) for line in describe(cases[0])]


def padding_lines(rows: list[Row]) -> list[Text]:
    """Rows that wrote non-zero values into padding: flagged, not failed (see attn_doctor.verdict.rule)."""
    lines = []
    for row in rows:
        writes = row.padding_writes
        if writes:
            what = ", ".join(f"{TENSOR_TITLES.get(n, n)} {nonzero} of {values}" for n, (nonzero, values) in writes.items())
            lines.append(Text.assemble(("PADDING ", "yellow"), f"{row.backend} ({row.layout}) writes non-zero values "
                                       f"into padding ({what}); TE's kernels write zeros there"))
    return lines


def flash_style_lines(rows: list[Row]) -> list[Text]:
    """Flash-style paths that pass on what a correct flash-style backward gets (`verdict.diagnosis`)."""
    return [Text.assemble(("flash-style ", "dim"), note) for note in flash_style_notes(rows)]


FAILURE_LINES = 12  # at most this many "why" lines under a run's table; the report has all of them


def failure_lines(rows: list[Row], limit: int = FAILURE_LINES) -> list[Text]:
    """Why each failing tensor failed, one line each: its error, the yardstick it was compared with, and why
    that yardstick."""
    lines = []
    for row in rows:
        located = row.extra.get("layer", {}).get("where") if isinstance(row.extra.get("layer"), dict) else ""
        if located and row.verdict == "FAIL":  # a layer path's row: where in the layer (`attn_doctor.verdict.layer`)
            lines.append(Text.assemble(("FAIL ", VERDICT_STYLE["FAIL"]), f"{row.backend} ({row.layout}): {located}"))
        for name, t in row.tensors.items():
            if t.verdict == "FAIL":
                where = f"{row.layout}, {row.coords.label()}" if row.coords.label() else row.layout
                lines.append(Text.assemble(("FAIL ", VERDICT_STYLE["FAIL"]), f"{row.backend} ({where}) {name}: {t.why}"))
    if len(lines) > limit:
        lines = lines[:limit] + [Text(f"... and {len(lines) - limit} more failing tensors: see the report")]
    return lines


def repeat_lines(rows: list[Row]) -> list[Text]:
    """With --repeats: the paths whose repeats were all bitwise identical, on one line, then one line per
    path that was not bitwise reproducible, where, and its largest spread per tensor. Nothing for calls run
    once."""
    by_backend: dict[str, list[Row]] = {}
    for row in rows:
        if row.repeats:
            by_backend.setdefault(row.backend, []).append(row)
    if not by_backend:
        return []
    calls = "/".join(str(n) for n in sorted({r.repeats["n"] for group in by_backend.values() for r in group}))
    same = [backend for backend, group in by_backend.items() if not any(r.differing_tensors for r in group)]
    lines = []
    if same:
        lines.append(Text.assemble(("bitwise identical ", "dim"), f"over {calls} calls: {', '.join(same)}"))
    for backend, group in by_backend.items():
        differ = [r for r in group if r.differing_tensors]
        if not differ:
            continue
        spread = {name: max(r.repeats["spread"].get(name, 0.0) for r in differ if name in r.differing_tensors)
                  for name in TENSORS if any(name in r.differing_tensors for r in differ)}
        one_case = len({r.case.key() for r in group}) == 1
        where = (", ".join(dict.fromkeys(r.layout for r in differ)) if one_case
                 else f"{len(differ)} of {len(group)} probes")
        mode = " (TE deterministic mode on)" if any(r.extra.get("deterministic", {}).get("honoured")
                                                    for r in differ) else ""
        spreads = ", ".join(f"{name} {sci(value)}" for name, value in spread.items())
        lines.append(Text.assemble((f"{REPEATS_MARK} ", "bold yellow"),
                                   f"{backend}{mode}: not bitwise reproducible over {calls} calls on {where}; "
                                   f"largest relative distance to the first call: {spreads}"))
    return lines


def summary_text(report) -> Text:
    return Text(report.summary, style="bold red" if report.faulty else "bold green")


def run_view(report, title: str, wide: bool = False) -> list:
    """`run`'s output after the environment: the table, what ran, why rows were skipped, the verdict."""
    views: list = [results_table(report.rows, title=title, wide=wide)]
    if not wide:
        views += ran_lines(report.rows)
    views += repeat_lines(report.rows)
    views += notes_lines(report.rows)
    views += case_lines(report.rows)
    views += padding_lines(report.rows)
    views += flash_style_lines(report.rows)
    views += failure_lines(report.rows)
    views.append(summary_text(report))
    return views


def tally_table(tallies) -> Table:
    """Per backend: rows passing / failing / erroring / could not be judged (when any) / skipped / too big for the
    memory budget (when any), and the failing cases."""
    table = _table("sweep summary")
    undecided = any(t.inconclusive for t in tallies)
    too_big = any(t.too_big for t in tallies)
    for name in ("backend", "pass", "fail", "error", *(["unsure"] if undecided else []), "skip",
                 *(["too big"] if too_big else [])):
        table.add_column(name, justify="left" if name == "backend" else "right", no_wrap=name != "backend",
                         overflow="fold")
    table.add_column("failing cases", ratio=1, overflow="fold")
    for t in tallies:
        failing = "\n".join(t.failing_cases[:8]) + (f"\n… {len(t.failing_cases) - 8} more" if len(t.failing_cases) > 8 else "")
        unsure = [Text(str(t.inconclusive), style="yellow" if t.inconclusive else "")] if undecided else []
        table.add_row(t.backend, str(t.passed), Text(str(t.failed), style="red" if t.failed else ""),
                      Text(str(t.errors), style="magenta" if t.errors else ""), *unsure, str(t.skipped),
                      *([Text(str(t.too_big), style="cyan" if t.too_big else "")] if too_big else []), failing)
    return table


def depth_table(lines) -> Table:
    """dQ error at the first and last layer per backend and depth, against the baseline and pairwise (the TP
    columns only when a TP degree above 1 ran)."""
    with_tp = any(line.tp > 1 for line in lines)
    table = _table("dQ against depth", "L: layers; err: dQ relative error vs the stack's float64 replica at the "
                   "first layer (L1) and the last; vs local, vs TP1: relative distance to the local baseline's dQ "
                   "and to TP=1's at L1")
    columns = ["backend", *(["TP"] if with_tp else []), "L", "err\nL1", "err\nlast", "local\nL1", "×base",
               "vs\nlocal", *(["vs\nTP1"] if with_tp else []), "verdict"]
    for name in columns:
        table.add_column(name, justify="left" if name == "backend" else "right", no_wrap=name != "backend",
                         overflow="fold", max_width=18 if name == "backend" else None)
    for line in lines:
        cells = [line.backend, *([str(line.tp)] if with_tp else []), str(line.layers), sci(line.dq_first),
                 sci(line.dq_last), sci(line.baseline_dq_first), ratio(line.ratio), sci(line.vs_baseline)]
        if with_tp:
            cells.append(sci(line.vs_tp1) if line.vs_tp1 is not None else "")
        table.add_row(*cells, Text(line.verdict, style=VERDICT_STYLE.get(line.verdict, "")))
    return table


def sweep_view(report) -> list:
    """`sweep`'s (and `replay`'s) output: per-backend counts, the depth table, the ERROR and TOO-BIG rows'
    reasons, the flash-style paths that pass on their own output rounding, the verdict."""
    from attn_doctor.verdict.diagnosis import tally

    views: list = [tally_table(tally(report.rows))]
    if report.depth_lines:
        views.append(depth_table(report.depth_lines))
    views += repeat_lines(report.rows)
    views += notes_lines([r for r in report.rows if r.verdict in ("ERROR", "TOO-BIG")])
    views += flash_style_lines(report.rows)
    if report.seconds.get("points"):
        views.append(Text(f"{report.seconds['points']:.0f} cases in {report.seconds['wall']:.0f} s from the command's "
                          f"start: {report.seconds['points per minute']:.1f} cases per minute", style="dim"))
    views.append(summary_text(report))
    return views


def bisect_tables(result, backend: str, diagnosis: dict) -> list:
    """The probes taken, the minimal failing case and the necessary conditions."""
    steps = _table(f"bisect of {backend}: probes")
    for name in ("#", "knob", "tried", "configuration", "verdict", "still fails"):
        steps.add_column(name, no_wrap=name not in ("configuration", "tried"), overflow="fold",
                         ratio=1 if name == "configuration" else None)
    for number, step in enumerate(result.steps):
        steps.add_row(str(number), step.knob, step.tried, step.config,
                      Text(step.verdict, style=VERDICT_STYLE.get(step.verdict, "")), "yes" if step.fails else "no")
    lines = [steps, Text.assemble(("minimal failing case: ", "bold"), result.minimal.describe(),
                                  f"  [{result.minimal_outcome.verdict}: {result.minimal_outcome.reason[:160]}]")]
    if result.necessary:
        lines.append(Text("necessary conditions:", style="bold"))
        lines += [Text(f"  {c.sentence()}") for c in result.necessary]
    else:
        lines.append(Text("necessary conditions: none — it fails on the plainest case tried", style="bold"))
    if result.changes:
        lines.append(Text("changed the failure instead of removing it (not conditions):", style="bold"))
        lines += [Text(f"  {c.sentence()}") for c in result.changes]
    lines.append(Text(f"first wrong: {diagnosis.get('first_wrong')}"))
    if diagnosis.get("minimal_case_checked"):
        lines.append(Text(f"minimal case checked on a correct path: {diagnosis['minimal_case_checked']}"))
    if diagnosis.get("first_layer_out_of_band") is not None:
        lines.append(Text(f"first layer (from the deepest) whose dQ leaves {multiple_text()} the baseline: "
                          f"{diagnosis['first_layer_out_of_band']}"))
    return lines
