"""Benchmark the first thing a user runs, `attn-doctor run` (the default case, on the CPU), against torch's own
start plus one bf16 attention call of the default shape.

The yardstick is `python -c "import torch; <SDPA forward of b4 s1024 h16 d64 bf16, causal>"`: what any check of
that case costs at the least on this machine. Prints each run's wall time, the medians and their ratio, the
machine (lscpu's model name), the versions, the bf16 matmul rate attn-doctor measures, and the run's first
line (what the CPU sizing says, if anything).

`--emulate-slow-bf16` runs both with oneDNN held to AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`):
on a CPU with AVX512-BF16 or AMX, bf16 products then run as slowly as on one without them. `--tree DIR` runs
the attn_doctor package found in DIR (e.g. the previous commit's, from `git archive HEAD attn_doctor | tar -x
-C DIR`).

    python benchmarks/bench_first_run.py --repeats 3 [--emulate-slow-bf16] [--tree DIR]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SLOW_BF16 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
YARDSTICK = ("import torch\n"
             "q, k, v = (torch.randn(4, 16, 1024, 64, dtype=torch.bfloat16) for _ in range(3))\n"
             "torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)\n")
RATE = ("from attn_doctor.machine.matmul_rate import cpu_matmul_gflops\n"
        "print(f'{cpu_matmul_gflops(\"bf16\"):.2f} GFLOP/s bf16, {cpu_matmul_gflops(\"fp32\"):.2f} GFLOP/s fp32')\n")


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def load() -> str:
    try:
        return Path("/proc/loadavg").read_text().split()[0]
    except OSError:
        return "?"


def timed(cmd: list[str], env: dict[str, str], cwd: str) -> tuple[float, subprocess.CompletedProcess]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, check=False)
    return time.perf_counter() - start, proc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--emulate-slow-bf16", action="store_true", help="hold oneDNN to AVX2 (slow bf16 products)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="the folder holding the attn_doctor package to run")
    options = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(options.tree.resolve())}
    if options.emulate_slow_bf16:
        env.update(SLOW_BF16)
    import torch

    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; python {platform.python_version()}, torch {torch.__version__}")
    print(f"tree: {options.tree}; slow bf16 emulated: {options.emulate_slow_bf16}")
    rate = subprocess.run([sys.executable, "-c", RATE], env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, check=False)
    print(f"attn-doctor's rate probe (one thread): {(rate.stdout or rate.stderr).strip()}")
    runs, yardsticks = [], []
    for repeat in range(options.repeats):
        seconds, _ = timed([sys.executable, "-c", YARDSTICK], env, str(ROOT))
        yardsticks.append(seconds)
        with tempfile.TemporaryDirectory(prefix="attn-doctor-first-run-") as work:
            before = load()
            seconds, proc = timed([sys.executable, "-m", "attn_doctor", "run", "--device", "cpu"], env, work)
        runs.append(seconds)
        first = proc.stdout.splitlines()[0].strip() if proc.stdout else ""
        beats = sum(line.startswith("attn-doctor: ") and "done" in line for line in proc.stderr.splitlines())
        print(f"run {repeat + 1}: {seconds:.1f} s (exit {proc.returncode}, load {before}, {beats} heartbeat lines); "
              f"yardstick {yardsticks[-1]:.2f} s; first line: {first[:110]}", flush=True)
    run_s, yardstick_s = statistics.median(runs), statistics.median(yardsticks)
    print(f"attn-doctor run (default case, CPU): median {run_s:.1f} s ({', '.join(f'{s:.1f}' for s in runs)})")
    print(f"import torch + one bf16 attention call of the default shape: median {yardstick_s:.2f} s "
          f"({', '.join(f'{s:.2f}' for s in yardsticks)})")
    print(f"ratio: {run_s / yardstick_s:.1f}x")


if __name__ == "__main__":
    main()
