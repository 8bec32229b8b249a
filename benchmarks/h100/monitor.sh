#!/usr/bin/env bash
# Every PERIOD seconds until killed, what attn-doctor's processes are doing (state, kernel wait channel, CPU, the
# GPU's processes, use, clocks and power, each process's share of the SMs, and the host's and each process's CPU
# since the sample before) into DIR/monitor.log; at the seconds
# in DUMP_AT (e.g. "150 280"), every worker's Python stacks (SIGUSR1: faulthandler) copied from its stderr into
# DIR/stacks-T-PID.txt: where a stalled sweep waits.
#   bash benchmarks/h100/monitor.sh DIR [PERIOD] &
dir=$1 period=${2:-15}
mkdir -p "$dir"
start=$(date +%s)
while :; do
  now=$(( $(date +%s) - start ))
  {
    echo "== $(date +%T) (+${now}s)"
    # a forked worker shows its fork server's command line; its name (comm) says "worker FAMILY"
    ps -eo pid,ppid,etimes,stat,wchan:24,pcpu,rss,comm,args --sort=pid | grep -E "attn_doctor|PID" | grep -v grep | cut -c1-200
    nvidia-smi --query-gpu=utilization.gpu,memory.used,clocks.sm,clocks.mem,power.draw,clocks_throttle_reasons.active \
        --format=csv,noheader 2>&1
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1
    # which process uses the GPU's SMs (one sample: pid, sm %, mem %): who a busy GPU is busy for
    nvidia-smi pmon -c 1 -s u 2>&1 | awk '!/^#/ && $4 != "-" {print "pmon", $2, "sm", $4, "mem", $5}'
    # the host's CPU and each process's since the last sample (ps's %CPU above is over a process's whole life)
    python3 - "$dir/.cpu-before" <<'PY'
import json, os, sys, time
before_path = sys.argv[1]
try:
    before = json.load(open(before_path))
except (OSError, ValueError):
    before = None
now = {"t": time.time(), "stat": open("/proc/stat").readline().split()[1:9], "pids": {}}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        if b"attn_doctor" not in open(f"/proc/{pid}/cmdline", "rb").read():
            continue
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        now["pids"][pid] = [int(fields[11]) + int(fields[12]), open(f"/proc/{pid}/comm").read().strip()]
    except OSError:
        pass
if before:
    seconds, ticks = now["t"] - before["t"], os.sysconf("SC_CLK_TCK")
    delta = [int(b) - int(a) for a, b in zip(before["stat"], now["stat"])]
    total = sum(delta) or 1
    print(f"host cpu over {seconds:.0f} s: busy {100 * (total - delta[3] - delta[4]) / total:.0f} %")
    print("cpu % over it: " + ", ".join(f"{pid} {name} {100 * (t - before['pids'][pid][0]) / ticks / seconds:.0f}"
                                        for pid, (t, name) in sorted(now["pids"].items()) if pid in before["pids"]))
json.dump(now, open(before_path, "w"))
PY
  } >> "$dir/monitor.log"
  for t in ${DUMP_AT:-}; do
    if [ "$now" -ge "$t" ] && [ ! -e "$dir/.dumped-$t" ]; then
      touch "$dir/.dumped-$t"
      # workers older than 20 s only: a newer one may not have its SIGUSR1 handler yet (the signal would end it)
      # (fork servers too: they registered it after their imports, which take less than that)
      for pid in $(ps -eo pid,etimes,args | awk '/attn_doctor.execution.(worker|fork_server)/ && !/awk/ && $2 > 20 {print $1}'); do
        kill -USR1 "$pid" 2>/dev/null; sleep 1
        tail -c 20000 "/proc/$pid/fd/2" > "$dir/stacks-$t-$pid.txt" 2>/dev/null
      done
      # the command itself (its serving threads): its stderr is the sweep's log, where the stacks land
      for pid in $(ps -eo pid,etimes,args | awk '/-m attn_doctor (sweep|run)/ && !/awk|timeout/ && $2 > 5 {print $1}'); do
        kill -USR1 "$pid" 2>/dev/null
      done
    fi
  done
  sleep "$period"
done
