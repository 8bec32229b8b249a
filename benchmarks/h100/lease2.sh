#!/usr/bin/env bash
# Issue 51's second lease, TE 2.20.2 without FlashAttention 4 (the first lease's sweeps stopped advancing with it
# installed): bash benchmarks/h100/lease2.sh PHASE DEST; DEST gets PHASE.tgz.
# coverage  te-coverage from a cold start (the machine's first sweep), monitored
# tests     te-tests cold, every path, monitored, stacks at 150 and 260 s
# module    TE's MultiheadAttention and TransformerLayer as layer paths (two runs and the GPU tests)
set -uo pipefail
phase=$1 dest=$2 limit=${3:-300}
root=$PWD out=/tmp/lease2/$phase
mkdir -p "$out" "$dest"
DUMP_AT="${DUMP_AT:-150 260}" bash "$root/benchmarks/h100/monitor.sh" "$out" 10 &
monitor=$!
case "$phase" in
  coverage)
    PYTHONPATH=$root python3 -m attn_doctor env > "$out/env.txt" 2>&1
    LIMIT=$limit bash "$root/benchmarks/h100/cold-sweep.sh" "$out" coverage-cold "$root" --recipe te-coverage \
        --workers 3 --timeout 90 ;;
  tests)
    LIMIT=$limit bash "$root/benchmarks/h100/cold-sweep.sh" "$out" te-tests "$root" --recipe te-tests \
        --workers 3 --timeout 90 ;;
  module)
    PYTHONPATH=$root python3 -m attn_doctor env > "$out/env.txt" 2>&1
    for args in "--backend te.mha --backend te.layer --backend te.fused --backend local --batch 2 --seq 512 \
--heads 16 --head-dim 64 --dtype bf16 --mask causal" "--backend te.module --backend local --batch 2 --seq 512 \
--heads 16 --kv-heads 4 --head-dim 64 --qkv-format bshd --mask no_mask"; do
      n=$((${n:-0} + 1))
      echo "\$ attn-doctor run --device cuda $args" > "$out/module-run-$n.txt"
      (cd "$out" && PYTHONPATH=$root COLUMNS=100 timeout 120 python3 -m attn_doctor run --device cuda $args \
          --json "$out/module-run-$n.json" >> "$out/module-run-$n.txt" 2>&1; echo "exit $?" >> "$out/module-run-$n.txt")
    done
    (PYTHONPATH=$root timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_te_module.py -k real_te \
        > "$out/module-pytest.txt" 2>&1; echo "exit $?" >> "$out/module-pytest.txt")
    tail -25 "$out"/module-run-*.txt "$out/module-pytest.txt" ;;
esac
kill "$monitor" 2>/dev/null
cat "$out/times.txt" 2>/dev/null; tail -5 "$out"/*.txt | tail -20
gzip -f "$out"/*-sweep/results.jsonl 2>/dev/null
tar czf "$dest/$phase.tgz" -C "$out" .
