"""`attn-doctor run`: one case, every requested backend x layout, judged against float64."""

from __future__ import annotations

from pathlib import Path

import click

from attn_doctor.cli.app import Application, Interrupted
from attn_doctor.cli.epilogs import epilog
from attn_doctor.cli.options import (
    OUTPUT_FILE,
    backend_options,
    build_case,
    given_case_fields,
    SIZE,
    case_options,
    given,
    refuse_ignored,
    repeats_option,
)
from attn_doctor.core.coords import CP_COMM_TYPES
from attn_doctor.core.layouts import canonical_layouts


@click.command(epilog=epilog("run"))
@case_options
@backend_options
@click.option("--json", "json_path", type=OUTPUT_FILE,
              help="Write the results document here (default: attn-doctor-results/<run-id>/results.json).")
@click.option("--profile", is_flag=True, help="Print where the time went (startup, reference, kernels, ...).")
@click.option("--wide", is_flag=True, help="One wide table with what ran in a column (needs ~150 columns).")
@click.option("--nproc", type=SIZE,
              help="Run on N ranks launched with torchrun (N = --tp x --cp), gathering to rank 0.")
@click.option("--tp", "tp_degree", type=SIZE, default=1, show_default=True,
              help="Tensor-parallel degree: heads split into shards (in one process; on ranks with --nproc).")
@click.option("--cp", "cp_degree", type=SIZE, default=1, show_default=True,
              help="With --nproc: context-parallel ranks.")
@click.option("--cp-comm-type", type=click.Choice(CP_COMM_TYPES), default="p2p", show_default=True,
              help="With --cp: how the sequence chunks are exchanged.")
@repeats_option
@click.pass_obj
def run(app: Application, json_path: Path | None, profile: bool, wide: bool, nproc: int | None, tp_degree: int,
        cp_degree: int, cp_comm_type: str, repeats: int, backends, kernels, te_release, cudnn, layouts, device, max_memory, timeout,
        **case_flags) -> int:
    """Check every backend x layout on one case against float64 and name the faulty kernel path."""
    from attn_doctor.machine.devices import check_device_name

    case = build_case(case_flags)  # the input that needs no torch is checked before torch is imported
    check_device_name(device)
    if given("cp_comm_type") and cp_degree == 1:
        refuse_ignored("--cp-comm-type", "with context parallelism", "add --cp N --nproc N, or drop --cp-comm-type")
    if nproc is not None and max_memory is not None:
        refuse_ignored("--max-memory", "to probes in this process's workers (torchrun's ranks hold what they need)",
                       "drop --max-memory or --nproc")
    from attn_doctor.execution.budget import MemoryAsk
    from attn_doctor.machine.memory import read_free

    memory = MemoryAsk(max_memory, read_free(device))  # before any process of ours holds memory
    if nproc is None:
        from attn_doctor.execution.pool import prestart_servers

        prestart_servers(backends, cudnn or te_release, device)  # their imports overlap this process's start
    from attn_doctor.backends import select
    from attn_doctor.machine.devices import resolve_device
    from attn_doctor.workflows.run import RunInterrupted, RunRequest, sized_for_cpu
    from attn_doctor.workflows.run import run as run_workflow

    specs = select(backends, kernels, cudnn, te_release)
    out_path = json_path or app.new_run_dir("run", "--json") / "results.json"
    request = RunRequest(case, specs, canonical_layouts(layouts), resolve_device(device), app.command_line(), timeout,
                         tp=tp_degree, cp=cp_degree, cp_comm_type=cp_comm_type, nproc=nproc,
                         layouts_given=bool(layouts), repeats=repeats, memory=memory)
    request = sized_for_cpu(request, given_case_fields(case_flags))
    for note in request.notes:
        app.console.print(note, soft_wrap=True)  # one line in a pipe or a log too
    title = f"{request.case.short()} on {request.device}"
    try:
        report = run_workflow(request, app.progress())
    except RunInterrupted as interrupted:
        saved, _ = _show_and_save(app, interrupted.report, out_path, wide, title)
        raise Interrupted(f"{len(interrupted.report.rows)} finished probes kept in {saved}") from None
    saved, why = _show_and_save(app, report, out_path, wide, title)
    if profile:
        import time

        report.seconds["command (wall, since start of the CLI)"] = time.perf_counter() - app.started
        for name, seconds in report.seconds.items():
            app.console.print(f"  {name:<42} {seconds:8.2f} s")
    if why:
        return app.kept_elsewhere(why, saved)
    return app.exit_code(report)


def _show_and_save(app: Application, report, out_path: Path, wide: bool, title: str) -> tuple[Path, str | None]:
    from attn_doctor.cli.known import print_defects
    from attn_doctor.render.env_view import env_rich_table
    from attn_doctor.render.terminal import run_view
    from attn_doctor.results.files import write_or_keep
    from attn_doctor.results.report import dumps

    saved, why = write_or_keep(out_path, dumps(report.to_dict()))  # first: what is printed may not get through
    console = app.console
    if report.env is not None:
        console.print(env_rich_table(report.env))
    for renderable in run_view(report, title=title, wide=wide):
        console.print(renderable)
    print_defects(console, report, "Known TE/cuDNN defects that match this machine and case:")
    app.say("results:", str(saved))
    app.say_command("report:", "report", saved, "--format", "markdown")
    return saved, why
