"""Progress while a long command works, on stderr. On a terminal: counts, an ETA and what is running now, gone
when done (rich's Progress, transient). Elsewhere (a pipe, a CI log, a test): a heartbeat, one short line every
30 s of work and nothing on shorter work, so that a log shows the command is alive and how far it got."""

from __future__ import annotations

import threading
import time
from typing import TextIO

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


HEARTBEAT_INTERVAL_S = 30.0  # CI systems kill a job silent for ~10 minutes; a human watching a log wants less


class HeartbeatProgress(ProgressSink):
    """One line on `stream` every `interval_s` from the first stage's start until the last one ends:
    "attn-doctor: 12 of 40 probes done, 1m30s elapsed". Steps are counted from any thread (the session reports
    rows from its workers' threads)."""

    def __init__(self, stream: TextIO, interval_s: float = HEARTBEAT_INTERVAL_S):
        self._stream = stream
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._beating: threading.Thread | None = None
        self._started = 0.0
        self._done = self._total = 0
        self._what = ""

    def begin(self, total: int, what: str) -> None:
        with self._lock:
            self._done, self._total, self._what = 0, max(total, 0), what
            if self._beating is None:
                self._started = time.monotonic()
                self._stopped.clear()
                self._beating = threading.Thread(target=self._beat, name="attn-doctor heartbeat", daemon=True)
                self._beating.start()

    def advance(self, steps: int = 1, what: str | None = None) -> None:
        with self._lock:
            self._done += steps
            self._total = max(self._total, self._done)  # more than estimated: stretch (a bisect's total)

    def end(self) -> None:
        with self._lock:
            beating, self._beating = self._beating, None
        if beating is not None:
            self._stopped.set()
            beating.join()

    def line(self) -> str:
        with self._lock:
            done, total, what, elapsed = self._done, self._total, self._what, time.monotonic() - self._started
        return f"attn-doctor: {done} of {total} {what} done, {duration(elapsed)} elapsed"

    def _beat(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                self._stream.write(self.line() + "\n")
                self._stream.flush()
            except (OSError, ValueError):  # the reader went away or the stream was closed: stop saying anything
                return


def duration(seconds: float) -> str:
    """45s, 1m30s, 1h02m."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
