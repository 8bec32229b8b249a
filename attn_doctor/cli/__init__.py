"""The command line: one module per command, each parsing its options and wiring them to a workflow
(`attn_doctor.workflows`, `attn_doctor.bisect.driver`) and a renderer (`attn_doctor.render`). The
application object (`app.Application`) reaches every command through click's context."""

from __future__ import annotations

import os
import sys

import click

from attn_doctor.cli.app import DoctorGroup
from attn_doctor.cli.bisect import bisect
from attn_doctor.cli.capture import capture
from attn_doctor.cli.compare import compare
from attn_doctor.cli.env import env
from attn_doctor.cli.replay import replay
from attn_doctor.cli.report import report
from attn_doctor.cli.run import run
from attn_doctor.cli.sweep import sweep
from attn_doctor.cli.te import te


@click.group(cls=DoctorGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="attn-doctor", prog_name="attn-doctor")
def cli() -> None:
    """Find which attention kernel path computes a wrong forward or gradient, and by how much.

    Exit codes: 0 every tested path passes, 1 a path FAILs or ERRORs, 2 bad input or a request that cannot
    run here, 130 interrupted.
    """


for command in (env, run, sweep, bisect, report, capture, replay, compare, te):
    cli.add_command(command)


def main() -> None:
    """The console entry point. After Ctrl-C the process ends at once (os._exit): a thread still inside a
    float64 reference must not hold the exit up."""
    try:
        cli.main()
    except SystemExit as exc:
        if exc.code == 130:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        raise
