"""GitHub-flavoured markdown of a results document: verdict first, then environment, then the table."""

from __future__ import annotations

from attn_doctor.render.env_view import env_markdown
from attn_doctor.render.format import TENSOR_TITLES, display_rows, sci, tensor_cell
from attn_doctor.results import Row, RunReport
from attn_doctor.verdict import EPS, TENSORS


def escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(escape(cell) for cell in row) + " |" for row in body]
    return "\n".join(lines)


ORDER = {"FAIL": 0, "ERROR": 1, "PASS": 2, "SKIP": 3}


def results_markdown(rows: list[Row]) -> str:
    header = ["backend", "ran", "layout", "case"] + [f"{TENSOR_TITLES[t]} err (×base)" for t in TENSORS] + [
        "dQ err / ε", "verdict"]
    body = []
    shown = sorted(display_rows(rows), key=lambda pair: ORDER.get(pair[0].verdict, 9))
    for row, layout in shown:
        dq = row.tensors.get("dq")
        in_eps = f"{dq.rel_err / EPS[row.case.dtype]:.2f}" if dq is not None else ""
        ran = row.ran if row.tensors else row.reason
        verdict = f"**{row.verdict}**" if row.verdict in ("FAIL", "ERROR") else row.verdict
        body.append([row.backend, ran, layout, row.case.short()] + [tensor_cell(row, t) for t in TENSORS] + [
            in_eps, verdict])
    return table(header, body)


def report_markdown(report: RunReport) -> str:
    parts = ["# attn-doctor report", "", f"**Verdict:** {report.summary}", ""]
    parts += ["```", report.command, "```", ""]
    if report.env is not None:
        parts += ["## Environment", "", env_markdown(report.env), ""]
    parts += ["## Results", "",
              "Relative L2 error against float64 computed from the same low-precision inputs; in parentheses the "
              "ratio to the Megatron-local baseline's error on the same inputs. A tensor FAILs above 3× the "
              "baseline (plus a floor of 0.1 ε in bf16/fp16, 1 ε in fp32), or on NaN/Inf. ε is the dtype's machine epsilon.", "",
              results_markdown(report.rows), ""]
    failing = [row for row in report.rows if row.verdict in ("FAIL", "ERROR")]
    if failing:
        parts += ["## Why each failing row failed", ""]
        for row in failing:
            parts.append(f"- `{row.backend}` on `{row.layout}` ({row.case.short()}): {escape(row.reason)}")
        parts.append("")
    if report.seconds:
        timing = ", ".join(f"{k} {v:.1f} s" for k, v in report.seconds.items())
        parts += [f"<sub>attn-doctor {report.tool_version}, {report.created}; {timing}</sub>", ""]
    return "\n".join(parts)


__all__ = ["report_markdown", "results_markdown", "table", "escape", "sci"]
