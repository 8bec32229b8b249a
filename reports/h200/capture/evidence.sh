#!/bin/bash
# Issue 17's evidence on the H200 (TE 2.20.2 installed): capture te_model.py at TP=1 (TE's default backend)
# and in a one-GPU TP=2 simulation with TE forced to its unfused path, replay the TP=2 capture on every path,
# compare the two captures layer by layer. Outputs in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
AD="python3 -m attn_doctor"
M=reports/h200/capture/te_model.py
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"; }
step capture-tp1 $AD capture --out /tmp/tp1 --values -- python3 $M --tp 1
NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=0 step capture-tp2-unfused $AD capture --out /tmp/tp2 --values -- python3 $M --tp 2
step compare $AD compare /tmp/tp1 /tmp/tp2 --json "$OUT/compare.json"
step replay-tp2 timeout 150 $AD replay /tmp/tp2 --out /tmp/replay --timeout 60
$AD report /tmp/replay --format markdown > "$OUT/replay.md" 2>&1
python3 - > "$OUT/calls.txt" <<'PY'
from attn_doctor.tracing.store import read_capture
for name in ("tp1", "tp2"):
    for c in read_capture(f"/tmp/{name}")[:4]:
        m = c.meta
        print(name, m["index"], m["module"], "layer", m["layer"], "step", m["step"], m["parallel"], m["te"],
              "q", m["tensors"]["q"]["shape"], m["tensors"]["q"]["stride"], m["tensors"]["q"]["storage"])
PY
tar czf "$OUT/captures-metadata.tgz" -C /tmp --exclude="*.safetensors" tp1 tp2
