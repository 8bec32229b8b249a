"""CSV of a results document: one row per backend x case x tensor (pandas)."""

from __future__ import annotations

import pandas as pd

from attn_doctor.results.report import RunReport


def results_frame(report: RunReport) -> pd.DataFrame:
    records = []
    for row in report.rows:
        base = {
            "backend": row.backend,
            "family": row.family,
            "ran": row.ran,
            "layout": row.layout,
            **{f"case_{k}": (",".join(map(str, v)) if isinstance(v, list) else v) for k, v in row.case.to_dict().items()},
            **{f"coord_{k}": v for k, v in row.coords.params().items()},
            "row_verdict": row.verdict,
        }
        if not row.tensors:
            records.append({**base, "tensor": "", "verdict": row.verdict, "reason": row.reason})
            continue
        for name, t in row.tensors.items():
            records.append({**base, "tensor": name, **t.to_dict()})
    return pd.DataFrame.from_records(records)


def report_csv(report: RunReport) -> str:
    return results_frame(report).to_csv(index=False, float_format="%.6g")
