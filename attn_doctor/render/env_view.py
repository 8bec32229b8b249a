"""Presentation of an :class:`~attn_doctor.machine.fingerprint.EnvReport`: a rich table, Markdown (its rows are
`attn_doctor.machine.env_rows`)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from attn_doctor.machine.env_rows import NONE_SET, Kind, labelled_facts
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.render.format import md_escape

_STYLE: dict[Kind, str] = {"ok": "", "warn": "yellow", "missing": "dim"}


def env_rich_table(env: EnvReport) -> Table:
    """A two-column rich table; warnings in yellow, missing facts dimmed."""
    table = Table(title="Environment", show_header=True, header_style="bold")
    table.add_column("fact", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for label, value, kind in labelled_facts(env):
        table.add_row(label, Text(value, style=_STYLE[kind]))
    return table


def env_markdown(env: EnvReport) -> str:
    """A GitHub Markdown table ``| fact | value |`` ready to paste into an issue."""
    lines = ["| fact | value |", "| --- | --- |"]
    for label, value, _ in labelled_facts(env):
        if label == "env vars":
            cell = "<br>".join(md_escape(f"{k}={v}") for k, v in env.env_vars.items()) or f"*{NONE_SET}*"
        else:
            cell = md_escape(value)
        lines.append(f"| {md_escape(label)} | {cell} |")
    return "\n".join(lines) + "\n"
