"""`attn-doctor te`: Transformer Engine releases prepared side by side (`attn_doctor.machine.te_installs`), for
`--te VERSION` to run."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from attn_doctor.cli.app import EXIT_OK, Application
from attn_doctor.cli.epilogs import epilog


@click.group(epilog=epilog("te"))
def te() -> None:
    """Prepare and list TE releases installed beside your environment (never into it)."""


@te.command("add")
@click.argument("version")
@click.option("--from", "wheels", type=click.Path(path_type=Path), default=None, metavar="DIR",
              help="Install from the wheels (and transformer-engine-torch's source distribution) in DIR, not from "
                   "the package index: for machines without one.")
@click.pass_obj
def add(app: Application, version: str, wheels: Path | None) -> int:
    """Install TE VERSION (its three packages) into a folder of its own, its torch extension built against this
    torch, and check that it imports; a failed one leaves nothing behind."""
    from attn_doctor.machine.te_installs import add as add_install

    # the steps on a terminal only: a refusal stays the one line a script or a log reads
    step = (lambda text: click.echo(f"attn-doctor: {text}", err=True)) if sys.stderr.isatty() else None
    install, made = add_install(version, wheels, on_step=step)
    click.echo(f"TE {install.label()}" + ("" if made else " was already prepared"))
    return EXIT_OK


@te.command("list")
@click.pass_obj
def list_installs(app: Application) -> int:
    """The TE releases `--te` can run: the one installed in this environment and those prepared here, with what
    each was built against."""
    from attn_doctor.machine.te_installs import choices, te_home

    installs = choices()
    for install in installs:
        click.echo(f"TE {install.label()}")
    if not any(install.prepared for install in installs):
        click.echo(f"No TE release prepared in {te_home()}; prepare one with `attn-doctor te add VERSION`.")
    return EXIT_OK
