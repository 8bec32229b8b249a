#!/usr/bin/env bash
# The second card: env, the default run, and the three faults' committed repros (reports/h200/upstream, api).
out=$1; mkdir -p "$out"
export PYTHONPATH=$PWD COLUMNS=100
nvidia-smi -L > "$out/gpu.txt" 2>&1
python3 -m attn_doctor env > "$out/env.txt" 2>&1
s=$(date +%s); python3 -m attn_doctor run --device cuda --profile --json "$out/run-default.json" > "$out/run-default.txt" 2>&1
echo "run default: exit $? in $(( $(date +%s) - s )) s" >> "$out/exit-codes.txt"
for r in $(cat reports/h100/repros.txt); do
  timeout 120 python3 "$r" > "$out/$(basename "$r" .py).txt" 2>&1
  echo "$r: exit $?" >> "$out/exit-codes.txt"
done
