"""Summarise the first TE-coverage sweep on the H200 (coverage-first/results.jsonl.gz): per case, the paths that
FAIL or ERROR, and whether the TE rows of that case are valid evidence.

The sweep ran with two wiring bugs in attn-doctor's TE backend, found in this very output and fixed after it
(tests/test_te_wiring.py now checks the wiring on the CPU): q, k, v of bshd and thd cases were built in sbhd
while TE was told bshd/thd (TE's bshd rows are wrong by construction; its thd rows are SKIP with TE's "must be
3D tensors"). TE rows of sbhd cases, and every row of the non-TE paths (local, SDPA), are valid.

    python3 reports/h200/api/summarise.py > reports/h200/api/summary.txt
"""

import collections
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from attn_doctor.core.case import Case  # noqa: E402

rows = [json.loads(line) for line in gzip.open(Path(__file__).parent / "coverage-first" / "results.jsonl.gz", "rt")]
by_case: dict = collections.OrderedDict()
for row in rows:
    by_case.setdefault(Case.from_dict(row["case"]), []).append(row)
print(f"{len(rows)} rows, {len(by_case)} cases (of 211: the sweep was stopped after two device calls)\n")
for case, case_rows in by_case.items():
    te_valid = case.qkv_format == "sbhd"
    verdicts = collections.defaultdict(set)
    for row in case_rows:
        verdicts[row["verdict"]].add(row["backend"])
    mark = "TE rows valid  " if te_valid else "TE rows miswired"
    print(f"{mark} {case.short()}")
    print(f"    FAIL:  {', '.join(sorted(verdicts['FAIL'])) or '-'}")
    if verdicts["ERROR"]:
        print(f"    ERROR: {', '.join(sorted(verdicts['ERROR']))}")
print("\nWrites into padding (valid sbhd rows, contiguous layout; flagged, not failed):")
seen = set()
for case, case_rows in by_case.items():
    for row in case_rows:
        tensors = {n: t for n, t in row.get("tensors", {}).items() if t.get("padding_nonzero")}
        if case.qkv_format == "sbhd" and tensors and row["layout"] == "contiguous" and row["backend"] not in seen:
            seen.add(row["backend"])
            print(f"  {row['backend']} on {case.short()}: " + ", ".join(
                f"{n} {t['padding_nonzero']} of {t['padding_values']}" for n, t in tensors.items()))
