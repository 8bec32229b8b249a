#!/usr/bin/env bash
# Issue 32 on the lent H200: the reporter's three Megatron runs of one GPT (megatron-core's GPTModel,
# tests/models/megatron_gpt.py: TE spec at TP=1, TE spec at TP=2, `--transformer-impl local`), captured with
# values, compared pairwise and replayed. Run from the project root on the GPU machine, after TE 2.20.2
# (../shared/device/stage-te.sh) and megatron-core 0.19.2 (a wheel, pip install --no-index --no-deps) are installed.
# Usage: bash reports/h200/megatron/evidence.sh PART OUTDIR   (PART: local | te | replay)
#   local:  the local spec alone, TP=1, TP=2, the faulty TP=2 and TP=2 drawn per rank (--init gpu), compared;
#           TP=1 replayed (needs no TE)
#   te:     the TE spec at TP=1 and TP=2, the local spec at TP=1 and TP=2 (and at TP=2 with rank 1's layer 3
#           attention dropping each query's own key); the five comparisons
#   replay: every path on the captures `te` made (their calls with values); how large a direction their keys
#           and values share (benchmarks/evidence/shared_direction.py)
# Two ranks share the one GPU: their process group is gloo (NCCL refuses two ranks on one device).
set -uo pipefail
part=$1; out=$2; mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 COLUMNS=100
A="python3 -m attn_doctor"
MODEL=(tests/models/megatron_gpt.py --device "${DEVICE:-cuda}" --dtype bf16 --layers 4 --hidden 1024 --heads 16 --seq 1024
       --batch 2 --vocab 1024)
TP2=(python3 -m torch.distributed.run --standalone --nproc-per-node 2)
CAPTURES=${CAPTURES:-/tmp/megatron-captures}  # the captures (values: about 0.3 GB) stay on the machine
step() { local name=$1; shift; local s=$SECONDS; echo "\$ $*" > "$out/$name.txt"; "$@" >> "$out/$name.txt" 2>&1
         echo "$name: exit $? in $((SECONDS - s)) s" | tee -a "$out/$name.txt"; }
capture() { local name=$1; shift; rm -rf "${CAPTURES:?}/$name"; step "capture-$name" $A capture --out "$CAPTURES/$name" --values -- "$@"; }
compare() { step "compare-$1-vs-$2" $A compare "$CAPTURES/$1" "$CAPTURES/$2" --json "$out/compare-$1-vs-$2.json"; }
mkdir -p "$CAPTURES"
case $part in
local)
  python3 -c "import megatron.core, torch; print('megatron-core', megatron.core.__version__, 'torch', torch.__version__)" \
      > "$out/versions.txt" 2>&1
  capture local-tp1 python3 "${MODEL[@]}" --impl local
  capture local-tp2 "${TP2[@]}" "${MODEL[@]}" --impl local --tp 2
  capture local-tp2-faulty "${TP2[@]}" "${MODEL[@]}" --impl local --tp 2 --faulty-rank 1 --faulty-layer 3
  compare local-tp1 local-tp2
  compare local-tp1 local-tp2-faulty
  # issue 42: TP=2 drawn per rank as Megatron's GPU initialisation draws it (no --use-cpu-initialization)
  capture local-tp2-gpu-init "${TP2[@]}" "${MODEL[@]}" --impl local --tp 2 --init gpu
  compare local-tp1 local-tp2-gpu-init
  step replay-local-tp1 $A replay "$CAPTURES/local-tp1" --out "$out/replay-local-tp1"
  ;;
te)
  step env $A env
  python3 -c "import megatron.core, torch, transformer_engine; print('megatron-core', megatron.core.__version__,
'torch', torch.__version__, 'transformer-engine', transformer_engine.__version__)" > "$out/versions.txt" 2>&1
  capture te-tp1 python3 "${MODEL[@]}" --impl te
  capture te-tp2 "${TP2[@]}" "${MODEL[@]}" --impl te --tp 2
  capture local-tp1 python3 "${MODEL[@]}" --impl local
  capture local-tp2 "${TP2[@]}" "${MODEL[@]}" --impl local --tp 2
  capture local-tp2-faulty "${TP2[@]}" "${MODEL[@]}" --impl local --tp 2 --faulty-rank 1 --faulty-layer 3
  compare te-tp1 local-tp1
  compare te-tp1 te-tp2
  compare te-tp2 local-tp2
  compare local-tp1 local-tp2
  compare local-tp1 local-tp2-faulty
  ;;
replay)
  for name in te-tp1 local-tp1 te-tp2; do
    step "replay-$name" $A replay "$CAPTURES/$name" --out "$out/replay-$name"
  done
  step directions python3 benchmarks/evidence/shared_direction.py "$CAPTURES/te-tp1" "$CAPTURES/local-tp1"
  ;;
esac
