"""Parent side of a worker process: start it (forked from its kind's fork server where it can be: `fork_server`),
feed it jobs, time it out, restart it.

A worker that crashes (segfault, abort), hangs past the timeout or reports a CUDA fault turns the job it
was running into an ERROR reply with the reason and the tail of its stderr; the next job gets a fresh
worker. Nothing a kernel does can take the tool down.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

from attn_doctor.core import bytecode, processes
from attn_doctor.execution import fork_server

STARTUP_TIMEOUT_S = 300.0
# A forked worker has imported everything already: its start is a CUDA context and one kernel, seconds even on a
# busy host. One silent past this is taken for a fork the driver will not serve, and started again on its own.
FORKED_STARTUP_TIMEOUT_S = 60.0


def _launch(family: str, device: str, environment: dict[str, str], stderr: Any) -> subprocess.Popen:
    return processes.start([sys.executable, "-m", "attn_doctor.execution.worker", family, device],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
                           env=processes.child_env(environment))


def prestart(family: str, device: str, environment: dict[str, str] | None = None) -> None:
    """Start the fork server of `family`'s workers on `device` now (`fork_server`), for the session's workers of
    that kind to be forked from. Why: a TE worker's start is TE's import, 8 s of a cold default run's 20 s on an
    H100's host, and the command's own start (torch's import, the plan, the case's float64 reference) comes before
    the session starts any worker; started from the command line's first lines, the two overlap."""
    fork_server.server_for(family, device, environment or {})


def prestart_servers(backends: tuple[str, ...] | list[str], cudnn: str | None, device_name: str) -> None:
    """Start the fork servers a command is about to need (`prestart`), guessed from its flags alone, before torch
    is imported, on a CUDA device only (`auto` where an NVIDIA device node exists): the baseline's (`local`, in every
    run), SDPA's where its paths are selected (no --backend, or one naming sdpa), and TE's where TE's attention paths
    are (no --backend, or one naming te), TE is installed and neither --cudnn nor --te is given (`cudnn`: either;
    each build's or release's paths run in processes with variables of their own). A wrong guess costs a process
    ended at exit, never a row. First, where the environment has no bytecode for torch, the command goes under a
    private one, filled on the idle cores (`core.bytecode`)."""
    import importlib.util

    device = device_name if device_name.startswith("cuda") else (
        "cuda" if device_name == "auto" and os.path.exists("/dev/nvidiactl") else None)
    if device is None:
        return

    def named(family: str, but: tuple[str, ...] = ()) -> bool:
        return not backends or any(name == family or name.startswith(family + ".") and name not in but
                                   for name in backends)

    layers = ("te.module", "te.mha", "te.layer")  # TE's layers: a worker of their own family (backends.te_module)
    with_te = named("te", but=layers) and not cudnn and importlib.util.find_spec("transformer_engine") is not None
    bytecode.start(["torch", "numpy"] + (["transformer_engine"] if with_te else []))  # before any of them imports
    if with_te:
        prestart("te", device)  # first: TE's import is the longest
    if named("sdpa"):
        prestart("sdpa", device)
    prestart("local", device)


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
        self._quitting = False  # asked to quit (`ask_to_quit`), not yet closed
        self._replies: queue.Queue = queue.Queue()
        self._stderr = tempfile.TemporaryFile(mode="w+b")
        self._next_id = 0
        self._lock = threading.Lock()  # start and close may come from different threads

    def _start(self) -> str | None:
        """Start the process, forked from its kind's fork server where it can be, and wait for its hello; the reason
        on failure. A forked worker that does not start is started again as a process of its own, and its server
        forks no more: forking only saves the imports, it never decides a row."""
        server = fork_server.server_for(self.family, self.device, self.environment)
        started = time.perf_counter()
        reason = self._start_one(server)
        if reason is not None and server is not None and server.broken is None:
            server.give_up(f"a worker it forked did not start: {reason}")
            reason = self._start_one(None)
        self.startup_seconds += time.perf_counter() - started
        return reason

    def _start_one(self, server: fork_server.ForkServer | None) -> str | None:
        self._stderr.seek(0)
        self._stderr.truncate()
        self._proc = server.fork(self._stderr) if server is not None else None
        if self._proc is None:
            self._proc = _launch(self.family, self.device, self.environment, self._stderr)
        self.starts += 1
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(self._proc, self._replies), daemon=True).start()
        limit = FORKED_STARTUP_TIMEOUT_S if isinstance(self._proc, fork_server.ForkedProcess) else max(
            STARTUP_TIMEOUT_S, self.timeout_s)
        message = self._wait(time.monotonic() + limit)
        if message is not None and message.get("timeout"):
            self.close(graceful=False)
            return f"worker {self.family} did not start within {limit:g} s"
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

    def ask_to_quit(self) -> None:
        """Ask the process to end, without waiting (`close` waits): closing many, ask them all first, and their
        ends (a CUDA context's teardown each) overlap."""
        proc = self._proc
        if proc is not None and not self._quitting and proc.poll() is None:
            try:
                proc.stdin.write(b'{"op": "quit"}\n')
                proc.stdin.flush()
            except OSError:
                pass
            self._quitting = True

    def close(self, graceful: bool = True) -> None:
        if graceful:
            self.ask_to_quit()
        proc, self._proc, self._quitting = self._proc, None, False
        if proc is None:
            return
        if graceful and proc.poll() is None:
            try:
                processes.wait(proc, timeout_s=5)
            except subprocess.TimeoutExpired:
                pass
        processes.kill_group(proc)
