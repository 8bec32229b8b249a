"""The workers a sweep's plan gives each family, phase by phase, without running anything: a recipe's grid planned as
on a GPU host with TE (TE's paths counted as the device counts them: TE is not needed here), a given budget and cores.
Pure arithmetic (`attn_doctor.execution.memory_plan`): runs on any machine. It checks the weights
(`Backend.probe_seconds`) against a device run's measured work per family (reports/h100/issue51/lease5).

    python benchmarks/plan_workers.py --recipe te-tests --recipe te-coverage --budget-gib 75.2 --cores 16
"""

from __future__ import annotations

import argparse

from attn_doctor.backends import select
from attn_doctor.cli.options import build_cases
from attn_doctor.cli.sweep import sweep
from attn_doctor.execution import concurrency
from attn_doctor.execution.budget import GIB, MemoryBudget
from attn_doctor.execution.memory_plan import _demand, plan_phases
from attn_doctor.probes.plan import in_build_order, plan_points, static_skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", action="append", default=[])
    parser.add_argument("--budget-gib", type=float, default=75.2)  # the H100's 79.2 GiB free less the margin
    parser.add_argument("--cores", type=int, default=16)
    args = parser.parse_args(argv)
    concurrency.cpu_cores = lambda: args.cores
    budget = MemoryBudget(int(args.budget_gib * GIB), "cuda:0", f"{args.budget_gib} GiB", 80 * GIB)
    for recipe in args.recipe or ["te-coverage", "te-tests"]:
        cases, _, _, _, layouts = build_cases(dict(sweep.make_context("sweep", ["--recipe", recipe]).params))
        specs = select((), (), None, None)
        points = in_build_order(plan_points(cases, layouts))
        # TE's paths as on a GPU with TE: none of them is a static SKIP there for these grids (lease5's plans)
        groups = [[c for c in point.coords(specs) if c.backend.family == "te" or static_skip(c, "cuda") is None]
                  for point in points]
        work = _demand([c for group in groups for c in group], "cuda", 1).work
        print(f"{recipe}: work {', '.join(f'{key} {seconds:.0f} s' for key, seconds in sorted(work.items()))}")
        for chosen, plan in plan_phases(groups, "cuda", budget, None):
            print(f"  {len(chosen)} points: {', '.join(f'{k} {n}' for k, n in sorted(plan.workers.items()))}; "
                  f"{plan.live_references} references kept at once, estimate {plan.estimate / GIB:.1f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
