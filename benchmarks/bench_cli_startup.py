"""Benchmark the command line's start-up: `--help`, `--version` and an argument error, whole processes.

The goal (issue 14): each answers in under 0.5 s, because none of them imports torch. Prints, per command, the
median and the spread of the wall time over --repeats runs, and whether torch was imported (a separate run
that lists the loaded modules).

Usage: python benchmarks/bench_cli_startup.py [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
COMMANDS = {
    "--help": ["--help"],
    "--version": ["--version"],
    "run --help": ["run", "--help"],
    "argument error (run --heads 5 --kv-heads 2)": ["run", "--heads", "5", "--kv-heads", "2"],
    "bad list (sweep --seq x)": ["sweep", "--seq", "x"],
}
TORCH_CHECK = ("import sys\nfrom attn_doctor.cli import cli\nsys.argv = ['attn-doctor', *sys.argv[1:]]\n"
               "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
               "print('torch imported' if 'torch' in sys.modules else 'torch not imported', file=sys.stderr)\n")


def wall(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attn_doctor", *args], cwd=REPO, capture_output=True, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {options.repeats} runs each (after one warm-up)")
    print(f"{'command':48} {'median s':>9} {'min s':>7} {'max s':>7}  torch")
    for name, args in COMMANDS.items():
        wall(args)
        times = [wall(args) for _ in range(options.repeats)]
        check = subprocess.run([sys.executable, "-c", TORCH_CHECK, *args], cwd=REPO, capture_output=True, text=True)
        torch = check.stderr.strip().splitlines()[-1]
        print(f"{name:48} {statistics.median(times):9.3f} {min(times):7.3f} {max(times):7.3f}  {torch}")


if __name__ == "__main__":
    main()
