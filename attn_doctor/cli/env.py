"""`attn-doctor env`: this machine's fingerprint, and the known defects that match it."""

from __future__ import annotations

import click

from attn_doctor.cli.app import EXIT_OK, Application
from attn_doctor.cli.epilogs import epilog


@click.command(epilog=epilog("env"))
@click.option("--json", "as_json", is_flag=True, help="Print the fingerprint (and the matching defects) as JSON.")
@click.option("--no-te", is_flag=True, help="Do not import TE (skips the probe subprocess).")
@click.pass_obj
def env(app: Application, as_json: bool, no_te: bool) -> int:
    """Fingerprint this machine: CPU, OS, GPUs, driver, CUDA, torch, both cuDNNs, TE, flash-attn, NVTE_*
    variables; and the known TE/cuDNN defects that match it."""
    from attn_doctor.cli.known import machine_defects
    from attn_doctor.machine.fingerprint import collect_env
    from attn_doctor.machine.te_facts import te_installed
    from attn_doctor.render.env_view import env_rich_table
    from attn_doctor.results.report import dumps

    report = collect_env(read_te=not no_te and te_installed())
    defects = machine_defects(report)
    if as_json:
        click.echo(dumps({**report.to_dict(), "known_defects": defects}), nl=False)
        return EXIT_OK
    app.console.print(env_rich_table(report))
    if defects:
        app.console.print("Known TE/cuDNN defects that match this machine:", style="bold yellow")
        for line in defects:
            app.console.print(f"  - {line}")
    else:
        app.console.print("No known TE/cuDNN defect matches this machine (attn_doctor/data/known_bugs.toml).")
    return EXIT_OK
