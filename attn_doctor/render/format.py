"""Number and row formatting shared by the terminal table and the reports."""

from __future__ import annotations

import math

from attn_doctor.results.row import Row

TENSOR_TITLES = {"out": "out", "dq": "dQ", "dk": "dK", "dv": "dV"}


def sci(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if math.isinf(value):
        return "inf"
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def ratio(value: float) -> str:
    if value is None or math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "inf×"
    return f"{value:.2f}×" if value < 10 else f"{value:.0f}×"


def tensor_cell(row: Row, name: str, *, parens: bool = False) -> str:
    """A tensor's error and its ratio to the baseline, e.g. "4.1e-3 1.00×" (or "4.1e-3 (1.00×)")."""
    t = row.tensors.get(name)
    if t is None:
        return ""
    text = f"{sci(t.rel_err)} ({ratio(t.ratio)})" if parens else f"{sci(t.rel_err)} {ratio(t.ratio)}"
    if t.nan or t.inf:
        text += f" NaN {t.nan}, Inf {t.inf}"
    return text


def display_rows(rows: list[Row]) -> list[tuple[Row, str]]:
    """Rows to show, with their layout label: a backend skipped on every layout for one reason is one row."""
    shown: list[tuple[Row, str]] = []
    by_backend: dict[tuple, list[Row]] = {}
    for row in rows:
        by_backend.setdefault((row.backend, row.case.key(), tuple(row.coords.params().items())), []).append(row)
    for group in by_backend.values():
        if len(group) > 1 and all(r.verdict == "SKIP" for r in group) and len({r.reason for r in group}) == 1:
            shown.append((group[0], "all"))
        else:
            shown.extend((r, r.layout) for r in group)
    return shown


def md_escape(text: object) -> str:
    """Text made inert inside a GitHub markdown table cell or list item: HTML entities and tags, emphasis,
    code spans, pipes and line breaks."""
    text = str(text).replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("&", "&amp;").replace("<", "&lt;")
    for char in ("\\", "|", "*", "`"):
        text = text.replace(char, "\\" + char)
    return text.replace("\n", "<br>")

