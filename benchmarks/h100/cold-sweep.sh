#!/usr/bin/env bash
# One sweep from as cold a start as this machine allows, timed from the command's start (TE's import counted):
#   bash benchmarks/h100/cold-sweep.sh OUT LABEL TREE [sweep options...]
# TREE is the folder whose attn_doctor/ runs (the project root, or .device-base for the commit before a change).
# Before the sweep: the kernel's page cache is dropped where the machine lets us (said in OUT/LABEL.txt), and the
# on-disk caches of CUDA's JIT (~/.nv/ComputeCache), Triton, the CuTe DSL, torch and attn-doctor's bytecode
# (core/bytecode.py) are removed; so every library is read from disk again, every runtime-compiled kernel is
# compiled again, and every Python source too. With PROFILE=1 every worker writes its cProfile to
# OUT/prof-LABEL/ (that costs time: never in a timed comparison).
set -uo pipefail
out=$1 label=$2 tree=$3; shift 3
mkdir -p "$out"
log="$out/$label.txt"
{
  sync
  if (echo 3 > /proc/sys/vm/drop_caches) 2>/dev/null; then echo "cold: page cache dropped"
  else echo "cold: page cache NOT dropped (not permitted here)"; fi
  rm -rf ~/.nv/ComputeCache ~/.triton ~/.cache/torch ~/.cache/cutlass* ~/.cache/flash_attn* /tmp/cutlass* \
      ~/.cache/attn-doctor/bytecode 2>/dev/null
  echo "cold: ~/.nv/ComputeCache, ~/.triton, ~/.cache/{torch,cutlass*,flash_attn*,attn-doctor/bytecode} removed"
} > "$log"
work=$(mktemp -d)
sweep_dir="$out/$label-sweep"  # streamed here, so a run cut short still leaves its finished points
rm -rf "$sweep_dir"
profile=()
[ "${PROFILE:-0}" = 1 ] && profile=(env "ATTN_DOCTOR_PROFILE_DIR=$out/prof-$label")
cpu_before=$(head -1 /proc/stat)  # the host's share: steal time (a hypervisor's other guests) over the sweep
start=$(date +%s.%N)
limit=()  # LIMIT=S: Ctrl-C (SIGINT) after S seconds; attn-doctor keeps the finished points and exits 130
[ -n "${LIMIT:-}" ] && limit=(timeout -s INT --kill-after=10 "$LIMIT")
(cd "$work" && PYTHONPATH="$tree" COLUMNS=100 "${profile[@]}" "${limit[@]}" python3 -m attn_doctor sweep \
    --device "${DEVICE:-cuda}" \
    --out "$sweep_dir" "$@" >> "$log" 2>&1)
rc=$?
end=$(date +%s.%N)
python3 - "$cpu_before" "$(head -1 /proc/stat)" >> "$log" <<'PY'
import sys
names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
before, after = ([int(x) for x in line.split()[1:9]] for line in sys.argv[1:3])
delta = dict(zip(names, (b - a for a, b in zip(before, after))))
total = sum(delta.values()) or 1
print("cpu over the sweep: " + ", ".join(f"{name} {100 * delta[name] / total:.1f} %" for name in names))
PY
cases=$(python3 -c "import json; print(int(json.load(open('$sweep_dir/results.json'))['seconds']['points']))" 2>/dev/null || echo 0)
python3 - "$label" "$rc" "$start" "$end" "$cases" <<'PY' | tee -a "$out/times.txt"
import sys
label, rc, start, end, cases = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
wall = end - start
print(f"{label}: exit {rc}, {cases} cases, wall {wall:.1f} s from the command's start = "
      f"{60 * cases / wall if wall else 0:.1f} cases a minute")
PY
gzip "$sweep_dir/results.jsonl" 2>/dev/null
ls -la ~/.cache ~/.nv 2>/dev/null | head -20 >> "$log"
du -sh ~/.nv/ComputeCache ~/.cache/attn-doctor/bytecode 2>/dev/null >> "$log"  # the JIT cache holds 256 MiB by default
rm -rf "$work"
