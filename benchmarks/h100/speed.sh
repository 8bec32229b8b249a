#!/usr/bin/env bash
# Default `attn-doctor run` with TE, cold, 3 times each: the previous commit (its attn_doctor/ extracted into
# .device-base with `git archive BASE attn_doctor | tar -x -C .device-base`) and this tree,
# interleaved, each from a fresh folder, each with --profile. Outputs under $1.
out=$1; mkdir -p "$out"; root=$PWD
python3 -c "import time; t=time.perf_counter(); import transformer_engine.pytorch; print('import TE', round(time.perf_counter()-t, 2))" > "$out/te-import.txt" 2>&1
python3 -c "import time; t=time.perf_counter(); import torch; print('import torch', round(time.perf_counter()-t, 2))" >> "$out/te-import.txt" 2>&1
for i in 1 2 3; do
  for t in base new; do
    p=$root; [ "$t" = base ] && p=$root/.device-base
    d=$(mktemp -d); s=$(date +%s.%N)
    (cd "$d" && PYTHONPATH=$p COLUMNS=100 python3 -m attn_doctor run --device cuda --profile > "$out/run-$t-$i.txt" 2>&1)
    rc=$?; e=$(date +%s.%N)
    echo "$t run $i exit $rc wall $(python3 -c "print(round($e - $s, 2))")" | tee -a "$out/times.txt"
  done
done
PYTHONPATH=$root python3 -m attn_doctor env --json > "$out/env.json" 2> "$out/env.err"
