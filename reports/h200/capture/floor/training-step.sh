#!/bin/bash
# Issue 17, eighth run's last lease (TE staged): a training step (forward, backward and an AdamW step) of each
# 8-layer stack, the metadata-only capture's cost paired step by step; forward and backward alone beside it.
#   bash reports/h200/capture/floor/training-step.sh   (from the project root, on the H200)
b="python3 benchmarks/bench_capture.py --device cuda --dtype bf16 --rounds 0 --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --paired-steps 300"
for run in "sdpa adamw" "te adamw" "te-layer adamw" "sdpa none" "sdpa adamw" "te none" "te adamw" "sdpa adamw"; do
  set -- $run
  echo "\$ $b --attention $1 --optimizer $2"
  PYTHONWARNINGS=ignore $b --attention $1 --optimizer $2 2>&1 | grep -v "Warning\|get_qkv_layout" | tail -2
done
