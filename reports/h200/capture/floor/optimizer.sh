#!/bin/bash
# The optimizer comparison (issue 17, eighth run): the launch-bound SDPA stack, steps paired, with and without AdamW.
#   bash reports/h200/capture/floor/optimizer.sh   (from the project root, on the H200)
b="python3 benchmarks/bench_capture.py --device cuda --dtype bf16 --rounds 0 --attention sdpa --layers 8 --hidden 512 --heads 8 --seq 512 --batch 4 --paired-steps 300"
for o in adamw none adamw none; do echo "\$ $b --optimizer $o"; $b --optimizer $o 2>&1 | tail -2; done
