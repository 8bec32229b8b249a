#!/bin/bash
# Issue 17's eighth H200 run (TE staged): the metadata-only capture as committed, its step cost paired step by
# step (benchmarks/bench_capture.py --paired-steps) on the launch-bound 8-layer stacks of each kind and on a
# GPT-2-small-sized stack (12 layers, hidden 768, seq 1024, batch 8). Outputs in $OUT.
#   OUT=... bash reports/h200/capture/floor-evidence.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"
  tail -3 "$OUT/$name.txt"; }
bench="python3 benchmarks/bench_capture.py --device cuda --dtype bf16 --rounds 0"
step versions python3 -c "import transformer_engine as te, torch, platform; print('torch', torch.__version__,
  'TE', te.__version__, 'Python', platform.python_version(), torch.cuda.get_device_name(), platform.processor())"
for k in sdpa te te-layer; do
  step small-$k $bench --attention $k --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --paired-steps 300
done
for k in sdpa te te-layer; do
  step gpt2-$k $bench --attention $k --layers 12 --hidden 768 --heads 12 --seq 1024 --batch 8 --paired-steps 150
done
step small-sdpa-again $bench --attention sdpa --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --paired-steps 300
