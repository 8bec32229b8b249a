"""How many worker processes each backend family gets when the user does not say (`sweep --workers`).

On a GPU a sweep's probes are mostly first calls, and a first call's time is mostly the CPU's, not the card's (cuDNN
builds each configuration's kernel on its first call: about 1.1 s of host CPU for a new one on the H100 with TE
2.20.2, where the same call again takes 2.4 ms; reports/h100/issue51/lease4/cost), spent in the one process that
makes it. So a sweep goes as fast as the processes it runs at once, up to the machine's cores, and the card's memory
is what limits them (`memory_plan.plan_memory` runs fewer where they do not fit, taking from the family with the
most workers for its work first). The cores are shared among the families in proportion to their work: their
probes, each weighed by what a probe of its path takes (`Backend.probe_seconds`, measured per probe the plan counts:
te.fused 0.37 s, sdpa.cudnn 0.25 s, sdpa.flash 0.035 s). Counted by probes alone, te-coverage's 7 TE workers were
the critical path while its 6 SDPA workers idled half the time (reports/h100/issue51/lease3); weighed by seconds
averaged over every row, static SKIPs too, te-tests gave TE 11 workers to SDPA's 2 and waited for SDPA (lease5;
now 10 to 3, as that run's measured work gives, not yet measured). Each family gets at least `FLOOR` workers
where it has that many units, at most one per unit. On the CPU every process
computes with all the cores it is given (`session.cpu_threads` shares them out), so one worker per family.
"""

from __future__ import annotations

import os

FLOOR = 2  # workers per family on a GPU, at least (where it has that many units)


def cpu_cores() -> int:
    """The cores this process may run on (its affinity: a container's or a batch job's share), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_workers(work: dict[str, float], units: dict[str, int], device: str, cores: int | None = None
                    ) -> dict[str, int]:
    """Workers per process key (`backends.process_of`) when --workers is not given: `work` (its probes' seconds,
    `Backend.probe_seconds` each) and `units` (the (point, case) pieces a worker takes whole) per key. On a GPU the
    cores less the parent's, shared in proportion to the work, at least FLOOR and at most the units; on the CPU one
    each."""
    if not device.startswith("cuda"):
        return {key: 1 for key in work}
    slots = max(1, (cores or cpu_cores()) - 1)  # the parent computes the float64 references and judges
    total = sum(work.values()) or 1.0
    return {key: max(1, min(units.get(key, 1), max(FLOOR, round(slots * seconds / total))))
            for key, seconds in work.items()}
