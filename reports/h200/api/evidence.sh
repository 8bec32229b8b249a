#!/bin/bash
# Issue 16's evidence on the H200: run from the project root on the device machine, with TE 2.20.2 and FA4
# installed (../shared/device: stage-te.sh, stage-fa4.sh). PART picks what runs (each fits one device call);
# what it wrote lands in $OUT/api-PART.tgz. Outputs stay in /tmp/api between calls on the same machine.
#   PART=1  versions; the default run (its wall time); the TE-coverage sweep, stopped at 8 minutes
#   PART=2  the TE-coverage sweep resumed to the end; its markdown report
#   PART=3  bisects and single runs named in BISECT (a file of `attn-doctor ...` argument lines)
# WORKERS sets the sweep's worker processes per backend family (default 2, what ran on 2026-12-03).
set -u
PART=${PART:-1}
export PYTHONPATH=$PWD
AD="python3 -m attn_doctor"
O=/tmp/api
mkdir -p "$O"

step() {  # step NAME COMMAND...: stdout+stderr, the exit code and the wall time in $O/NAME.txt
  local name=$1; shift
  local start=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$O/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s" >> "$O/$name.txt"
}

if [ "$PART" = 1 ]; then
  { nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
    python3 -c "import transformer_engine.pytorch, transformer_engine, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'te', transformer_engine.__version__)"
    python3 -c "import flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))"
  } > "$O/versions.txt" 2>&1
  step run-default $AD run --json "$O/run-default.json"
  step coverage timeout 480 $AD sweep --recipe te-coverage --timeout 90 --workers ${WORKERS:-2} --out "$O/coverage"
fi

if [ "$PART" = 2 ]; then
  step coverage-resumed timeout 470 $AD sweep --recipe te-coverage --timeout 90 --workers ${WORKERS:-2} --resume "$O/coverage"
  $AD report "$O/coverage" --format markdown > "$O/coverage.md" 2>&1
fi

if [ "$PART" = 3 ]; then
  i=0
  while IFS= read -r line; do
    [ -z "$line" ] && continue
    i=$((i + 1))
    eval "step extra-$i $AD $line"
  done < "${BISECT:-reports/h200/api/bisect.args}"
fi

tar czf "$OUT/api-$PART.tgz" --exclude="*.pt" -C /tmp api
