"""The one application object every command receives (through click's context), and the group that keeps
the command line's contract for every input:

- 0 every tested path passes, 1 a path FAILs or ERRORs, 2 bad input or a request that cannot run here
  (one line on stderr: what is wrong and how to fix it, never a traceback), 130 on Ctrl-C, 143 on SIGTERM;
- Ctrl-C kills every process attn-doctor started and answers at once; what finished is kept. SIGTERM (what
  `timeout`, SLURM and docker send) is unwound the same way (`Terminated`): left to Python's default, it ended
  attn-doctor outright, and its workers and torch's shared-memory manager ran on after it;
- a terminal that cannot print Unicode gets what every command prints in ASCII (`render.charset`), not a
  UnicodeEncodeError.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import click

from attn_doctor.core.errors import BadInput

if TYPE_CHECKING:
    from rich.console import Console

    from attn_doctor.execution.progress import ProgressSink
    from attn_doctor.results.report import RunReport

EXIT_OK, EXIT_FAULT, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
# A bare `attn-doctor` (click 8.2 and later raise this; older ones print the help themselves)
_NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())
RESULTS_DIR = Path("attn-doctor-results")  # the default output folder, in the current directory


class Interrupted(Exception):
    """Ctrl-C, after the command kept what had finished; `message` says what and where."""

    def __init__(self, message: str = ""):
        super().__init__(message)
        self.message = message


@dataclass
class Application:
    argv: list[str]
    started: float = field(default_factory=time.perf_counter)

    def command_line(self) -> str:
        """The command as the user typed it, for the report's reproduce line."""
        return " ".join(["attn-doctor", *(shlex.quote(str(a)) for a in self.argv)])

    @cached_property
    def console(self) -> Console:
        return _console(highlight=False, markup=False, soft_wrap=False)

    @cached_property
    def err_console(self) -> Console:
        return _console(stderr=True, highlight=False, markup=False)

    def progress(self) -> ProgressSink:
        """Counts and an ETA on stderr while a terminal watches; in a pipe, a log or a test, a line on stderr
        every 30 s of long work (none on shorter work)."""
        from attn_doctor.render import progress as progress_view

        if not self.err_console.is_terminal:
            return progress_view.HeartbeatProgress(sys.stderr, progress_view.HEARTBEAT_INTERVAL_S)
        return progress_view.TerminalProgress(self.err_console)

    def new_run_dir(self, kind: str, option: str = "--out") -> Path:
        """A new folder under attn-doctor-results/ for a command's results, checked writable before any work as a
        given path is (`option`: what to give instead when it is not)."""
        import datetime

        from attn_doctor.core.paths import check_output

        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        path = RESULTS_DIR / f"{kind}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = RESULTS_DIR / f"{kind}-{stamp}-{suffix}"
        check_output(path, option, directory=True)
        return path

    def say(self, label: str, text: str) -> None:
        """One line a reader copies (a file it wrote, the next command to run): `label` then `text`, never wrapped,
        whatever the width; a reader copying it from a narrow terminal, a file or a pipe gets it whole."""
        self.console.print(f"{label:<8} {text}", soft_wrap=True)

    def say_command(self, label: str, *words: str | Path) -> None:
        """`say` an attn-doctor command, its paths quoted for a shell."""
        import shlex

        self.say(label, " ".join(["attn-doctor", *(shlex.quote(str(word)) for word in words)]))

    def kept_elsewhere(self, why: str, saved: Path) -> int:
        """The output could not go where it was asked (exit 2); what was made is kept at `saved`."""
        click.echo(f"attn-doctor: error: {why}; the results were kept in {saved} instead", err=True)
        return EXIT_BAD_INPUT

    def exit_code(self, report: RunReport) -> int:
        """The report's exit code; when nothing asked for was tested (2), the one line on stderr saying why."""
        code = report.exit_code
        if code == EXIT_BAD_INPUT:
            click.echo(f"attn-doctor: error: {report.untested}", err=True)
        return code


