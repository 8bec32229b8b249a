#!/bin/bash
# Issue 17's sixth H200 evidence (TE installed): where a captured call's own time goes (at the call, and when the
# model's forward pass ends: cpu-time/split.py), and the launch-bound 8-layer stacks' step time and CPU time
# (bench_capture.py now measures both) over 40 rounds, metadata only, each bench alternating with the same bench
# on e718897's capture on the same host. $PREV holds e718897's attn_doctor/ and this commit's benchmarks/
#   (git archive e718897 attn_doctor | tar -x -C "$PREV"; cp -r benchmarks "$PREV"/);
# $FACTS, when set, a variant whose tensors' facts are read at the call (split only).
# Outputs in $OUT.
#   OUT=... PREV=... [FACTS=...] bash reports/h200/capture/cpu-time-evidence.sh split
#   OUT=... PREV=... bash reports/h200/capture/cpu-time-evidence.sh bench
#   OUT=... bash reports/h200/capture/cpu-time-evidence.sh big   # the larger stacks, this commit's capture only
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
ROOT=$PWD
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"
  grep -v "Warning\|get_qkv_layout\|^ *warn\|^ *) = " "$OUT/$name.txt" | tail -4; }
BIG="--device cuda --dtype bf16 --layers 24 --hidden 1024 --heads 16 --seq 2048 --batch 4 --rounds 20 --modes metadata"
SMALL="--device cuda --dtype bf16 --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --rounds 40 --modes metadata"
if [ "$1" = split ]; then
  step versions python3 -c "import torch, transformer_engine as te, platform; print('torch', torch.__version__,
    'TE', te.__version__, 'Python', platform.python_version(), torch.cuda.get_device_name())"
  for a in te te-layer sdpa; do
    step split-$a python3 reports/h200/capture/cpu-time/split.py $a
    if [ -n "${FACTS:-}" ]; then
      step split-$a-facts-at-call bash -c "cd $FACTS && python3 $ROOT/reports/h200/capture/cpu-time/split.py $a"
    fi
  done
fi
if [ "$1" = bench ]; then
  for a in te sdpa te-layer; do
    step bench-$a-small-new python3 benchmarks/bench_capture.py $SMALL --attention $a
    step bench-$a-small-prev python3 "$PREV"/benchmarks/bench_capture.py $SMALL --attention $a
  done
fi
if [ "$1" = big ]; then
  step bench-te-big python3 benchmarks/bench_capture.py $BIG --attention te
  step bench-te-layer-big python3 benchmarks/bench_capture.py $BIG --attention te-layer
  step bench-te-llm-layer python3 benchmarks/bench_capture.py --device cuda --dtype bf16 --attention te --layers 4 \
    --hidden 4096 --heads 32 --seq 4096 --batch 1 --rounds 12 --steps 4 --modes metadata
fi
