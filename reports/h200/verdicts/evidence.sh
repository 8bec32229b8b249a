#!/bin/bash
# Issue 15's evidence on the H200: run from the project root on the device machine, with TE 2.20.2 and FA4
# installed (../shared/device: stage-te.sh, stage-fa4.sh). PART picks what runs (the parts fit one device
# call each); everything lands in $OUT/verdicts-PART.tgz.
#   PART=1  versions; the default run; the cancelling cases on every path
#   PART=2  the seeded false-alarm sweep over dtypes, masks, lengths, head dims and input distributions
#   PART=3  --repeats 3 (bitwise reproducibility, TE's deterministic mode); a dQ 1% too large in bf16
#   PART=4  the float64 reference with and without the term magnitudes
#   PART=5  bisect of te.flash (FA4) under a causal mask, its repro; TE rows on a window with seq != seq-kv
set -u
PART=${PART:-1}
export PYTHONPATH=$PWD
AD="python3 -m attn_doctor"
O=/tmp/verdicts-$PART
rm -rf "$O" && mkdir -p "$O"

step() {  # step NAME COMMAND...: stdout+stderr, the exit code and the wall time in $O/NAME.txt
  local name=$1; shift
  local start=$(date +%s)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$O/$name.txt" 2>&1
  echo "wall $(( $(date +%s) - start )) s" >> "$O/$name.txt"
}

if [ "$PART" = 1 ]; then
  { nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
    python3 -c "import transformer_engine.pytorch, transformer_engine, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'te', transformer_engine.__version__)"
    python3 -c "import flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))"
    git log -1 --format='commit %H %s' 2>/dev/null || true; } > "$O/versions.txt" 2>&1
  step env $AD env
  step run-default $AD run --json "$O/run-default.json"
  # Where the exact dQ/dK cancel: one key, a window of 0, fully masked rows, a saturated softmax, near-equal keys.
  step one-key $AD sweep --seq 1,16 --seq-kv 1 --dtype bf16,fp16 --mask none,causal --head-dim 64,128 \
    --layout contiguous --out "$O/one-key"
  step window-00 $AD sweep --seq 64,512 --window 0,0 --dtype bf16,fp16 --mask none,causal --head-dim 64,128 \
    --layout contiguous --out "$O/window-00"
  step fully-masked $AD sweep --seq 64 --seq-kv 16 --window 0,0 --dtype bf16,fp16 --mask none --head-dim 64,128 \
    --layout contiguous --out "$O/fully-masked"
  step saturated $AD sweep --seq 256,1024 --inputs large-logits,structured --dtype bf16,fp16 --mask none,causal \
    --head-dim 64,128 --layout contiguous --out "$O/saturated"
fi

if [ "$PART" = 2 ]; then
  step false-alarms $AD sweep --seed 1,2,3 --dtype bf16,fp16 --mask causal,none --seq 128,1024 --head-dim 64,128 \
    --inputs normal,uniform,outliers,large-logits,structured --layout contiguous --out "$O/false-alarms"
fi

if [ "$PART" = 4 ]; then  # what the term magnitudes cost the float64 reference
  step bench-reference python3 benchmarks/bench_reference.py --device cuda --seqs 8192,32768,65536 --repeats 2 \
    --naive-max 0 --without-terms
fi

if [ "$PART" = 3 ]; then
  step repeats $AD run --repeats 3 --layout contiguous --layout transposed --json "$O/repeats.json"
  step bias $AD run --kernel tests/kernels/faulty.py:dq_one_percent --backend local --layout contiguous \
    --json "$O/bias.json"
fi

if [ "$PART" = 5 ]; then
  step bisect-te-flash $AD bisect --backend te.flash --batch 2 --seq 128 --heads 4 --head-dim 64 --mask causal \
    --layout contiguous --out "$O/bisect-te-flash" --json "$O/bisect-te-flash/bisect.json"
  for script in "$O"/bisect-te-flash/repro_*.py; do step repro-te-flash python3 "$script"; done
  step window-cross-attention $AD run --backend te --backend local --seq 64 --seq-kv 16 --window 0,0 --mask none \
    --layout contiguous --json "$O/window-cross-attention.json"
fi

tar -C /tmp -czf "$OUT/verdicts-$PART.tgz" "verdicts-$PART"
