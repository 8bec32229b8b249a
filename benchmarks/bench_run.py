"""Benchmark a whole `attn-doctor run` and a 100-case `sweep`, against their unavoidable parts.

Baselines measured in the same run: the interpreter + torch (+ TE) import, CUDA initialisation, and a
one-process-per-backend `run` (what the tool would cost without long-lived workers).

    python benchmarks/bench_run.py --repeats 3 --sweep
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "attn_doctor"]


def wall(cmd: list[str], cwd: str, env: dict | None = None) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    return time.perf_counter() - start, proc.returncode, proc.stdout + proc.stderr


def median_wall(cmd, cwd, repeats, env=None) -> tuple[float, list[float], str]:
    runs, out = [], ""
    for _ in range(repeats):
        seconds, _, out = wall(cmd, cwd, env)
        runs.append(seconds)
    return statistics.median(runs), runs, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sweep", action="store_true", help="also time the 100-case sweep grid")
    parser.add_argument("--sweep-only", action="store_true", help="time only the 100-case sweep grid")
    parser.add_argument("--no-parts", action="store_true", help="skip the import and CUDA-init baselines")
    parser.add_argument("--no-per-backend", action="store_true",
                        help="skip the one-process-per-backend baseline (a few minutes on a GPU)")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    work = tempfile.mkdtemp(prefix="attn-doctor-bench-")
    results: dict = {}

    parts = {
        "python + import torch": [sys.executable, "-c", "import torch"],
        "python + import torch + CUDA init": [sys.executable, "-c", "import torch; torch.zeros(1, device='cuda')"],
        "python + import transformer_engine.pytorch": [sys.executable, "-c", "import transformer_engine.pytorch"],
    }
    for name, cmd in ({} if args.sweep_only or args.no_parts else parts).items():
        median, runs, _ = median_wall(cmd, work, args.repeats, env)
        results[name] = {"median_s": median, "runs": runs}
        print(json.dumps({name: results[name]}), flush=True)

    if args.sweep_only:
        args.sweep = True
    else:
        time_runs(work, env, args.repeats, results, per_backend=not args.no_per_backend)
    if args.sweep:
        time_sweep(work, env, results)
    Path(work, "bench_run.json").write_text(json.dumps(results, indent=2))
    print(f"\nwritten: {work}/bench_run.json")


def time_runs(work: str, env: dict, repeats: int, results: dict, per_backend: bool = True) -> None:
    median, runs, out = median_wall(CLI + ["run", "--profile", "--json", f"{work}/run.json"], work, repeats, env)
    results["attn-doctor run (default case, all backends x layouts)"] = {"median_s": median, "runs": runs,
                                                                         "profile_of_last": out[-1500:]}
    print(json.dumps({"run": results["attn-doctor run (default case, all backends x layouts)"]}), flush=True)

    if not per_backend:
        return
    backends = [r["backend"] for r in json.loads(Path(f"{work}/run.json").read_text())["results"]]
    each = []
    for backend in dict.fromkeys(backends):
        seconds, _, _ = wall(CLI + ["run", "--backend", backend, "--json", f"{work}/one.json"], work, env)
        each.append((backend, seconds))
    results["one process per backend (sum of runs)"] = {"sum_s": sum(s for _, s in each), "each": each}
    print(json.dumps({"one process per backend": results["one process per backend (sum of runs)"]}), flush=True)


SWEEP_GRID = ["--seq", "256,512,1024,2048,4096", "--head-dim", "64,128", "--kv-heads", "16,8,4,2,1",
              "--mask", "causal,none"]  # 5 x 2 x 5 x 2 = 100 cases, each all backends x all layouts


def time_sweep(work: str, env: dict, results: dict, limit_s: float = 480.0) -> None:
    """The 100-case grid; past `limit_s` the sweep is stopped and the rate is taken from the finished points."""
    start = time.perf_counter()
    try:
        code = subprocess.run(CLI + ["sweep", *SWEEP_GRID, "--out", f"{work}/sweep"], cwd=work, env=env,
                              capture_output=True, timeout=limit_s).returncode
    except subprocess.TimeoutExpired:
        code = "stopped at the time limit"
    seconds = time.perf_counter() - start
    lines = Path(f"{work}/sweep/results.jsonl").read_text().splitlines()
    points = len({json.loads(line)["point"] for line in lines})
    results["sweep, 100-case grid"] = {"wall_s": seconds, "points_done": points, "rows": len(lines),
                                       "cases_per_minute": points / seconds * 60, "exit": code}
    print(json.dumps({"sweep": results["sweep, 100-case grid"]}), flush=True)


if __name__ == "__main__":
    main()
