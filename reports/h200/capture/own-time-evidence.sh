#!/bin/bash
# Issue 17's fourth H200 evidence (TE 2.20.2 installed): the capture's overhead, metadata only, measured two ways
# by benchmarks/bench_capture.py (paired step times per mode, and the capture's own time per call, which the
# host's drift cannot blur), after the calls file became a memory map and the rank and parallel layout are read
# once. PyTorch SDPA and TE DotProductAttention stacks, launch-bound (8 layers, hidden 512), GPT-350M-sized
# (24 layers, hidden 1024) and of an LLM's layer size (hidden 4096). Outputs in $OUT.
#   OUT=... bash reports/h200/capture/own-time-evidence.sh small   # the 8-layer stacks
#   OUT=... bash reports/h200/capture/own-time-evidence.sh large   # the 24-layer and hidden-4096 stacks
#   OUT=... bash reports/h200/capture/own-time-evidence.sh repeat  # the TE stacks again, twice the rounds
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"; }
BENCH="python3 benchmarks/bench_capture.py --device cuda --dtype bf16"
if [ "${1:-small}" = small ]; then
  step bench-sdpa-small $BENCH --attention sdpa --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --rounds 12
  step bench-te-small $BENCH --attention te --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --rounds 12
  exit 0
fi
if [ "$1" = repeat ]; then
  step bench-te-small-24-rounds $BENCH --attention te --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --rounds 24
  step bench-te-big-24-rounds $BENCH --attention te --layers 24 --hidden 1024 --heads 16 --seq 2048 --batch 4 \
    --rounds 24
  exit 0
fi
step bench-te-big $BENCH --attention te --layers 24 --hidden 1024 --heads 16 --seq 2048 --batch 4 --rounds 12
step bench-te-llm-layer $BENCH --attention te --layers 4 --hidden 4096 --heads 32 --seq 4096 --batch 1 --rounds 8 \
  --steps 4
