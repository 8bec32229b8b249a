"""The device memory attn-doctor's processes hold together, sampled while a command runs, against the plan's
estimate of its peak (`attn_doctor.execution.memory_plan`, recorded in the results' "memory").

    python benchmarks/bench_memory.py --out DIR NAME='run --device cuda' NAME2='sweep --layers 24' ...

Each command is `python3 -m attn_doctor ARGS`, with its results sent to DIR/NAME (`--json DIR/NAME/results.json`
for run, `--out DIR/NAME` for sweep and replay). While it runs, NVML is read every --interval seconds: the device's
used memory less what was used before the command started (every process of attn-doctor's together, its CUDA
IPC mappings counted once), and each process's own use where NVML names it. Written: DIR/NAME.json (the samples'
peaks, the exit code, the wall time, the plan) and DIR/NAME.out (the command's own output), and a table of all
of them on stdout and in DIR/summary.md: estimate, measured peak, estimate / peak.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30


def _role(pid: int, root: int) -> str:
    """"parent", "worker FAMILY" or the command line's start, for a process of the command (a forked worker's
    command line is its fork server's: it is told by the name it took)."""
    if pid == root:
        return "parent"
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        name = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    if name.startswith("worker "):
        return name
    words = [a.decode(errors="replace") for a in args if a]
    if "attn_doctor.execution.worker" in words:
        return "worker " + " ".join(words[words.index("attn_doctor.execution.worker") + 1:][:1])
    return " ".join(words[:3])


def process_tree(root: int) -> set[int]:
    """`root` and every process under it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo += children.get(pid, [])
    return found


class Sampler:
    """NVML readings of one device in a thread: the largest device-used memory over the baseline, and per process."""

    def __init__(self, index: int, interval: float):
        import pynvml

        self.nvml = pynvml
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        self.interval = interval
        self.baseline = self.used()
        self.total = int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).total)
        self.peak = 0
        self.peak_at = 0.0
        self.per_process: dict[int, int] = {}
        self.roles: dict[int, str] = {}
        self.processes_at_peak: dict[int, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._root = None
        self._started = 0.0

    def used(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def processes(self) -> dict[int, int]:
        try:
            running = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except self.nvml.NVMLError:
            return {}
        return {int(p.pid): int(p.usedGpuMemory or 0) for p in running}

    def start(self, root: int) -> None:
        self._root, self._started = root, time.perf_counter()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self.used() - self.baseline
            ours = process_tree(self._root)
            processes = {pid: used_by for pid, used_by in self.processes().items() if pid in ours}
            for pid, used_by in processes.items():
                self.per_process[pid] = max(self.per_process.get(pid, 0), used_by)
                if pid not in self.roles:
                    self.roles[pid] = _role(pid, self._root)
            if used > self.peak:
                self.peak, self.peak_at, self.processes_at_peak = used, time.perf_counter() - self._started, processes
            self.samples += 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self.nvml.nvmlShutdown()


def _with_output(args: list[str], where: Path) -> list[str]:
    """The command with its results sent under `where`."""
    if args[0] == "run":
        return [*args, "--json", str(where / "results.json")]
    if args[0] in ("sweep", "replay"):
        return [*args, "--out", str(where)]
    return args


def measure(name: str, args: list[str], out: Path, index: int, interval: float) -> dict:
    where = out / name
    command = [sys.executable, "-m", "attn_doctor", *_with_output(args, where)]
    sampler = Sampler(index, interval)
    started = time.perf_counter()
    with open(out / f"{name}.out", "w") as log:
        log.write("$ " + shlex.join(["attn-doctor", *_with_output(args, where)]) + "\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "COLUMNS": "100"})
        sampler.start(proc.pid)
        code = proc.wait()
    wall = time.perf_counter() - started
    time.sleep(2 * interval)
    sampler.stop()
    results = where / "results.json" if (where / "results.json").exists() else None
    document = json.loads(results.read_text()) if results else {}
    plan = document.get("memory") or {}
    record = {
        "name": name, "command": "attn-doctor " + shlex.join(args), "exit": code, "wall_s": round(wall, 2),
        "peak_bytes": sampler.peak, "peak_at_s": round(sampler.peak_at, 2), "baseline_bytes": sampler.baseline,
        "device_total_bytes": sampler.total, "samples": sampler.samples, "interval_s": interval,
        "per_process_peak_bytes": {str(k): v for k, v in sampler.per_process.items()},
        "roles": {str(k): v for k, v in sampler.roles.items()},
        "processes_at_peak_bytes": {str(k): v for k, v in sampler.processes_at_peak.items()},
        "estimate_bytes": plan.get("estimate"), "budget": (plan.get("budget") or {}).get("bytes"),
        "plan": plan, "verdicts": _verdicts(document),
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=1))
    return record


def _verdicts(document: dict) -> dict[str, int]:
    counts: dict[str, int] = {}
    for row in document.get("results", []):
        counts[row.get("verdict", "")] = counts.get(row.get("verdict", ""), 0) + 1
    return counts


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / GIB:.2f}"


def summary(records: list[dict]) -> str:
    lines = ["| name | exit | wall s | budget GiB | estimate GiB | sampled peak GiB | estimate / peak | verdicts |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in records:
        ratio = f"{r['estimate_bytes'] / r['peak_bytes']:.2f}" if r["estimate_bytes"] and r["peak_bytes"] else ""
        verdicts = ", ".join(f"{v or 'none'} {n}" for v, n in sorted(r["verdicts"].items()))
        lines.append(f"| {r['name']} | {r['exit']} | {r['wall_s']:.1f} | {_gib(r['budget'])} | "
                     f"{_gib(r['estimate_bytes'])} | {_gib(r['peak_bytes'])} | {ratio} | {verdicts} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device-index", type=int, default=0, help="NVML's index of the GPU the commands use")
    parser.add_argument("--interval", type=float, default=0.05, help="seconds between NVML readings")
    parser.add_argument("commands", nargs="+", metavar="NAME=ARGS")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    for spec in args.commands:
        name, _, command = spec.partition("=")
        records.append(measure(name, shlex.split(command), args.out, args.device_index, args.interval))
        print(summary(records[-1:]).splitlines()[-1], flush=True)
    table = summary(records)
    (args.out / "summary.md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
