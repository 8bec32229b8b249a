"""What recording the model's facts costs a captured run (issue 42): the weights' fingerprint, run settings and
data hash that `capture` takes once, at the model's first forward pass (`attn_doctor.tracing.model_facts`),
against one training step of the same model.

For each size of the CPU test model (`tests/models/megatron_gpt.py`, Megatron-Core's GPT with its local
attention), it runs the model without capture for --steps steps (the median step, the first left out), then
under `attn-doctor capture` (metadata only) and reads the seconds the capture's process spent on the model's
facts (`model-<PID>.json`'s "seconds"). Both runs are separate processes on this machine.

    python benchmarks/bench_weight_fingerprint.py --steps 6
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "models" / "megatron_gpt.py"
SIZES = {  # name: the test model's arguments
    "tiny (the tests' default)": ["--hidden", "64", "--heads", "4", "--seq", "16", "--batch", "2", "--layers", "3"],
    "h256 s256 b4 L4": ["--hidden", "256", "--heads", "8", "--seq", "256", "--batch", "4", "--layers", "4",
                        "--vocab", "1024"],
    "h512 s512 b4 L4": ["--hidden", "512", "--heads", "8", "--seq", "512", "--batch", "4", "--layers", "4",
                        "--vocab", "4096"],
}


def _step_seconds(arguments: list[str], steps: int, folder: Path) -> float:
    timings = folder / "timings"
    subprocess.run([sys.executable, str(MODEL), *arguments, "--steps", str(steps), "--timings", str(timings)],
                   check=True, capture_output=True)
    return statistics.median(float(line) for line in timings.read_text().split()[1:])


def _facts(arguments: list[str], folder: Path) -> dict:
    out = folder / "capture"
    subprocess.run([sys.executable, "-m", "attn_doctor", "capture", "--out", str(out), "--", sys.executable,
                    str(MODEL), *arguments], check=True, capture_output=True, cwd=ROOT)
    (path,) = glob.glob(str(out / "rank0" / "model-*.json"))
    return json.loads(Path(path).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3, help="captures per size (the median cost is kept)")
    args = parser.parse_args()
    rows = []
    for name, arguments in SIZES.items():
        with tempfile.TemporaryDirectory() as folder:
            step = _step_seconds(arguments, args.steps, Path(folder))
        costs, facts = [], {}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as folder:
                facts = _facts(arguments, Path(folder))
                costs.append(facts["seconds"])
        elements = sum(math.prod(w["shape"]) for w in facts["weights"])
        cost = statistics.median(costs)
        rows.append({"model": name, "parameters": len(facts["weights"]), "elements": elements,
                     "step_s": round(step, 4), "facts_s": round(cost, 5), "share_of_a_step": round(cost / step, 4),
                     "facts_runs_s": [round(c, 5) for c in costs]})
        print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main()
