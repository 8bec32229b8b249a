"""Rich rendering of a run: the results table and the closing verdict sentence."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from attn_doctor.render.format import TENSOR_TITLES, display_rows, tensor_cell
from attn_doctor.results.document import Row
from attn_doctor.verdict.rule import TENSORS

VERDICT_STYLE = {"PASS": "green", "FAIL": "bold red", "ERROR": "bold magenta", "SKIP": "dim"}


def results_table(rows: list[Row], title: str | None = None) -> Table:
    """One row per backend x layout: what ran, error vs float64 (ratio to the baseline), verdict."""
    table = Table(title=title, box=box.SIMPLE_HEAD, header_style="bold", caption=(
        "err: relative L2 error vs float64; ×: ratio to the local baseline's error; FAIL above 3× (or NaN/Inf)"))
    table.add_column("backend", no_wrap=True)
    table.add_column("layout", no_wrap=True)
    table.add_column("ran", ratio=1, min_width=26)
    for name in TENSORS:
        table.add_column(f"{TENSOR_TITLES[name]} err ×", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for row, layout in display_rows(rows):
        if row.tensors:
            cells = []
            for name in TENSORS:
                failed = row.tensors.get(name) is not None and row.tensors[name].verdict == "FAIL"
                cells.append(Text(tensor_cell(row, name), style="red" if failed else ""))
            ran = row.ran
        else:
            cells = [Text("")] * len(TENSORS)
            ran = Text("see below", style="dim")
        table.add_row(row.backend, layout, ran, *cells, Text(row.verdict, style=VERDICT_STYLE.get(row.verdict, "")))
    return table


def notes_lines(rows: list[Row]) -> list[Text]:
    """The reasons of SKIP and ERROR rows, one line each, for under the table."""
    lines = []
    for row, layout in display_rows(rows):
        if row.verdict in ("SKIP", "ERROR") and not row.tensors:
            where = "all layouts" if layout == "all" else layout
            style = VERDICT_STYLE.get(row.verdict, "")
            lines.append(Text.assemble((f"{row.verdict} ", style), f"{row.backend} ({where}): {row.reason}"))
    return lines


def tally_table(tallies) -> Table:
    """Per backend: rows passing / failing / erroring / skipped, and the failing cases."""
    table = Table(title="sweep summary", box=box.SIMPLE_HEAD, header_style="bold")
    for name in ("backend", "pass", "fail", "error", "skip"):
        table.add_column(name, justify="left" if name == "backend" else "right", no_wrap=True)
    table.add_column("failing cases", ratio=1)
    for t in tallies:
        failing = "\n".join(t.failing_cases[:8]) + (f"\n… {len(t.failing_cases) - 8} more" if len(t.failing_cases) > 8 else "")
        table.add_row(t.backend, str(t.passed), Text(str(t.failed), style="red" if t.failed else ""),
                      Text(str(t.errors), style="magenta" if t.errors else ""), str(t.skipped), failing)
    return table


def depth_table(lines) -> Table:
    """dQ error at the first and last layer per backend and depth, against the baseline and pairwise."""
    from attn_doctor.render.format import ratio, sci

    table = Table(title="dQ against depth", box=box.SIMPLE_HEAD, header_style="bold")
    for name in ("backend", "TP", "layers", "dQ err L1", "dQ err last", "local dQ err L1", "× base",
                 "‖dQ−dQ_local‖ L1", "‖dQ−dQ_TP1‖ L1", "verdict"):
        table.add_column(name, justify="left" if name == "backend" else "right", no_wrap=True)
    for line in lines:
        table.add_row(line.backend, str(line.tp), str(line.layers), sci(line.dq_first), sci(line.dq_last),
                      sci(line.baseline_dq_first), ratio(line.ratio), sci(line.vs_baseline),
                      sci(line.vs_tp1) if line.vs_tp1 is not None else "",
                      Text(line.verdict, style=VERDICT_STYLE.get(line.verdict, "")))
    return table


def bisect_tables(result, backend: str, diagnosis: dict) -> list:
    """The probes taken, the minimal failing case and the necessary conditions."""
    steps = Table(title=f"bisect of {backend}: probes", box=box.SIMPLE_HEAD, header_style="bold")
    for name in ("#", "knob", "tried", "configuration", "verdict", "still fails"):
        steps.add_column(name, no_wrap=name != "configuration")
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
    lines.append(Text(f"first wrong: {diagnosis.get('first_wrong')}"))
    if diagnosis.get("first_layer_out_of_band") is not None:
        lines.append(Text(f"first layer (from the deepest) whose dQ leaves 3× the baseline: "
                          f"{diagnosis['first_layer_out_of_band']}"))
    return lines
