#!/bin/bash
# Issue 16's evidence on the H200: run from the project root on the device machine, with TE 2.20.2 and FA4
# installed (../shared/device: stage-te.sh, stage-fa4.sh). Every call runs the same command and carries on
# where the last one stopped (state in /tmp/api, kept between calls on one machine), until DEADLINE (epoch
# seconds; default: 560 s after this script starts), then packs what exists into $OUT/api.tgz:
#   versions; the default run (its wall time); the TE-coverage sweep (--resume after the first call); its
#   markdown report; bisects of the smallest case of each distinct TE fault
#   (benchmarks/evidence/pick_bisects.py, at most PICKS, default 4), then the attn-doctor argument lines of the
#   file EXTRA, if given.
# WORKERS sets the sweep's worker processes per backend family (default 3); API_DIR the state folder (default
# /tmp/api); DEFAULT_RUN=0 skips the default run; DIAGNOSE=1 runs diagnose.py (TE directly) first.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
DEADLINE=${DEADLINE:-$(( $(date +%s) + 560 ))}
AD="python3 -m attn_doctor"
O=${API_DIR:-/tmp/api}
mkdir -p "$O/done"

left() { echo $(( DEADLINE - $(date +%s) )); }
step() {  # step NAME COMMAND...: stdout+stderr, the exit code and the wall time in $O/NAME.txt
  local name=$1; shift
  local start=$(date +%s.%N)
  { echo "\$ $*"; "$@"; echo "exit $?"; } > "$O/$name.txt" 2>&1
  echo "wall $(python3 -c "print(round($(date +%s.%N) - $start, 1))") s" >> "$O/$name.txt"
}
finish() { tar czf "$OUT/$(basename "$O").tgz" --exclude="*.pt" -C "$(dirname "$O")" "$(basename "$O")"; ls "$O" "$O/done"; exit 0; }

if [ ! -e "$O/done/versions" ]; then
  { nvidia-smi -L; nvidia-smi --query-gpu=driver_version --format=csv,noheader
    python3 -c "import transformer_engine.pytorch, transformer_engine, transformer_engine_torch as tex, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'te', transformer_engine.__version__, 'cudnn (TE)', tex.get_cudnn_version())"
    python3 -c "import flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))"
  } > "$O/versions.txt" 2>&1 && touch "$O/done/versions"
fi
if [ "${DIAGNOSE:-0}" = 1 ] && [ ! -e "$O/done/diagnose" ]; then
  step diagnose python3 reports/h200/api/diagnose.py; touch "$O/done/diagnose"
fi
if [ "${DEFAULT_RUN:-1}" = 1 ] && [ ! -e "$O/done/run-default" ]; then
  step run-default $AD run --json "$O/run-default.json"; touch "$O/done/run-default"
fi

# The coverage sweep, resumed by each call until it ends on its own (exit 0 or 1, not timeout's 124).
n=0
while [ ! -e "$O/done/coverage" ] && [ "$(left)" -gt 60 ]; do
  n=$((n + 1))
  resume=""; [ -e "$O/coverage/sweep.json" ] && resume="--resume"
  step "coverage-$(date +%s)" timeout $(( $(left) - 30 )) $AD sweep --recipe te-coverage --timeout 90 \
      --workers ${WORKERS:-3} --out "$O/coverage" $resume
  last=$(ls -t "$O"/coverage-*.txt | head -1)
  grep -q "^exit 124" "$last" || touch "$O/done/coverage"
done
[ -e "$O/done/coverage" ] || finish

if [ ! -e "$O/done/report" ]; then
  $AD report "$O/coverage" --format markdown > "$O/coverage.md" 2>&1
  python3 benchmarks/evidence/pick_bisects.py "$O/coverage" --limit ${PICKS:-4} --out "$O" > "$O/bisect.args" \
      2> "$O/bisect-picks.txt"
  [ -n "${EXTRA:-}" ] && sed "s#\$O#$O#g" "$EXTRA" >> "$O/bisect.args"
  touch "$O/done/report"
fi

i=0
while IFS= read -r line; do
  i=$((i + 1))
  [ -e "$O/done/bisect-$i" ] && continue
  [ "$(left)" -gt 90 ] || break
  eval "step bisect-$i timeout $(( $(left) - 20 )) $AD $line"
  grep -q "^exit 124" "$O/bisect-$i.txt" || touch "$O/done/bisect-$i"
done < "$O/bisect.args"
finish
