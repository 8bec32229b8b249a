#!/usr/bin/env bash
# The commands that produced the H200 evidence in this folder, run on the lent H200 from the project root
# after ../shared/device/stage-te.sh installed TE 2.20.2 (PYTHONPATH=$PWD, python3 = the machine's 3.12).
# Usage: bash reports/h200/commands.sh PART OUTDIR   (PART: runs | bisect | bench | bench-sweep | bench-3 | shared-reference | bench-4 | bench-5 | redesign-1 | redesign-2 | redesign-3)
set -uo pipefail
part=$1; out=$2; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 COLUMNS=170
A="python3 -m attn_doctor"
step() { local name=$1; shift; local s=$SECONDS; "$@" > "$out/$name.txt" 2>&1; echo "$name: exit $? in $((SECONDS - s)) s"; }
case $part in
runs)
  step env $A env
  $A env --json > "$out/env.json" 2>/dev/null
  step run-default $A run --profile --json "$out/run-default/results.json"
  step run-gqa $A run --recipe gqa-llama --json "$out/run-gqa/results.json"
  step run-swa $A run --seq 2048 --mask none --window 128,128 --backend te --backend sdpa.cudnn --backend sdpa.flash \
       --layout contiguous --json "$out/run-swa/results.json"
  step sweep-depth $A sweep --layers 24,128 --out "$out/sweep-depth"
  step sweep-tp $A sweep --tp 1,2 --out "$out/sweep-tp"
  ;;
bisect)
  step bisect $A bisect --from "$out/run-default/results.json" --json "$out/bisect/bisect.json" --out "$out/bisect"
  for script in "$out"/bisect/repro_*.py; do
    (cd /tmp && env -u PYTHONPATH python3 "$script") > "$out/bisect/repro-output.txt" 2>&1
    rc=$?  # read before anything else runs: a command substitution would reset $?
    echo "repro $(basename "$script"): exit $rc" | tee -a "$out/bisect/repro-output.txt"
  done
  ;;
bench)
  step bench-reference python3 benchmarks/bench_reference.py --device cuda \
       --seqs 1024,4096,8192,16384,32768,65536,131072 --repeats 3
  step bench-run python3 benchmarks/bench_run.py --repeats 2
  ;;
bench-3)  # the last lease: the third reference, the worker pool (benchmarks/RESULTS.md)
  step bench-reference-3 python3 benchmarks/bench_reference.py --device cuda --seqs 8192,65536,131072 \
       --repeats 3 --naive-max 8192
  step bench-run-2 python3 benchmarks/bench_run.py --repeats 2 --no-parts --no-per-backend --sweep
  step bench-tile-cols python3 benchmarks/bench_tile_cols.py
  step check-reference-cuda python3 benchmarks/check_reference_cuda.py
  ;;
shared-reference)  # reports/h200/shared-reference: the parent's reference mapped by the workers (no TE)
  step run-shared $A run --backend sdpa --backend local --profile --json "$out/run-shared.json"
  step sweep-shared $A sweep --seq 512,1024,2048 --head-dim 64,128 --backend sdpa --backend local \
       --out "$out/sweep-shared"
  ;;
bench-sweep)
  step bench-sweep python3 benchmarks/bench_run.py --repeats 1 --sweep-only
  ;;
bench-4)  # the final lease: re-timed with one shared reference per case (benchmarks/RESULTS.md)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$out/gpu-clocks.txt"
  step bench-reference-4 python3 benchmarks/bench_reference.py --device cuda --seqs 8192,65536,131072 \
       --repeats 3 --naive-max 8192
  step bench-run-3 python3 benchmarks/bench_run.py --repeats 3 --no-per-backend --sweep
  cp "$(ls -td /tmp/attn-doctor-bench-*/ | head -1)bench_run.json" "$out/bench-run-3.json"
  step bench-tile-cols-2 python3 benchmarks/bench_tile_cols.py
  step check-reference-cuda-2 python3 benchmarks/check_reference_cuda.py
  ;;
bench-5)  # the float64 ceiling on float64 operands, the reference re-timed against it, and its profile
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv > "$out/gpu-clocks-5.txt"
  step bench-matmul-ceiling python3 benchmarks/bench_matmul_ceiling.py
  step bench-reference-5 python3 benchmarks/bench_reference.py --device cuda --seqs 8192,65536,131072 \
       --repeats 3 --naive-max 8192
  step profile-reference python3 benchmarks/profile_reference.py --seq 131072 --heads 4 --trace /tmp/reference-trace.json
  step bench-matmul-ceiling-2 python3 benchmarks/bench_matmul_ceiling.py
  ;;
redesign-1)  # issue 14, the redesign, on the H200 with TE: at 80 columns, the findings again, TE's own TP path
  export COLUMNS=80
  step env $A env
  $A env --json > "$out/env.json" 2>/dev/null
  step run-default $A run --profile --json "$out/run-default/results.json"
  step run-tp2 $A run --tp 2 --json "$out/run-tp2/results.json"
  step run-nproc1-te $A run --nproc 1 --backend te --backend local --json "$out/run-nproc1-te/results.json"
  step too-large $A run --seq 1000000 --json "$out/too-large/results.json"
  step interrupt-run python3 benchmarks/evidence/interrupt.py 14 "$out/interrupt-run.log" -- run --json "$out/interrupt-run/results.json"
  ;;
redesign-2)  # the rest: a depth sweep, bisect and its repro, the CUDA IPC test, Ctrl-C in a depth sweep
  export COLUMNS=80
  step sweep-depth $A sweep --layers 24,128 --out "$out/sweep-depth"
  step bisect $A bisect --from "$out/run-default/results.json" --json "$out/bisect/bisect.json" --out "$out/bisect"
  for script in "$out"/bisect/repro_*.py; do
    (cd /tmp && env -u PYTHONPATH python3 "$script") > "$out/bisect/repro-output.txt" 2>&1
    rc=$?
    echo "repro $(basename "$script"): exit $rc" | tee -a "$out/bisect/repro-output.txt"
  done
  step interrupt-sweep python3 benchmarks/evidence/interrupt.py 20 "$out/interrupt-sweep.log" -- sweep --layers 24,128 --out "$out/interrupt-sweep"
  step cuda-test python3 -m pytest -q -p no:cacheprovider tests/test_shared_reference_cuda.py
  for d in run-default run-tp2 run-nproc1-te sweep-depth; do
    $A report "$out/$d" --format markdown --output "$out/$d/report.md"
    $A report "$out/$d" --format html --output "$out/$d/report.html"
  done
  ;;
redesign-3)  # a fresh lease: the depth sweeps again (the first lease's was refused by a wrong memory estimate)
  export COLUMNS=80
  step sweep-depth $A sweep --layers 24,128 --out "$out/sweep-depth"
  step sweep-1615 $A sweep --recipe megatron-gpt-1615 --out "$out/sweep-1615"
  step interrupt-sweep python3 benchmarks/evidence/interrupt.py 20 "$out/interrupt-sweep.log" -- sweep --layers 24,128 --out "$out/interrupt-sweep"
  step run-nproc1-te $A run --nproc 1 --backend te --backend local --json "$out/run-nproc1-te/results.json"
  for d in sweep-depth sweep-1615 run-nproc1-te; do
    $A report "$out/$d" --format markdown --output "$out/$d/report.md"
    $A report "$out/$d" --format html --output "$out/$d/report.html"
  done
  ;;
esac
