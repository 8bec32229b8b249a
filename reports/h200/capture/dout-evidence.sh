#!/bin/bash
# Issue 17's H200 evidence for dO's geometry (TE staged). `capture`: each bench layer kind captured
# (dout/dout_models.py), then replayed on every path, the captured layout handing each backward dO as the run's
# did. `paired`: the capture's cost on the 8-layer stacks, paired step by step (dout/paired_steps.py). Outputs in
# $OUT.
#   OUT=... bash reports/h200/capture/dout-evidence.sh capture|paired
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
step() { local name=$1; shift; local t0=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$OUT/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" >> "$OUT/$name.txt"
  grep -v "Warning\|get_qkv_layout\|^ *warn\|^ *) = " "$OUT/$name.txt" | tail -3; }
if [ "$1" = capture ]; then
  step versions python3 -c "import transformer_engine as te, torch, platform; print('torch', torch.__version__,
    'TE', te.__version__, 'Python', platform.python_version(), torch.cuda.get_device_name())"
  for k in ${KINDS:-sdpa te te-layer}; do
    step capture-$k python3 reports/h200/capture/dout/dout_models.py "$OUT" $k
    step replay-$k python3 -m attn_doctor replay "$OUT/cap-$k" --out "$OUT/replay-$k"
  done
  tar -czf "$OUT/captures.tgz" -C "$OUT" $(cd "$OUT" && ls -d cap-* replay-*)  # a call brings back few files
fi
if [ "$1" = paired ]; then  # dout/README.md says which version of the capture each paired-*.txt ran
  for k in ${KINDS:-sdpa te te-layer}; do step paired-$k python3 reports/h200/capture/dout/paired_steps.py 300 $k; done
fi
