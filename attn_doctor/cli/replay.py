"""`attn-doctor replay DIR`: every distinct call of a capture (`attn-doctor capture`) checked like a sweep
point: the captured shapes, values (when recorded) and exact views, on every path, against float64."""

from __future__ import annotations

from pathlib import Path

import click

from attn_doctor.cli.app import Application
from attn_doctor.cli.epilogs import epilog
from attn_doctor.cli.options import INDEX, INPUT_FOLDER, OUTPUT_FOLDER, SEED, backend_options, repeats_option
from attn_doctor.core.errors import BadInput
from attn_doctor.core.layouts import canonical_layouts


def _span(values: list[int | None]) -> str:
    """`0-3`, `0,2,5` or `4`; a call outside any numbered layer (None) adds "none"."""
    known = sorted({value for value in values if value is not None})
    text = "" if not known else f"{known[0]}" if len(known) == 1 else f"{known[0]}-{known[-1]}" if known == list(
        range(known[0], known[-1] + 1)) else ",".join(map(str, known))
    return ", ".join(part for part in (text, "none" if None in values else "") if part)


@click.command(epilog=epilog("replay"))
@click.argument("capture_dir", type=INPUT_FOLDER)
@click.option("--call", "call_index", type=INDEX, help="Only the call of this index (of each rank's process).")
@click.option("--layer", type=INDEX, help="Only the calls of this layer.")
@click.option("--rank", type=INDEX, help="Only the calls of this rank.")
@click.option("--seed", type=SEED, default=1234, show_default=True,
              help="Seed of the inputs of calls whose values were not captured.")
@backend_options
@click.option("--out", "out_dir", type=OUTPUT_FOLDER,
              help="Where the results go (a sweep folder: `report` and `bisect --from` read it) "
                   "[attn-doctor-results/replay-<time>].")
@repeats_option
@click.pass_obj
def replay(app: Application, capture_dir: Path, call_index, layer, rank, seed, backends, kernels, te_release, cudnn, layouts,
           device, max_memory, timeout, out_dir, repeats) -> int:
    """Check every distinct call of a capture on every path against float64: the call's own shapes and values
    (seeded ones when only metadata was captured) on its own views (layout `captured`) and contiguous.
    Identical calls (same API, arguments, shapes, strides, dtypes) are checked once and counted."""
    from attn_doctor.machine.devices import check_device_name
    from attn_doctor.tracing.replay_case import case_of, values_source
    from attn_doctor.tracing.store import read_capture

    check_device_name(device)
    calls = [c for c in read_capture(capture_dir)
             if (call_index is None or c.index == call_index) and (layer is None or c.meta["layer"] == layer)
             and (rank is None or c.rank == rank)]
    if not calls:
        raise BadInput(f"no captured call of {capture_dir} matches --call/--layer/--rank")
    groups: dict[str, list] = {}
    for call in calls:
        groups.setdefault(call.signature(), []).append(call)
    cases, refused, unreadable = [], [], []
    app.console.print(f"{len(calls)} calls, {len(groups)} distinct:")
    for number, members in enumerate(groups.values(), start=1):
        # the first whose recorded values can be read; where none can, the call is not judged (never on seeded
        # values, nor on those of a call that recorded none)
        recorded = [c for c in members if c.meta.get("values")]
        readable = next((c for c in recorded if c.values_problem() is None), None)
        chosen = readable or (recorded or members)[0]
        problem = chosen.values_problem() if readable is None else None
        if problem is not None:
            unreadable.append(f"{chosen.where()}: {problem}")
        case = problem or case_of(chosen, capture_dir, seed)
        tp_ranks = [c.meta.get("parallel", {}).get("tp_rank") for c in members]
        where = (f"{len(members)} call{'s' * (len(members) > 1)}: {members[0].meta['api']}, ranks "
                 f"{_span([c.rank for c in members])}"
                 + (f" (TP ranks {_span(tp_ranks)})" if None not in tp_ranks and max(tp_ranks) > 0 else "")
                 + f", layers {_span([c.meta['layer'] for c in members])}, steps "
                 f"{_span([c.meta['step'] for c in members])}")
        if isinstance(case, str):
            refused.append(case)
            app.console.print(f"  {number}. {where}: not replayed ({case})")
        else:
            cases.append(case)
            app.console.print(f"  {number}. {where}: {case.short().rsplit(' call ', 1)[0]}, {values_source(chosen)}")
    if not cases and unreadable:
        raise BadInput(f"no call of {capture_dir} can be judged on its captured values: {unreadable[0]}; capture again")
    if not cases:
        raise BadInput(f"none of the {len(groups)} distinct calls can be replayed yet: {refused[0]}")

    from attn_doctor.backends import select
    from attn_doctor.cli.sweep import execute
    from attn_doctor.execution.budget import MemoryAsk
    from attn_doctor.machine.devices import resolve_device
    from attn_doctor.workflows import sweep as sweeping

    specs = select(backends, kernels, cudnn, te_release)
    directory = out_dir or app.new_run_dir("replay")
    request = sweeping.SweepRequest(cases, specs, canonical_layouts(layouts), resolve_device(device), directory,
                                    timeout_s=timeout, command=app.command_line(), layouts_given=bool(layouts),
                                    repeats=repeats, not_judged=unreadable, memory=MemoryAsk(max_memory),
                                    started=app.started)
    return execute(app, request, "the finished calls are in {log}")
