"""Parent side of a worker process: start it, feed it jobs, time it out, restart it.

A worker that crashes (segfault, abort), hangs past the timeout or reports a CUDA fault turns the job it
was running into an ERROR reply with the reason and the tail of its stderr; the next job gets a fresh
worker. Nothing a kernel does can take the tool down.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from attn_doctor.core import processes

STARTUP_TIMEOUT_S = 300.0


class Worker:
    """One worker process for one backend family, restarted on demand."""

    def __init__(self, family: str, device: str, timeout_s: float, environment: dict[str, str] | None = None):
        self.family = family
        self.environment = environment or {}  # variables it starts with beyond ours (a cuDNN build to load)
        self.device = device
        self.timeout_s = timeout_s
        self.hello: dict[str, Any] | None = None
        self.starts = 0
        self.startup_seconds = 0.0  # process start to hello (interpreter, torch, library import), all starts
        self._proc = None
        self._replies: queue.Queue = queue.Queue()
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self._next_id = 0
        self._lock = threading.Lock()  # start and close may come from different threads

    def _start(self) -> str | None:
        """Start the process and wait for its hello; the reason on failure."""
        self._stderr.seek(0)
        self._stderr.truncate()
        self._proc = processes.start(
            [sys.executable, "-m", "attn_doctor.execution.worker", self.family, self.device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
            env=processes.child_env(self.environment),
        )
        self.starts += 1
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc, self._replies), daemon=True).start()
        started = time.perf_counter()
        message = self._wait(time.monotonic() + max(STARTUP_TIMEOUT_S, self.timeout_s))
        self.startup_seconds += time.perf_counter() - started
        if message is None or "hello" not in message:
            reason = self._death_reason("while starting")
            self.close()
            return reason
        self.hello = message["hello"]
        return None

    @staticmethod
    def _read(proc, replies: queue.Queue) -> None:
        for line in proc.stdout:
            try:
                replies.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        replies.put(None)  # EOF: the process is gone

    def _wait(self, deadline: float, on_progress: Callable[[str], None] | None = None) -> dict | None:
        """The next reply before `deadline` ({"timeout": True} past it; None when the process is gone),
        passing progress messages on as they come."""
        while True:
            try:
                message = self._replies.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return {"timeout": True}
            if message is not None and "progress" in message:
                if on_progress is not None:
                    on_progress(message["progress"])
                continue
            return message

    def stderr_tail(self, lines: int = 6) -> str:
        return processes.read_tail(self._stderr, lines)

    def _death_reason(self, doing: str) -> str:
        proc = self._proc
        if proc is None:
            return "worker not started"
        try:  # stdout closes a moment before the process is reaped
            code = processes.wait(proc, timeout_s=5)
        except subprocess.TimeoutExpired:
            return f"worker {self.family} closed its output but did not exit {doing}"
        tail = self.stderr_tail()
        why = f"worker {self.family} died {doing} ({processes.describe_exit(code)})"
        return f"{why}: {tail.splitlines()[-1]}" if tail else why

    def ensure_started(self) -> str | None:
        """Start the process unless it is running; the reason it could not start, or None."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                return self._start()
        return None

    def request(self, job: dict[str, Any], on_progress: Callable[[str], None] | None = None) -> dict[str, Any]:
        """Send one job and wait for its reply; failures come back as status 'error' replies."""
        reason = self.ensure_started()
        if reason is not None:
            return {"status": "error", "reason": reason, "detail": self.stderr_tail(20)}
        self._next_id += 1
        message = {"id": self._next_id, **job}
        try:
            self._proc.stdin.write((json.dumps(message) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError, AttributeError):
            reason = self._death_reason("before the job")
            self.close()
            return {"status": "error", "reason": reason}
        repeats = max(1, int(job.get("repeats", 1)))  # --timeout is per call: a probe of N repeats gets N times it
        reply = self._wait(time.monotonic() + self.timeout_s * repeats, on_progress)
        if reply is not None and reply.get("timeout"):
            self.close(graceful=False)
            within = f"--timeout {self.timeout_s:g} s" + (f" x {repeats} repeats" if repeats > 1 else "")
            return {"status": "error", "reason": f"hung: no answer within {within}; worker killed"}
        if reply is None:
            reason = self._death_reason("while running it")
            detail = self.stderr_tail(20)
            self.close()
            return {"status": "error", "reason": reason, "detail": detail}
        if reply.get("fatal"):
            self.close()
        return reply

    def close(self, graceful: bool = True) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if graceful and proc.poll() is None:
            try:
                proc.stdin.write(b'{"op": "quit"}\n')
                proc.stdin.flush()
                processes.wait(proc, timeout_s=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        processes.kill_group(proc)
