#!/bin/bash
# Issue 17's third H200 evidence (TE 2.20.2 installed): capture's overhead on a TE model after the per-call work
# was cut (no global module hooks; the line's unchanging part encoded once per call signature), side by side
# with the capture of the second evidence run (commit ed6f5d1's attn_doctor/, copied to .device-old/ with this
# bench script beside it), on a TE stack launch-bound (8 layers) and GPU-bound (24 layers); then FP8
# attention captured with values (te_fp8_model.py), what each call recorded, replayed on every path, and
# bisected from the replay if a path fails. Outputs in $OUT.
#   OUT=... bash reports/h200/capture/overhead-fp8-evidence.sh bench   # the overhead part
#   OUT=... bash reports/h200/capture/overhead-fp8-evidence.sh fp8     # the FP8 part
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
AD="python3 -m attn_doctor"
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"; }
BIG="--attention te --device cuda --dtype bf16 --layers 24 --hidden 1024 --heads 16 --seq 2048 --batch 4 --rounds 12"
SMALL="--attention te --device cuda --dtype bf16 --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --rounds 12"
if [ "${1:-bench}" = bench ]; then  # .device-old/benchmarks/bench_capture.py: this bench, on ed6f5d1's capture
  for config in SMALL BIG; do
    step bench-${config,,}-now python3 benchmarks/bench_capture.py ${!config}
    step bench-${config,,}-ed6f5d1 python3 .device-old/benchmarks/bench_capture.py ${!config}
  done
  exit 0
fi
step capture-fp8 $AD capture --out /tmp/fp8 --values -- python3 reports/h200/capture/te_fp8_model.py
python3 - > "$OUT/fp8-calls.txt" 2>&1 <<'PY'
from attn_doctor.tracing.replay import case_of
from attn_doctor.tracing.store import read_capture
for c in read_capture("/tmp/fp8"):
    m = c.meta
    case = case_of(c, "/tmp/fp8")
    print(f"call {m['index']} (step {m['step']}): q {m['tensors']['q']['shape']} stride {m['tensors']['q']['stride']}; "
          f"values {m['values']}")
    print(f"  fp8 recipe: {m['arguments']['module'].get('fp8_recipe')}")
    print(f"  replayed as: {case if isinstance(case, str) else case.short()}")
    print(f"  TE chose: {m['te']['backend']} (layout {m['te'].get('qkv_layout')})")
    for line in m["te"].get("reasons", []):
        print(f"    {line}")
PY
step replay-fp8 timeout 240 $AD replay /tmp/fp8 --out /tmp/replay-fp8 --timeout 60
$AD report /tmp/replay-fp8 --format markdown > "$OUT/replay-fp8.md" 2>&1
cp /tmp/replay-fp8/results.json "$OUT/replay-fp8.json"
if grep -q "^exit 1" "$OUT/replay-fp8.txt"; then
  step bisect-replay-fp8 timeout 150 $AD bisect --from /tmp/replay-fp8 --timeout 60  # writes beside the replay
  $AD report /tmp/replay-fp8 --format issue > "$OUT/issue-fp8.md" 2>&1
  mkdir -p "$OUT/bisect-replay-fp8" && cp /tmp/replay-fp8/bisect*.json /tmp/replay-fp8/repro_* "$OUT/bisect-replay-fp8/"
fi
tar czf "$OUT/capture-fp8-metadata.tgz" -C /tmp --exclude="*.safetensors" fp8
