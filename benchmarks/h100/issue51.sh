#!/usr/bin/env bash
# Issue 51's device runs, one phase per call (the machine forgets everything when idle 30 s: make the calls back
# to back). From the project root on the GPU machine, after benchmarks/h100/stage-lease.sh's staging calls:
#   bash benchmarks/h100/issue51.sh PHASE DEST     (DEST: $OUT; gets PHASE.tgz)
# cold-new   env, then te-coverage from a cold start on this tree (the first sweep this machine runs)
# pair       env, then te-coverage cold on this tree, then on .device-base (paired; on a fresh machine this tree's
#            run is the machine's first sweep)
# importcheck TE's import cold (page cache dropped) as the image is, again, and with its sources compiled ahead into
#            a private prefix on 16 processes (benchmarks/import_cost.py): how much is compiling sources
# forkcheck  two workers of each of TE's and SDPA's kinds started as a sweep starts them: forked from a fork server
#            (their hellos say so, with the server's threads) or launched, and how long each start took
# speed      te-coverage cold: the commit before (.device-base, carried) and this tree (PROFILE=1: then this tree
#            profiled)
# diskcheck  the first thing on a fresh machine (a machine's first sweeps were slower in every call, small ones too:
#            reports/h100/issue51/lease5): the host's CPU (a fixed Python workload on 1 and on 16 processes, and
#            steal time), then reading the libraries a TE worker loads, cold and again after drop_caches; run it again
#            after the sweeps to compare
# tests      te-tests cold on this tree (BASE=1: on .device-base), every path (te.flash: no FlashAttention yet), monitored
# fa4        te-tests' FlashAttention 4 families on te.flash (and the baseline)
# cost       where a TE probe's time goes: benchmarks/te_probe_cost.py (1 process cold, 7 at once cold, 7 warm), then a sixth of
#            te-coverage cold on TE's paths with one worker, profiled (its worker's cProfile summarised)
# bisect     the te-tests FAILs no known-defect rule explained (lease 3): each bisected, at most BISECT_LIMIT s
# both       cold-new, then tests (COVERAGE_LIMIT, TESTS_LIMIT seconds each)
set -uo pipefail
phase=$1 dest=$2
root=$PWD
out=/tmp/issue51/$phase  # everything here; DEST gets one archive of it ($OUT brings back few files)
mkdir -p "$out" "$dest"
cold=(bash "$root/benchmarks/h100/cold-sweep.sh" "$out")
workers=()  # each tree's own default, unless WORKERS=N
[ -n "${WORKERS:-}" ] && workers=(--workers "$WORKERS")
machine_facts() {  # the machine and the versions a run's numbers belong to, into $out
    PYTHONPATH=$root python3 -m attn_doctor env > "$out/env.txt" 2>&1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
    python3 - > "$out/versions.txt" 2>&1 <<'PY'
import importlib.metadata as m
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return "not installed"
print({name: version(name) for name in ("torch", "transformer-engine", "flash-attn-4", "nvidia-cudnn-cu13")})
PY
}
case "$phase" in
  cold-new)
    machine_facts
    DUMP_AT="${DUMP_AT:-60 120}" bash "$root/benchmarks/h100/monitor.sh" "$out" 10 &
    monitor=$!
    LIMIT=${LIMIT:-170} "${cold[@]}" coverage-new-cold "$root" --recipe te-coverage "${workers[@]}"
    kill "$monitor" 2>/dev/null ;;
  pair)
    # te-coverage cold on this tree, then on .device-base (the commit before, carried): the first on a fresh machine
    # is this tree's, the machine's first sweep; monitored every 5 s
    machine_facts
    n=$(ls -d "$out"/coverage-new* 2>/dev/null | grep -c -v -- -sweep)  # a second call numbers its runs on
    for tree in new base; do
        label=coverage-$tree$([ "$n" -gt 0 ] && echo "-$((n + 1))")
        DUMP_AT="" bash "$root/benchmarks/h100/monitor.sh" "$out/monitor-$label" 5 &
        monitor=$!
        dir=$root; [ "$tree" = base ] && dir=$root/.device-base
        LIMIT=${LIMIT:-150} "${cold[@]}" "$label" "$dir" --recipe te-coverage "${workers[@]}"
        kill "$monitor" 2>/dev/null
    done ;;
  importcheck)
    # TE's import as a fork server does it (the cold start's critical path), page cache dropped first: as the image
    # is (no bytecode for torch, PYTHONDONTWRITEBYTECODE=1), twice, then with the sources it loaded compiled on 16
    # processes into a private prefix, then with every source of the packages it touched so compiled (what
    # core/bytecode.py does): wall, CPU, pages read from disk, -X importtime's slowest modules
    sync; echo 3 > /proc/sys/vm/drop_caches
    python3 "$root/benchmarks/import_cost.py" "$out" --jobs 16 > "$out/importcheck.txt" 2>&1
    cat "$out/importcheck.txt" ;;
  forkcheck)
    PYTHONPATH=$root python3 - > "$out/forkcheck.txt" 2>&1 <<'PY'
