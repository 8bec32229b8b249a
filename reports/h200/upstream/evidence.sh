#!/bin/bash
# Issue 18's H200 evidence (TE 2.20.2 installed): attn-doctor's default case on every path and on contiguous,
# transposed and head-sliced q/k/v views (what is right on the same inputs), then a bisect of each failing
# te.fused row from those results (--from, so each bisect document sits beside the results it started from).
# The issue bodies are rendered from that folder by `attn-doctor report DIR --format issue`. Outputs in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
AD="python3 -m attn_doctor"
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"; }
mkdir -p "$OUT/strided"
$AD env > "$OUT/env.txt" 2>&1
step run-strided timeout 150 $AD run --layout contiguous --layout transposed --layout head_slice \
    --json "$OUT/strided/results.json"
python3 - > "$OUT/failing-rows.txt" 2>&1 <<'PY'
import json, os
rows = json.load(open(os.environ["OUT"] + "/strided/results.json"))["results"]
for i, r in enumerate(r for r in rows if r["verdict"] in ("FAIL", "ERROR")):
    print(i, r["backend"], r["layout"], r["verdict"], r["ran"])
PY
for row in $(awk '$2 == "te.fused" {print $1}' "$OUT/failing-rows.txt"); do
  step bisect-row$row timeout 170 $AD bisect --from "$OUT/strided/results.json" --row $row --timeout 60
done
