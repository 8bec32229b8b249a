"""Which failing TE rows of a coverage sweep to bisect: the smallest case of each distinct fault.

A fault is (backend, verdict, failing tensors, the case's API features and mask): rows sharing one are the same
question asked at different sizes, so only the smallest case (fewest attention scores) is bisected. Faults
already bisected elsewhere (te.flash under causal masks: reports/h200/verdicts/bisect-te-flash) come last.
Prints one `attn-doctor bisect` argument line per pick (what reports/h200/api/evidence.sh runs), at most --limit
of them; the picks on stderr.

    python3 benchmarks/evidence/pick_bisects.py /tmp/api/coverage --limit 4
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from attn_doctor.results.log import load_results  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("sweep")
parser.add_argument("--limit", type=int, default=4)
parser.add_argument("--out", default="/tmp/api")
args = parser.parse_args()

report, _ = load_results(Path(args.sweep))
failing = [r for r in report.rows if r.verdict in ("FAIL", "ERROR") and not r.internal]  # bisect --row's order
smallest: dict = {}
for index, row in enumerate(failing):
    if not row.coords.backend.name.startswith("te."):
        continue
    case = row.coords.case
    fault = (row.coords.backend.name, row.verdict, tuple(row.failing_tensors), tuple(sorted(case.api_features())),
             case.mask)
    if fault not in smallest or case.score_elements < smallest[fault][1].coords.case.score_elements:
        smallest[fault] = (index, row)


def already_known(fault) -> bool:
    return fault[0] == "te.flash" and "causal" in fault[4]


ordered = sorted(smallest.items(), key=lambda item: (already_known(item[0]), item[1][1].coords.case.score_elements))
picks: list = []
# First a new backend with a new feature set, then any new feature set, then the rest.
for wanted in (lambda f, b, s: f[0] not in b and f[3:] not in s, lambda f, b, s: f[3:] not in s, lambda f, b, s: True):
    for fault, (index, row) in ordered:
        backends, features = {f[0] for f, _, _ in picks}, {f[3:] for f, _, _ in picks}
        if (fault, index, row) not in picks and wanted(fault, backends, features):
            picks.append((fault, index, row))
for number, (fault, index, row) in enumerate(picks[:args.limit], start=1):
    print(f"# {row.coords.backend.name} {row.verdict} {','.join(row.failing_tensors) or '-'}: "
          f"{row.coords.case.short()}", file=sys.stderr)
    print(f"bisect --from {args.sweep} --row {index} --timeout 60 --json {args.out}/bisect-{number}.json "
          f"--out {args.out}/bisect-{number}")
print(f"{len(failing)} failing rows, {len(smallest)} distinct TE faults, {min(len(picks), args.limit)} picked",
      file=sys.stderr)