import json, time
from attn_doctor.execution.pool import Worker
for family in ("te", "sdpa"):
    pair = [Worker(family, "cuda", 120.0) for _ in range(2)]
    for worker in pair:
        started = time.perf_counter()
        why = worker.ensure_started()
        print(json.dumps({"family": family, "start_s": round(time.perf_counter() - started, 3), "failed": why,
                          "hello": worker.hello}, default=str))
    for worker in pair:
        worker.close()
PY
    cat "$out/forkcheck.txt" ;;
  diskcheck)
    python3 - >> "$out/diskcheck.txt" <<'PY'
import multiprocessing, time

def work(_):
    start = time.perf_counter()
    total = 0
    for i in range(15_000_000):
        total += i * i % 7
    return time.perf_counter() - start

with open("/proc/stat") as f:
    before = [int(x) for x in f.readline().split()[1:9]]
one = work(0)
with multiprocessing.Pool(16) as pool:
    sixteen = pool.map(work, range(16))
with open("/proc/stat") as f:
    after = [int(x) for x in f.readline().split()[1:9]]
delta = [b - a for a, b in zip(before, after)]
print(f"{time.strftime('%T')} cpu: one process {one:.2f} s; 16 at once {min(sixteen):.2f}-{max(sixteen):.2f} s; "
      f"steal {100 * delta[7] / (sum(delta) or 1):.1f} % meanwhile")
PY
    python3 - > "$out/libraries.txt" <<'PY'
import glob, site
found = set()
for root in site.getsitepackages():
    for pattern in ("torch/lib/*.so*", "nvidia/*/lib/*.so*", "transformer_engine*/**/*.so*"):
        found.update(glob.glob(f"{root}/{pattern}", recursive=True))
found.update(glob.glob("/usr/lib/x86_64-linux-gnu/libcudnn*.so.9*"))
print("\n".join(sorted(found)))
PY
    for round in first again-after-drop_caches; do
        if [ "$round" != first ]; then sync; echo 3 > /proc/sys/vm/drop_caches; fi
        python3 - "$out/libraries.txt" "$round" >> "$out/diskcheck.txt" <<'PY'
