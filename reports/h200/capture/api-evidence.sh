#!/bin/bash
# Issue 17's second H200 evidence (TE 2.20.2 installed): capture te_api_model.py (thd with padded slots, a
# padding attention_mask, a bias, a custom scale, FP8), say what each call recorded (TE's choice and its
# reasons), replay every call on every path, bisect the first failing replayed row if any; then capture's
# overhead on a TE model on the GPU (benchmarks/bench_capture.py). Outputs in $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
AD="python3 -m attn_doctor"
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"; }
step capture-api $AD capture --out /tmp/api --values -- python3 reports/h200/capture/te_api_model.py
python3 - > "$OUT/api-calls.txt" 2>&1 <<'PY'
from attn_doctor.tracing.replay import case_of
from attn_doctor.tracing.store import read_capture
for c in read_capture("/tmp/api"):
    m = c.meta
    case = case_of(c, "/tmp/api")
    print(f"call {m['index']}: q {m['tensors']['q']['shape']} stride {m['tensors']['q']['stride']} "
          f"storage {m['tensors']['q']['storage']}; values {m['values']}")
    print(f"  replayed as: {case if isinstance(case, str) else case.short()}")
    print(f"  TE chose: {m['te']['backend']} (layout {m['te'].get('qkv_layout')})")
    for line in m["te"].get("reasons", []):
        print(f"    {line}")
PY
step replay-api timeout 240 $AD replay /tmp/api --out /tmp/replay-api --timeout 60
$AD report /tmp/replay-api --format markdown > "$OUT/replay-api.md" 2>&1
cp /tmp/replay-api/results.json "$OUT/replay-api.json"
if grep -q "^exit 1" "$OUT/replay-api.txt"; then
  step bisect-replay timeout 150 $AD bisect --from /tmp/replay-api --out "$OUT/bisect-replay" --timeout 60
fi
step bench-te-gpt350m python3 benchmarks/bench_capture.py --attention te --device cuda --dtype bf16 --layers 24 \
    --hidden 1024 --heads 16 --seq 2048 --batch 4 --steps 10
step bench-te-small python3 benchmarks/bench_capture.py --attention te --device cuda --dtype bf16 --layers 8 \
    --hidden 512 --heads 8 --seq 512 --batch 4 --steps 10
tar czf "$OUT/capture-api-metadata.tgz" -C /tmp --exclude="*.safetensors" api
