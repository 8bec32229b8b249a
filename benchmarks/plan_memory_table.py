"""What the memory plan says, without running anything: the estimate of the peak, the workers at once and whether the
families take turns, for the grid of benchmarks/bench_memory.py on a GPU with a given budget (every built-in path,
TE's included, as on a GPU with TE). Pure arithmetic (`attn_doctor.execution.memory_plan`): runs on any machine.

    python benchmarks/plan_memory_table.py --budgets 75,48,24
"""

from __future__ import annotations

import argparse

from attn_doctor.backends import select
from attn_doctor.cli.options import build_cases
from attn_doctor.core.case import make_case
from attn_doctor.core.errors import BadInput
from attn_doctor.execution.budget import GIB, MemoryBudget
from attn_doctor.execution.memory_plan import plan_memory
from attn_doctor.probes.plan import plan_calls, plan_depth, plan_points

CARD = 80 * GIB


def grid() -> dict[str, tuple[list, int]]:
    """name -> (the probes, workers per family asked)."""
    specs = select([])
    default = make_case()
    coverage, _, _, _, layouts = build_cases({"recipe": "te-coverage"})
    return {
        "default run": (plan_calls(default, specs, []), 1),
        "sweep --layers 24": (plan_depth(default, specs, [24], [1]), 1),
        "sweep --layers 24,128": (plan_depth(default, specs, [24, 128], [1]), 1),
        "run --batch 1 --heads 1 --seq 32768": (plan_calls(make_case(batch=1, heads=1, seq=32768), specs, []), 1),
        "run --batch 1 --heads 1 --seq 131072": (plan_calls(make_case(batch=1, heads=1, seq=131072), specs, []), 1),
        "sweep --recipe te-coverage": ([c for p in plan_points(coverage, layouts) for c in p.coords(specs)], 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="75,48,24", help="GiB, comma separated")
    args = parser.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    print("| request | " + " | ".join(f"{b:g} GiB budget" for b in budgets) + " |")
    print("| --- |" + " --- |" * len(budgets))
    for name, (coords, workers) in grid().items():
        cells = []
        for gib in budgets:
            budget = MemoryBudget(int(gib * GIB), "cuda:0", f"{gib:g} GiB", CARD)
            try:
                plan = plan_memory(coords, "cuda", budget, workers)
            except BadInput as refused:
                cells.append("refused: " + str(refused).split(" of memory")[0].split("needs ")[-1])
                continue
            how = "in turn" if plan.serial else "side by side"
            at_once = "/".join(str(n) for n in plan.workers.values())
            cells.append(f"{plan.estimate / GIB:.1f} GiB, {how}, workers {at_once}")
        print(f"| `{name}` | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
