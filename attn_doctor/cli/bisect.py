"""`attn-doctor bisect`: from a failing case to the smallest one that still fails, its necessary conditions
and a standalone repro."""

from __future__ import annotations

import click

from attn_doctor.cli.app import EXIT_FAULT, EXIT_OK, Application, Interrupted
from attn_doctor.cli.epilogs import epilog
from attn_doctor.cli.options import (INDEX, INPUT_ANY, OUTPUT_FILE, OUTPUT_FOLDER, REPEATS, SIZE, backend_options,
                                     build_case, case_options, given, refuse_ignored)
from attn_doctor.core.errors import BadInput
from attn_doctor.core.layouts import canonical_layouts
from attn_doctor.core.probe_kinds import rules_for


@click.command(epilog=epilog("bisect"))
@case_options
@backend_options
@click.option("--tp", type=SIZE, default=1, show_default=True,
              help="Start from TP shards of this degree.")
@click.option("--layers", type=INDEX, default=0, help="Start from an L-layer stack (0: one attention call).")
@click.option("--from", "from_results", type=INPUT_ANY,
              help="Start from a failing row of a results file or sweep directory instead of the flags.")
@click.option("--row", "row_index", type=INDEX, default=0, show_default=True,
              help="With --from: which failing row (0 = the first).")
@click.option("--repeats", type=REPEATS, default=1, show_default=True,
              help="Run each probe N times; any failing run counts (guards against nondeterministic kernels).")
@click.option("--json", "json_path", type=OUTPUT_FILE,
              help="Also write the bisect document ({start_case, minimal_case, necessary, probes, repro, ...}) here.")
@click.option("--out", "out_dir", type=OUTPUT_FOLDER,
              help="Where the repro script and the bisect document go (default: beside --from, else "
                   "attn-doctor-results/bisect-<stamp>); `attn-doctor report` takes the folder or the document.")
@click.option("--full-repro", is_flag=True,
              help="Write the long self-contained repro (all of attn-doctor's numerics) instead of the short one "
                   "written for the minimal case.")
@click.pass_obj
def bisect(app: Application, backends, kernels, te_release, cudnn, layouts, device, max_memory, timeout, tp, layers, from_results,
           row_index, repeats, json_path, out_dir, full_repro, **case_flags) -> int:
    """Shrink a failing case to the smallest one that still fails, name the conditions it needs, and write a
    standalone repro script."""
    from attn_doctor.machine.devices import check_device_name

    check_device_name(device)
    if from_results is None and given("row_index"):
        refuse_ignored("--row", "with --from (which failing row of those results)", "add --from RESULTS, or drop --row")
    if from_results is not None:
        case_given = [name.replace("_", "-") for name, value in case_flags.items() if value is not None]
        if case_given or backends or kernels or te_release or cudnn or layouts or tp != 1 or layers:
            raise BadInput("--from starts from a row of the results, with its case, backend and layout; drop "
                           f"{', '.join('--' + g for g in case_given) or 'the case and backend options'}")
    from attn_doctor.bisect import knobs

    case = build_case(case_flags) if from_results is None else None
    if case is not None:
        rules = rules_for(knobs.kind_at(tp, layers), case)
        if not rules.inputs and case.inputs != "normal":
            raise BadInput(f"{rules.inputs_refusal()}; drop --inputs or {rules.flag}")
    from attn_doctor.backends import select
    from attn_doctor.bisect.driver import BisectRequest, missing_values, start_from_results
    from attn_doctor.bisect.driver import bisect as bisect_workflow
    from attn_doctor.bisect.engine import CannotBisect, NothingToBisect
    from attn_doctor.machine.devices import resolve_device
    from attn_doctor.render.terminal import bisect_tables
    from attn_doctor.core.paths import check_output
    from attn_doctor.results.files import write_or_keep
    from attn_doctor.results.report import dumps

    row = None
    if from_results is not None:
        row = start_from_results(from_results, row_index)
        start, directory = row.coords, row.directory
        if row.missing_capture is not None:
            app.console.print(f"note: the capture {row.missing_capture} of this replayed row is gone: bisecting "
                              "seeded inputs of the call's shapes instead of its captured values and views",
                              style="yellow")
    else:
        specs = select(backends, kernels, cudnn, te_release)
        if len(specs) != 1:
            raise BadInput("bisect follows one kernel path: give exactly one --backend or --kernel "
                           f"(got {len(specs)}), or --from RESULTS")
        if len(layouts) > 1:
            raise BadInput("bisect starts from one layout: give --layout at most once")
        start = knobs.coords_at(case, canonical_layouts(layouts)[0] if layouts else "contiguous", tp, layers, specs[0])
        directory = None
    if out_dir is None and directory is not None:  # beside --from's results: checked as a given --out is
        check_output(directory, "--out", directory=True)
    directory = out_dir or directory or app.new_run_dir("bisect")
    from attn_doctor.execution.budget import MemoryAsk

    request = BisectRequest(start, resolve_device(device), directory, repeats, timeout, app.command_line(),
                            MemoryAsk(max_memory), full_repro)
    console = app.console
    try:
        report = bisect_workflow(request, app.progress())
    except NothingToBisect as exc:
        why = f"; {missing_values(row)}" if row is not None and row.missing_capture is not None else ""
        console.print(f"nothing to bisect: {exc}{why}", style="bold yellow")
        return EXIT_FAULT
    except CannotBisect as exc:
        console.print(f"cannot bisect: {exc}", style="bold magenta")
        return EXIT_FAULT
    except KeyboardInterrupt:
        raise Interrupted("the bisect was stopped before it finished; nothing was written") from None
    for renderable in bisect_tables(report.result, start.backend.name, report.diagnosis):
        console.print(renderable)
    app.say("repro:", f"{report.repro}  (python3 {report.repro.name}: exit 1 while wrong, 0 when fixed)")
    minimal = report.result.minimal
    if minimal.layers:
        console.print("note: the failure needs depth; the repro checks the single call of the minimal case, "
                      f"reproduce the stack with: {minimal.repro_command(_selector(start))}")
    document = dumps(report.to_dict())
    for label, path in [("bisect:", directory / report.file_name), *([("json:", json_path)] if json_path else [])]:
        saved, why = write_or_keep(path, document)
        app.say(label, str(saved))
        if why:
            return app.kept_elsewhere(why, saved)
    app.say_command("issue:", "report", directory / report.file_name, "--format", "issue")
    return EXIT_OK


def _selector(coords) -> str:
    from attn_doctor.backends import selector

    return selector(coords.backend)
