"""Probes: what a worker process does with one set of coordinates (`attn_doctor.core.coords`).

Each kind that runs in a worker is one module with `run(backend, coords, caches, progress)` (CALL's also
takes `repeats`: `--repeats N`); DISTRIBUTED probes run on torchrun ranks instead (`attn_doctor.distributed`).
A layer path's single call (`Backend.layer_path`: TE's MultiheadAttention and TransformerLayer) is the whole
layer, probed by `module`.
`plan` turns requests into coordinates.
"""

from __future__ import annotations

from attn_doctor.backends import Backend
from attn_doctor.core.coords import Coords, ProbeKind
from attn_doctor.probes import call, depth, module, tp
from attn_doctor.probes.caches import Caches, Progress
from attn_doctor.probes.outcome import ProbeOutcome

RUNNERS = {ProbeKind.CALL: call.run, ProbeKind.TP: tp.run, ProbeKind.DEPTH: depth.run}


def run_probe(backend: Backend, coords: Coords, caches: Caches, progress: Progress | None = None,
              repeats: int = 1) -> ProbeOutcome:
    """Run `backend` at `coords`: an "ok" outcome with metrics, or "skip" when the backend refuses the case.
    The kernel's own exceptions come out as KernelError; any other exception is attn-doctor's. `repeats` > 1
    runs a CALL probe that many times (the other kinds run once: asking more of them is attn-doctor's bug).
    What the backend read back from its library beyond `ran` (`Backend.facts`) goes into the outcome's extra."""
    from attn_doctor.backends import Unsupported

    if repeats != 1 and not coords.kind_rules.repeats:
        raise ValueError(f"repeats apply to single calls only, not to {coords.kind.name} probes")
    more = {"repeats": repeats} if repeats != 1 else {}
    runner = RUNNERS[coords.kind]
    if backend.layer_path and coords.kind is ProbeKind.CALL:
        if repeats != 1:  # refused, not ignored: a SKIP row saying so
            return ProbeOutcome("skip", reason=f"--repeats applies to single attention calls; {backend.name} runs its "
                                               "whole layer once: drop --repeats for it")
        runner, more = module.run, {}
    try:
        outcome = runner(backend, coords, caches, progress, **more)
    except Unsupported as exc:
        return ProbeOutcome("skip", reason=str(exc))
    outcome.extra.update(backend.facts())
    cache = caches.depth if coords.kind is ProbeKind.DEPTH else caches.case
    outcome.extra.setdefault("reference", cache.reference_source)  # a layer probe computes its own
    return outcome


__all__ = ["Caches", "ProbeOutcome", "RUNNERS", "run_probe"]