import os, sys, time
paths = open(sys.argv[1]).read().split()
start, total = time.perf_counter(), 0
for path in paths:
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            total += len(chunk)
seconds = time.perf_counter() - start
print(f"{sys.argv[2]}: {len(paths)} libraries, {total / 2**30:.2f} GiB in {seconds:.1f} s ({total / 2**20 / seconds:.0f} MiB/s)")
PY
    done
    cat "$out/diskcheck.txt" ;;
  speed)
    DUMP_AT="${DUMP_AT:-}" bash "$root/benchmarks/h100/monitor.sh" "$out/monitor-base" 5 &
    monitor=$!
    "${cold[@]}" coverage-base "$root/.device-base" --recipe te-coverage "${workers[@]}"
    kill "$monitor" 2>/dev/null
    DUMP_AT="${DUMP_AT:-}" bash "$root/benchmarks/h100/monitor.sh" "$out/monitor-new" 5 &
    monitor=$!
    "${cold[@]}" coverage-new "$root" --recipe te-coverage "${workers[@]}"
    kill "$monitor" 2>/dev/null
    if [ "${PROFILE:-0}" = 1 ]; then
        PROFILE=1 "${cold[@]}" coverage-new-profiled "$root" --recipe te-coverage "${workers[@]}"
    fi ;;
  tests)
    # BASE=1: the commit before (.device-base, carried), for a paired run in the same lease
    tree=$root label=${LABEL:-te-tests}  # LABEL: a third run's name (e.g. with a variable of CUDA's changed)
    [ "${BASE:-0}" = 1 ] && tree=$root/.device-base label=${LABEL:-te-tests-base}
    DUMP_AT="${DUMP_AT:-240 420}" bash "$root/benchmarks/h100/monitor.sh" "$out/monitor-$label" 10 &
    monitor=$!
    LIMIT=${LIMIT:-500} "${cold[@]}" "$label" "$tree" --recipe te-tests "${workers[@]}"
    kill "$monitor" 2>/dev/null ;;
  fa4)
    LIMIT=${LIMIT:-420} "${cold[@]}" te-tests-fa4 "$root" --recipe te-tests --family fa4_base,fa4_mla,fa4_swa,fa4_varlen,fa4_mask \
        "${workers[@]}" --backend te.flash --backend local ;;
  cost)
    # 1 process with CUDA's JIT cache emptied, 7 at once emptied again, 7 at once keeping what those built
    for run in "1 cold" "7 cold" "7 warm"; do
        set -- $run
        [ "$2" = cold ] && rm -rf ~/.nv/ComputeCache ~/.triton ~/.cache/torch 2>/dev/null
        mkdir -p "$out/c-$1-$2"
        python3 "$root/benchmarks/te_probe_cost.py" "$out/c-$1-$2" --processes "$1" > "$out/c-$1-$2/log.txt" 2>&1
    done
    PROFILE=1 LIMIT=${LIMIT:-150} "${cold[@]}" te-profiled "$root" --recipe te-coverage --shard 1/6 \
        --backend te.fused --backend te.fused.det --backend te.unfused --workers 1
    python3 - "$out"/prof-te-profiled > "$out/te-profiled-summary.txt" 2>&1 <<'PY'
import glob, pstats, sys
for path in sorted(glob.glob(sys.argv[1] + "/worker-*.prof")):
    print(f"==== {path}")
    stats = pstats.Stats(path)
    stats.sort_stats("cumulative").print_stats(45)
    stats.sort_stats("tottime").print_stats(30)
PY
    ;;
  bisect)
    bisect=(timeout -s INT --kill-after=10 "${BISECT_LIMIT:-150}" env PYTHONPATH="$root" COLUMNS=100 python3 -m attn_doctor bisect --device cuda)
    # te.fused.det, MLA one-token queries: dQ 83-646x the baseline's error (te.fused passes)
    "${bisect[@]}" --backend te.fused.det --batch 8 --seq 1 --seq-kv 2048 --heads 16 --head-dim 160 --head-dim-v 128 \
        --dtype bf16 --mask no_mask --qkv-format bshd --out "$out/bisect-mla-det" > "$out/bisect-mla-det.txt" 2>&1
    echo "bisect mla-det: exit $?" >> "$out/exit-codes.txt"
    # te.fused FP8 delayed, padding with one ragged sequence (1577 of 2048): out 8x its yardstick
    "${bisect[@]}" --backend te.fused --batch 1 --seq 2048 --heads 32 --kv-heads 4 --head-dim 128 --dtype bf16 \
        --mask padding --seqlens 1577 --fp8 delayed --out "$out/bisect-fp8-padding" > "$out/bisect-fp8-padding.txt" 2>&1
    echo "bisect fp8-padding: exit $?" >> "$out/exit-codes.txt"
    cat "$out/exit-codes.txt" ;;
  both)  # what one short lease allows: cold-new (te-coverage, the machine's first sweep), then tests, each archived
    LIMIT=${COVERAGE_LIMIT:-100} bash "$0" cold-new "$dest"
    LIMIT=${TESTS_LIMIT:-250} bash "$0" tests "$dest"
    exit 0 ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
cat "$out/times.txt" 2>/dev/null
tar czf "$dest/$phase.tgz" -C "$out" .
