#!/usr/bin/env bash
# Issue 49 on the lent GPU: device memory of attn-doctor's processes together, sampled (benchmarks/bench_memory.py),
# against the plan's estimate; the four commands of the issue with no budget, 48 GiB and 24 GiB; the old commit's
# depth sweep beside the new one. Run from the project root on the GPU machine, after TE 2.20.2
# (../shared/device/stage-te.sh) and megatron-core 0.19.2 (a wheel, pip install --no-index --no-deps) are installed.
# Usage: bash benchmarks/h100/memory.sh PART OUTDIR
#   env:      nvidia-smi, attn-doctor env, versions
#   grid:     the estimate against the sampled peak: the default run, depth 24 and 128, a seq-32k call, a seq-128k
#             call (refused: its local baseline's scores alone exceed the card), and depth 24 alone (paired with `old`)
#   coverage: the same for the te-coverage recipe
#   capture:  a Megatron-Core GPT (TE spec, 4 layers; IMPL=local: the local spec) captured with values, then
#             replayed with no budget
#   budget-N: the default run, sweep --layers 24,128, the replay (after `capture`) and the te-coverage recipe (unless
#             NO_COVERAGE is set) with --max-memory NGiB
#   old:      `sweep --layers 24` of the commit before issue 49 (its tree in .device-old), for the figures and time
set -uo pipefail
part=$1; out=$2; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 COLUMNS=100
root=$PWD
bench=(python3 "$root/benchmarks/bench_memory.py" --out "$out")
capture=/tmp/mcore-capture
case $part in
env)
  nvidia-smi > "$out/nvidia-smi.txt" 2>&1
  python3 -m attn_doctor env > "$out/env.txt" 2>&1
  python3 -c "import torch, transformer_engine, megatron.core; print('torch', torch.__version__, 'TE',
transformer_engine.__version__, 'megatron-core', megatron.core.__version__)" > "$out/versions.txt" 2>&1
  ;;
grid)
  "${bench[@]}" run='run' L24-128='sweep --layers 24,128' seq32k='run --batch 1 --heads 1 --seq 32768' \
      seq128k='run --batch 1 --heads 1 --seq 131072' L24='sweep --layers 24'
  ;;
coverage)
  "${bench[@]}" coverage='sweep --recipe te-coverage'
  ;;
capture)
  rm -rf "$capture"
  python3 -m attn_doctor capture --out "$capture" --values -- python3 tests/models/megatron_gpt.py --device cuda \
      --dtype bf16 --layers 4 --hidden 1024 --heads 16 --seq 1024 --batch 2 --vocab 1024 --impl "${IMPL:-te}" \
      > "$out/capture.txt" 2>&1
  echo "capture: exit $?" >> "$out/capture.txt"
  "${bench[@]}" replay="replay $capture"
  ;;
budget-*)
  n=${part#budget-}
  runs=("run-$n=run --max-memory ${n}GiB" "L24-128-$n=sweep --layers 24,128 --max-memory ${n}GiB")
  [ -d "$capture" ] && runs+=("replay-$n=replay $capture --max-memory ${n}GiB")
  [ -z "${NO_COVERAGE:-}" ] && runs+=("coverage-$n=sweep --recipe te-coverage --max-memory ${n}GiB")
  "${bench[@]}" "${runs[@]}"
  ;;
old)
  (cd .device-old && python3 "$root/benchmarks/bench_memory.py" --out "$out" old-L24='sweep --layers 24')
  ;;
esac
