"""Number and row formatting shared by the terminal table and the reports."""

from __future__ import annotations

import math

from attn_doctor.results.row import Row
from attn_doctor.verdict.rule import TensorVerdict

TENSOR_TITLES = {"out": "out", "dq": "dQ", "dk": "dK", "dv": "dV", "dsink": "dSink", "max_logit": "logit"}  # the max logit


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


def error_text(t: TensorVerdict) -> str:
    """A tensor's error as tables show it: relative to float64, or, marked *, to its terms' scale where the
    exact tensor cancels (see `attn_doctor.verdict.rule`)."""
    return sci(t.shown_err) + ("*" if t.cancelled else "")


def ratio_text(t: TensorVerdict) -> str:
    """The ratio to the yardstick, marked ~ when the verdict is borderline."""
    return ratio(t.ratio) + ("~" if t.borderline else "")


CANCELLED_NOTE = ("*: the exact tensor cancels (its norm is below 1/16 of its terms'), so the error is "
                  "given against the terms' scale; ~: borderline, within 1.5× of the threshold")


def tensor_cell(row: Row, name: str, *, parens: bool = False) -> str:
    """A tensor's error and its ratio to the yardstick, e.g. "4.1e-3 1.00×" (or "4.1e-3 (1.00×)")."""
    t = row.tensors.get(name)
    if t is None:
        return ""
    text = f"{error_text(t)} ({ratio_text(t)})" if parens else f"{error_text(t)} {ratio_text(t)}"
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



# --- repeats (--repeats N): nothing of this shows for calls run once --------------------------------------

REPEATS_MARK = "≠ repeats"  # a table row whose repeats were not bitwise identical (fits the layout column)


def spread_text(row: Row) -> str:
    """The spread of each tensor whose repeats differ, e.g. "dQ 1.2e-7, dK 3.0e-8"."""
    facts = row.repeats or {}
    return ", ".join(f"{TENSOR_TITLES.get(name, name)} {sci(facts.get('spread', {}).get(name, math.nan))}"
                     for name in row.differing_tensors)


def repeats_cell(row: Row) -> str:
    """A report cell: "3 calls, bitwise identical", "3 calls differ: dQ 1.2e-7, ..." (each differing tensor's
    spread), or "" for a call run once."""
    facts = row.repeats
    if facts is None:
        return ""
    if not row.differing_tensors:
        return f"{facts['n']} calls, bitwise identical"
    return f"{facts['n']} calls differ: {spread_text(row)}"


def has_repeats(rows: list[Row]) -> bool:
    return any(row.repeats for row in rows)


REPEATS_NOTE = ("Repeats: each call ran N times on the same inputs and views (--repeats N), the errors and the "
                "verdict are each tensor's worst call's; where the calls were not bitwise identical, the largest "
                "relative L2 distance (float64) between a call and the first, per tensor.")
