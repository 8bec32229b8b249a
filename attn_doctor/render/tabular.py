"""CSV of a results document: one row per backend x case x tensor (pandas)."""

from __future__ import annotations

import pandas as pd

from attn_doctor.results.report import RunReport


def results_frame(report: RunReport) -> pd.DataFrame:
    records = []
    # The input distribution gets its column when some row is not on normal inputs (a document of normal
    # inputs alone keeps the columns it always had).
    any_inputs = any(row.case.inputs != "normal" for row in report.rows)
    any_repeats = any(row.repeats for row in report.rows)  # likewise the repeats' columns (--repeats)
    for row in report.rows:
        case = row.case.to_dict()
        if any_inputs:
            case.setdefault("inputs", row.case.inputs)
        base = {
            "backend": row.backend,
            "family": row.family,
            "ran": row.ran,
            "layout": row.layout,
            **{f"case_{k}": (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in case.items()},
            **{f"coord_{k}": v for k, v in row.coords.params().items()},
            "row_verdict": row.verdict,
        }
        if not row.tensors:
            records.append({**base, "tensor": "", "verdict": row.verdict, "reason": row.reason})
            continue
        for name, t in row.tensors.items():
            records.append({**base, "tensor": name, **t.to_dict(), **(_repeats(row, name) if any_repeats else {})})
    return pd.DataFrame.from_records(records)


def _repeats(row, name: str) -> dict:
    """A tensor's repeats: how many calls, whether all were bitwise identical, their spread."""
    facts = row.repeats
    if facts is None:
        return {"repeats": 1}
    return {"repeats": facts["n"], "bitwise_identical": facts.get("identical", {}).get(name),
            "repeat_spread": facts.get("spread", {}).get(name)}


def report_csv(report: RunReport) -> str:
    return results_frame(report).to_csv(index=False, float_format="%.6g")
