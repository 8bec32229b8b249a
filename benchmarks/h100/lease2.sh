#!/usr/bin/env bash
# Issue 51's second lease, TE 2.20.2 without FlashAttention 4 (the first lease's sweeps stopped advancing with it
# installed): bash benchmarks/h100/lease2.sh PHASE DEST; DEST gets PHASE.tgz.
# coverage  te-coverage from a cold start (the machine's first sweep), monitored
# tests     te-tests cold, every path, monitored, stacks at 150 and 260 s
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
esac
kill "$monitor" 2>/dev/null
cat "$out/times.txt" 2>/dev/null; tail -5 "$out"/*.txt | tail -20
gzip -f "$out"/*-sweep/results.jsonl 2>/dev/null
tar czf "$dest/$phase.tgz" -C "$out" .
