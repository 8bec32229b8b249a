#!/bin/bash
# Issue 17's fifth H200 evidence (TE 2.20.2 installed): the capture's cost, metadata only, after a call's lines
# were deferred to the end of the model's forward pass (when autograd holds the call's tensors anyway) and each
# call became a short line naming its signature. Each bench alternates with the same bench on a70d2ff's capture
# (the fourth run's), on the same host: $OLD holds a70d2ff's attn_doctor/ and this commit's benchmarks/
#   (git archive a70d2ff attn_doctor | tar -x -C "$OLD"; cp -r benchmarks "$OLD"/).
# The run itself used OLD=.device-diag/old and the ablation script from .device-diag/ (the same file as
# deferred/ablate.py). Outputs in $OUT.
#   OUT=... OLD=... bash reports/h200/capture/deferred-evidence.sh small   # 8-layer stacks, and the ablation
#   OUT=... OLD=... bash reports/h200/capture/deferred-evidence.sh big     # te.TransformerLayer; larger stacks
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"; }
SMALL="--device cuda --dtype bf16 --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --rounds 12"
BIG="--device cuda --dtype bf16 --layers 24 --hidden 1024 --heads 16 --seq 2048 --batch 4 --rounds 12"
if [ "$1" = small ]; then
  step ablate-te python3 reports/h200/capture/deferred/ablate.py te --rounds 4
  for i in 1 2; do
    step bench-te-small-new-$i python3 benchmarks/bench_capture.py $SMALL --attention te
    step bench-te-small-old-$i python3 "$OLD"/benchmarks/bench_capture.py $SMALL --attention te
  done
  step bench-sdpa-small-new python3 benchmarks/bench_capture.py $SMALL --attention sdpa
  step bench-sdpa-small-old python3 "$OLD"/benchmarks/bench_capture.py $SMALL --attention sdpa
fi
if [ "$1" = big ]; then
  step bench-te-layer-small-new python3 benchmarks/bench_capture.py $SMALL --attention te-layer
  step bench-te-layer-small-old python3 "$OLD"/benchmarks/bench_capture.py $SMALL --attention te-layer
  step bench-te-big-new python3 benchmarks/bench_capture.py $BIG --attention te
  step bench-te-layer-big-new python3 benchmarks/bench_capture.py $BIG --attention te-layer
  step bench-te-llm-layer-new python3 benchmarks/bench_capture.py --device cuda --dtype bf16 --attention te \
    --layers 4 --hidden 4096 --heads 32 --seq 4096 --batch 1 --rounds 8 --steps 4
fi
