"""Parent side of the worker processes: start, feed, time out, and restart them.

A worker that crashes (segfault, abort), hangs past the timeout or reports a CUDA fault turns the job it
was running into an ERROR reply with the reason and the tail of its stderr; the next job gets a fresh
worker. Nothing a kernel does can take the tool down.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])
STARTUP_TIMEOUT_S = 300.0


def child_env() -> dict[str, str]:
    """This environment, with this copy of attn_doctor importable and output unbuffered: for the processes
    the tool starts (workers, distributed ranks)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PACKAGE_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class Worker:
    """One worker process for one backend family, restarted on demand."""

    def __init__(self, family: str, device: str, timeout_s: float):
        self.family = family
        self.device = device
        self.timeout_s = timeout_s
        self.hello: dict[str, Any] | None = None
        self.starts = 0
        self.startup_seconds = 0.0  # process start to hello (interpreter, torch, TE import), all starts
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue = queue.Queue()
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self._next_id = 0

    def _start(self) -> str | None:
        """Start the process and wait for its hello; the reason on failure."""
        env = child_env()
        self._stderr.seek(0)
        self._stderr.truncate()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "attn_doctor.execution.worker", self.family, self.device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
            start_new_session=True,  # so a timeout can kill everything the kernel started
        )
        self.starts += 1
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc, self._replies), daemon=True).start()
        started = time.perf_counter()
        message = self._wait(max(STARTUP_TIMEOUT_S, self.timeout_s))
        self.startup_seconds += time.perf_counter() - started
        if message is None or "hello" not in message:
            reason = self._death_reason("while starting")
            self.close()
            return reason
        self.hello = message["hello"]
        return None

    @staticmethod
    def _read(proc: subprocess.Popen, replies: queue.Queue) -> None:
        for line in proc.stdout:
            try:
                replies.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        replies.put(None)  # EOF: the process is gone

    def _wait(self, timeout_s: float) -> dict | None:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            return {"timeout": True}

    def stderr_tail(self, lines: int = 6) -> str:
        self._stderr.flush()
        self._stderr.seek(0)
        text = self._stderr.read().decode(errors="replace").strip().splitlines()
        return "\n".join(text[-lines:])

    def _death_reason(self, doing: str) -> str:
        proc = self._proc
        if proc is None:
            return "worker not started"
        try:  # stdout closes a moment before the process is reaped
            code = proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return f"worker {self.family} closed its output but did not exit {doing}"
        tail = self.stderr_tail()
        why = f"worker {self.family} died {doing} ({describe_exit(code)})"
        return f"{why}: {tail.splitlines()[-1]}" if tail else why

    def ensure_started(self) -> str | None:
        """Start the process unless it is running; the reason it could not start, or None."""
        if self._proc is None or self._proc.poll() is not None:
            return self._start()
        return None

    def request(self, job: dict[str, Any]) -> dict[str, Any]:
        """Send one job and wait for its reply; failures come back as status 'error' replies."""
        reason = self.ensure_started()
        if reason is not None:
            return {"status": "error", "reason": reason, "detail": self.stderr_tail(20)}
        self._next_id += 1
        message = {"id": self._next_id, **job}
        try:
            self._proc.stdin.write((json.dumps(message) + "\n").encode())
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            reason = self._death_reason("before the job")
            self.close()
            return {"status": "error", "reason": reason}
        reply = self._wait(self.timeout_s)
        if reply is not None and reply.get("timeout"):
            self.close(graceful=False)
            return {"status": "error", "reason": f"hung: no answer within --timeout {self.timeout_s:g} s; worker killed"}
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
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                proc.kill()
            proc.wait()
