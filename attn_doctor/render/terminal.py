"""Rich rendering of a run: the results table and the closing verdict sentence."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from attn_doctor.render.format import TENSOR_TITLES, display_rows, tensor_cell
from attn_doctor.results import Row
from attn_doctor.verdict import TENSORS

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
