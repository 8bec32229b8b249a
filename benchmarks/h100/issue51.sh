#!/usr/bin/env bash
# Issue 51's device runs, one phase per call (the machine forgets everything when idle 30 s: make the calls back
# to back). From the project root on the GPU machine, after benchmarks/h100/stage-lease.sh's staging calls:
#   bash benchmarks/h100/issue51.sh PHASE DEST     (DEST: $OUT; gets PHASE.tgz)
# cold-new   env, then te-coverage from a cold start on this tree (the first sweep this machine runs)
# speed      te-coverage cold: the commit before (.device-base, carried) and this tree, then this tree profiled
# tests      te-tests cold on this tree, every path (te.flash: FlashAttention not installed yet), monitored
# fa4        te-tests' FlashAttention 4 families on te.flash (and the baseline)
# both       cold-new, then tests (COVERAGE_LIMIT, TESTS_LIMIT seconds each)
set -uo pipefail
phase=$1 dest=$2
root=$PWD
out=/tmp/issue51/$phase  # everything here; DEST gets one archive of it ($OUT brings back few files)
mkdir -p "$out" "$dest"
cold=(bash "$root/benchmarks/h100/cold-sweep.sh" "$out")
workers=()  # each tree's own default, unless WORKERS=N
[ -n "${WORKERS:-}" ] && workers=(--workers "$WORKERS")
case "$phase" in
  cold-new)
    PYTHONPATH=$root python3 -m attn_doctor env > "$out/env.txt" 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
    python3 -c "import importlib.metadata as m; print({p: m.version(p) for p in ('torch', 'transformer-engine', \
'flash-attn-4', 'nvidia-cudnn-cu13')})" > "$out/versions.txt" 2>&1
    DUMP_AT="${DUMP_AT:-60 120}" bash "$root/benchmarks/h100/monitor.sh" "$out" 10 &
    monitor=$!
    LIMIT=${LIMIT:-170} "${cold[@]}" coverage-new-cold "$root" --recipe te-coverage "${workers[@]}"
    kill "$monitor" 2>/dev/null ;;
  speed)
    "${cold[@]}" coverage-base "$root/.device-base" --recipe te-coverage "${workers[@]}"
    "${cold[@]}" coverage-new "$root" --recipe te-coverage "${workers[@]}"
    PROFILE=1 "${cold[@]}" coverage-new-profiled "$root" --recipe te-coverage "${workers[@]}" ;;
  tests)
    DUMP_AT="${DUMP_AT:-240 420}" bash "$root/benchmarks/h100/monitor.sh" "$out" 10 &
    monitor=$!
    LIMIT=${LIMIT:-500} "${cold[@]}" te-tests "$root" --recipe te-tests "${workers[@]}"
    kill "$monitor" 2>/dev/null ;;
  fa4)
    LIMIT=${LIMIT:-420} "${cold[@]}" te-tests-fa4 "$root" --recipe te-tests --family fa4_base,fa4_mla,fa4_swa,fa4_varlen,fa4_mask \
        "${workers[@]}" --backend te.flash --backend local ;;
  both)  # what one short lease allows: cold-new (te-coverage, the machine's first sweep), then tests, each archived
    LIMIT=${COVERAGE_LIMIT:-100} bash "$0" cold-new "$dest"
    LIMIT=${TESTS_LIMIT:-250} bash "$0" tests "$dest"
    exit 0 ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
cat "$out/times.txt" 2>/dev/null
tar czf "$dest/$phase.tgz" -C "$out" .
