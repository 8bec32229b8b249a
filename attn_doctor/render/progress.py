"""Progress on a terminal: counts, an ETA and what is running now, on stderr, gone when done (rich's
Progress, transient). Commands use it only when stderr is a terminal; pipes, logs and tests get nothing."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from attn_doctor.execution.progress import ProgressSink


class TerminalProgress(ProgressSink):
    def __init__(self, console: Console):
        self._progress = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                  TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                  TextColumn("{task.fields[now]}", style="dim"), console=console, transient=True)
        self._task = None
        self._what = ""

    def begin(self, total: int, what: str) -> None:
        self._what = what
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task(what, total=max(total, 1), now="")
        else:
            self._progress.reset(self._task, total=max(total, 1), description=what, now="")

    def advance(self, steps: int = 1, what: str | None = None) -> None:
        if self._task is None:
            return
        task = self._progress.tasks[0]
        if task.total is not None and task.completed + steps > task.total:
            self._progress.update(self._task, total=task.completed + steps)  # more than estimated: stretch
        self._progress.update(self._task, advance=steps, now=what or "")

    def note(self, text: str) -> None:
        if self._task is not None:
            self._progress.update(self._task, now=text[-60:])

    def end(self) -> None:
        if self._task is not None:
            self._progress.stop()
            self._task = None
