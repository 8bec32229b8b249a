"""The RAM attn-doctor's processes hold together on the CPU, sampled while a command runs: the CPU side of
benchmarks/bench_memory.py (which samples a GPU), for the plan's estimate of the RAM a request needs.

    python benchmarks/bench_ram.py attn-doctor run --device cpu --max-memory 16GiB --json r/results.json

Every 0.2 s it sums the proportional set size (PSS: shared pages split among the processes that map them, so
torch's libraries are not counted once per process) of the command and every process under it, from
/proc/PID/smaps_rollup, and prints one JSON line at the end: the exit code, the peak in GiB and the wall time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench_memory import process_tree  # the process and every one under it, from /proc


def _pss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def main(command: list[str]) -> int:
    started = time.perf_counter()
    proc = subprocess.Popen(command)
    peak = 0
    while proc.poll() is None:
        peak = max(peak, sum(_pss(pid) for pid in process_tree(proc.pid)))
        time.sleep(0.2)
    print(json.dumps({"command": command, "exit": proc.returncode, "peak_pss_gib": round(peak / 2**30, 2),
                      "wall_s": round(time.perf_counter() - started, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