def _console(**options) -> Console:
    """A console for what a command prints (`render.charset.printable_console`, `options` as rich takes them).
    When its reader goes away (`| head`), it prints nothing more and the command goes on to its end: its results
    saved, its exit code the verdict's. Rich's own answer (`Console.on_broken_pipe`) was to exit 1 at once, so a
    `run | head` lost its results and named no verdict."""
    from attn_doctor.render.charset import printable_console

    console = printable_console(**options)

    def reader_gone() -> None:
        console.quiet = True
        _quiet(console.file)

    console.on_broken_pipe = reader_gone  # type: ignore[method-assign]  # rich's documented hook
    return console


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be, so that every path that keeps what finished on
    Ctrl-C keeps it here too; the exit code is 143 (128 + SIGTERM, what a shell reports)."""


_terminated: list[bool] = [False]  # whether this command received SIGTERM (the unwinding may wrap `Terminated`)


def _stacks_on_sigusr1() -> None:
    """SIGUSR1 prints every thread's stack to the process's stderr: where a run that stopped advancing waits
    (`benchmarks/h100/monitor.sh` sends it). Not where there is no such signal or no real stderr."""
    import faulthandler
    import signal

    if not hasattr(signal, "SIGUSR1"):
        return
    try:
        faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    except (AttributeError, ValueError, OSError):
        pass


def _terminate(signum, frame) -> None:
    _terminated[0] = True
    raise Terminated()


class DoctorGroup(click.Group):
    """A group whose every bad input ends as one line on stderr and exit code 2, never a traceback."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):  # noqa: D102
        import signal
        import threading

        from attn_doctor.render.charset import printable_standard_streams

        app = Application(list(sys.argv[1:] if args is None else args))
        previous = None
        _terminated[0] = False
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            previous = signal.signal(signal.SIGTERM, _terminate)
            _stacks_on_sigusr1()
        try:
            with printable_standard_streams():  # a terminal that cannot print Unicode gets ASCII, not a traceback
                self._main(app, args, prog_name, complete_var, **extra)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _main(self, app: "Application", args, prog_name, complete_var, **extra) -> None:
        try:
            code = super().main(args, prog_name or "attn-doctor", complete_var, standalone_mode=False, obj=app,
                                **extra)
        except _NO_ARGS_IS_HELP as exc:  # a bare `attn-doctor`: its help, as click shows it
            exc.show()
            sys.exit(EXIT_BAD_INPUT)
        except click.UsageError as exc:
            hint = f" (see `attn-doctor {exc.ctx.info_name} --help`)" if exc.ctx and exc.ctx.parent else ""
            click.echo(f"attn-doctor: error: {exc.format_message()}{hint}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except BadInput as exc:
            click.echo(f"attn-doctor: error: {exc}", err=True)
            sys.exit(EXIT_BAD_INPUT)
        except (click.Abort, KeyboardInterrupt, Interrupted) as exc:
            _interrupted(exc)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except BrokenPipeError:  # the reader went away (| head): nothing more to say
            _quiet(sys.stdout)
            sys.exit(EXIT_OK)
        sys.exit(code if isinstance(code, int) else EXIT_OK)


def _interrupted(exc: BaseException) -> None:
    from attn_doctor.core import processes

    processes.kill_all()  # nothing attn-doctor started may outlive it
    processes.kill_other_children()  # nor what a library started for it (torch's shared-memory manager)
    cause = exc.__context__ if isinstance(exc, click.Abort) else exc
    message = cause.message if isinstance(cause, Interrupted) and cause.message else ""
    terminated = _terminated[0]
    said = "terminated (SIGTERM)" if terminated else "interrupted"
    click.echo(f"attn-doctor: {said}{'; ' + message if message else ''}", err=True)
    sys.exit(EXIT_TERMINATED if terminated else EXIT_INTERRUPTED)


def _quiet(stream) -> None:
    """What is still written to `stream` (its reader gone) goes nowhere, without another BrokenPipeError."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError, AttributeError):
        pass
