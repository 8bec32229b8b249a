"""`attn-doctor sweep`: a grid of cases on layouts, TP shards or depth stacks; streamed and resumable."""

from __future__ import annotations

import click

from attn_doctor.cli.app import Application, Interrupted
from attn_doctor.cli.epilogs import epilog
from attn_doctor.cli.options import (
    INPUT_FOLDER,
    OUTPUT_FOLDER,
    SHARD,
    WORKERS,
    backend_options,
    build_cases,
    grid_options,
    refuse_ignored,
    repeats_option,
)
from attn_doctor.core.errors import BadInput
from attn_doctor.core.layouts import canonical_layouts


@click.command(epilog=epilog("sweep"))
@grid_options
@backend_options
@click.option("--resume", type=INPUT_FOLDER,
              help="Continue the sweep in this directory, skipping the points already in its results.jsonl.")
@click.option("--out", "out_dir", type=OUTPUT_FOLDER,
              help="Directory for results.jsonl, results.json and the plot "
                   "(default: attn-doctor-results/sweep-<stamp>).")
@click.option("--shard", type=SHARD, default=None,
              help="Run only the I-th of N deterministic slices of the grid's points (1 <= I <= N), e.g. 2/4 for "
                   "one task of a SLURM array or CI matrix; `attn-doctor report DIR1 DIR2 ...` merges them.")
@click.option("--workers", type=WORKERS, default=None,
              help="Worker processes per backend family, each taking whole points  [default: on a GPU the "
                   "CPU's cores shared among the families by their work, at least 2 each; 1 on the CPU; not with "
                   "--layers: a depth sweep runs one worker at a time]")
@repeats_option
@click.pass_obj
def sweep(app: Application, backends, kernels, te_release, cudnn, layouts, device, max_memory, timeout, resume, out_dir, shard,
          workers, repeats, **grid_flags) -> int:
    """Run a grid of cases, depth stacks (--layers) or TP shards (--tp); stream results; summarise."""
    from attn_doctor.machine.devices import check_device_name

    # the input that needs no torch is checked first
    cases, dropped, depths, degrees, recipe_layouts = build_cases(grid_flags)
    if not cases:
        raise BadInput("the grid has no valid case: " + (dropped[0] if dropped else "it is empty"))
    check_device_name(device)
    if depths and workers is not None:
        refuse_ignored("--workers", "to sweeps of single calls or TP shards (a depth sweep runs one worker at a time: "
                       "its stacks are tens of GiB)", "drop --workers")
    if resume is not None and out_dir is not None and resume != out_dir:
        raise BadInput("give either --resume DIR or --out DIR, not both")
    from attn_doctor.execution.budget import MemoryAsk
    from attn_doctor.execution.pool import prestart_servers
    from attn_doctor.machine.memory import read_free

    memory = MemoryAsk(max_memory, read_free(device))  # before any process of ours holds memory
    prestart_servers(backends, cudnn or te_release, device)  # their imports overlap this process's start
    from attn_doctor.backends import select
    from attn_doctor.machine.devices import resolve_device
    from attn_doctor.core.paths import check_output
    from attn_doctor.workflows import sweep as sweeping

    specs = select(backends, kernels, cudnn, te_release)
    if resume is not None:
        check_output(resume, "--resume", directory=True)  # read (checked as parsed) and written to
    directory = resume or out_dir or app.new_run_dir("sweep")
    if dropped:
        app.console.print(f"{len(dropped)} combinations of the grids are not valid cases and were left out "
                          f"(e.g. {dropped[0]})")
    request = sweeping.SweepRequest(cases, specs, canonical_layouts(layouts) or recipe_layouts,
                                    resolve_device(device), directory,
                                    resume=resume is not None, depths=depths, degrees=degrees, workers=workers,
                                    timeout_s=timeout, command=app.command_line(), layouts_given=bool(layouts),
                                    repeats=repeats, shard=shard, memory=memory, started=app.started)
    return execute(app, request, "the finished points are in {log}; continue with --resume {directory}")


def execute(app: Application, request, interrupted: str) -> int:
    """Run a sweep request (`sweep`, `replay`), print its view and where its results went, return the exit
    code. `interrupted` is what Ctrl-C says, with {log} and {directory} filled in."""
    from attn_doctor.render.terminal import sweep_view
    from attn_doctor.workflows import sweep as sweeping

    directory = request.directory
    plan = sweeping.prepare(request)
    if len(plan.todo) < len(plan.points):
        app.console.print(f"resuming {directory}: {len(plan.points) - len(plan.todo)} of {len(plan.points)} points "
                          "already done")
    try:
        report = sweeping.run(plan, app.progress())
    except KeyboardInterrupt:
        raise Interrupted(interrupted.format(log=plan.log.path, directory=directory)) from None
    saved, why = sweeping.save(report, directory)  # first: what is printed may not get through
    for renderable in sweep_view(report):
        app.console.print(renderable)
    app.say("results:", f"{saved} (streamed: {plan.log.path})")
    if report.artifacts.get("plot"):
        app.say("plot:", str(directory / report.artifacts["plot"]))
    app.say_command("report:", "report", directory, "--format", "markdown")
    if why:
        return app.kept_elsewhere(why, saved)
    return app.exit_code(report)
