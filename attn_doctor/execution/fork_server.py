"""Fork servers: one process per kind of worker imports its libraries once, and each worker of that kind is forked
from it, ready in the time its CUDA context takes.

Why: a worker's start is its imports, torch and its family's library (TE with its cuDNN and torch extension). On the
lent H100's host that was 11.7 s for a TE worker from a cold start and 5.3 s for an SDPA one
(reports/h100/issue51/lease3), 5.2 s of it compiling Python sources the image has no bytecode for
(reports/h100/issue51/lease4/cost); a sweep starts up to 15 workers at once, each paying that on the same cores, and a
worker restarted after a crash, or for probes retried alone, paid it again. Forked, a kind pays it once.

Safe to fork: the server imports and never computes; it refuses to fork where its imports initialised CUDA
(`_why_not_forkable`), and each worker makes its CUDA context and runs a kernel after the fork, before its hello
(`worker.serve`), so a fork the driver refuses fails that worker's start. The pool then starts the worker as a
process of its own and forks no more from that server (`pool.Worker._start`): the fork is a shortcut, never a
condition of a row. What a worker loaded is read back in its hello as before; the server's imports are the worker's.

Whose child a worker is: it is forked twice (server, then a short-lived intermediate that exits at once), so that it
is re-parented to the nearest child subreaper above it, attn-doctor's own process (`_become_subreaper`, Linux's
PR_SET_CHILD_SUBREAPER). attn-doctor then waits for a forked worker as for any child it started (`ForkedProcess`):
its exit code or signal exact, in its own session so that a kill reaches whatever it started, and remembered for
Ctrl-C (`core.processes`). What a worker leaves behind when it ends (torch's shared-memory manager) becomes
attn-doctor's child too, and Ctrl-C kills it with the rest (`processes.kill_other_children`).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO

from attn_doctor.core import processes

READY_TIMEOUT_S = 300.0  # a cold TE import on a busy host takes seconds; a server silent this long is given up
FORK_TIMEOUT_S = 60.0
_MESSAGE_BYTES = 1 << 20
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NAME = 15


class ForkedProcess:
    """A worker forked by a server and re-parented to this process: the part of `subprocess.Popen` the pool and
    `core.processes` use (pid, stdin, stdout, poll, wait, kill, returncode)."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]):
        self.pid = pid
        self.stdin = stdin
        self.stdout = stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # not re-parented here after all: alive while its pid answers
                    if not _alive(self.pid):
                        self.returncode = 1
                else:
                    if pid == self.pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.001
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"forked worker {self.pid}", timeout)
            time.sleep(pause)
            pause = min(0.05, pause * 2)
        return self.returncode  # type: ignore[return-value]

    def kill(self) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class ForkServer:
    """The server of one kind of worker (family, device, environment), started at once; `fork` waits for its imports."""

    def __init__(self, family: str, device: str, environment: dict[str, str]):
        parent_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.log = tempfile.TemporaryFile(mode="w+b")  # what its imports printed: the reason when it fails
        self.proc = processes.start(
            [sys.executable, "-m", "attn_doctor.execution.fork_server", family, device, str(server_end.fileno())],
            stdout=self.log, stderr=self.log, env=processes.child_env(environment), pass_fds=(server_end.fileno(),))
        server_end.close()
        self._control = parent_end
        self._lock = threading.Lock()
        self._ready = False
        self.broken: str | None = None  # why it forks no more

    def fork(self, stderr: IO[bytes]) -> ForkedProcess | None:
        """A worker forked with `stderr` as its stderr, or None where this server cannot fork (`broken` says why)."""
        with self._lock:
            if self.broken is None and not self._ready:
                ready = self._receive(READY_TIMEOUT_S)
                self._ready = bool(ready and ready.get("ready"))
                if not self._ready:
                    self._give_up((ready or {}).get("why_not") or self._silence("before it was ready"))
            if self.broken is not None:
                return None
            stdin_read, stdin_write = os.pipe()
            stdout_read, stdout_write = os.pipe()
            try:
                socket.send_fds(self._control, [b'{"fork": true}'], [stdin_read, stdout_write, stderr.fileno()])
                reply = self._receive(FORK_TIMEOUT_S)
            except OSError as exc:
                reply = {"why_not": f"its control socket failed ({exc})"}
            finally:
                os.close(stdin_read)
                os.close(stdout_write)
            if not reply or not reply.get("pid"):
                os.close(stdin_write)
                os.close(stdout_read)
                self._give_up((reply or {}).get("why_not") or self._silence("while forking"))
                return None
            forked = ForkedProcess(int(reply["pid"]), os.fdopen(stdin_write, "wb"), os.fdopen(stdout_read, "rb"))
            processes.remember(forked)
            return forked

    def give_up(self, why: str) -> None:
        """Fork no more from this server (a worker it forked did not start: `why`), and end it."""
        with self._lock:
            self._give_up(why)

    def _give_up(self, why: str) -> None:
        if self.broken is None:
            self.broken = why
        self.close()

    def _receive(self, timeout_s: float) -> dict | None:
        self._control.settimeout(timeout_s)
        try:
            data = self._control.recv(_MESSAGE_BYTES)
        except OSError:  # timed out, or the server is gone
            return None
        return json.loads(data) if data else None

    def _silence(self, when: str) -> str:
        code = self.proc.poll()
        said = processes.read_tail(self.log, 1)
        how = f"died {when} ({processes.describe_exit(code)})" if code is not None else f"did not answer {when}"
        return f"fork server {how}" + (f": {said}" if said else "")

    def close(self) -> None:
        try:
            self._control.close()
        except OSError:
            pass
        processes.kill_group(self.proc)


# -- the server process --

def _why_not_forkable() -> str | None:
    """Why this process must not fork workers: its imports initialised CUDA (a forked child's CUDA would not work)."""
    import torch

    return "its imports initialised CUDA" if torch.cuda.is_initialized() else None


def _threads() -> int:
    """This process's threads, as the kernel counts them (a library's native threads too): a worker forked while
    others run gets a copy of memory whose locks they may hold; said in each forked worker's hello."""
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def _imports_cost() -> dict[str, float]:
    """What this server's start took, its imports done: seconds since it started, of them on a CPU (user and
    system), and the pages it waited for the disk to read (major faults: a cold page cache). Where a cold start goes
    (reports/h100/issue51/lease6)."""
    import resource

    from attn_doctor.core.processes import seconds_since_start

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"ready_s": round(seconds_since_start() or 0.0, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
            "major_faults": usage.ru_majflt}


def _send(control: socket.socket, message: dict) -> None:
    control.send(json.dumps(message).encode())


def serve(family: str, device: str, control_fd: int) -> int:
    """Import what the family's workers import (`worker.prepare`), say whether it can fork, then fork a worker per
    request (its stdin, stdout and stderr come with the request) until attn-doctor closes the control socket."""
    from attn_doctor.execution import worker

    hello = worker.prepare(family)
    hello["forked"] = {"server_pid": os.getpid(), "server_threads": _threads(), **_imports_cost()}
    control = socket.socket(fileno=control_fd)
    why_not = _why_not_forkable()
    _send(control, {"ready": why_not is None, "why_not": why_not})
    if why_not is not None:
        return 0
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, _MESSAGE_BYTES, 3)
        except OSError:
            return 0
        if not data:  # attn-doctor closed its end (or exited)
            return 0
        pid = _fork_worker(control, fds, family, device, hello) if len(fds) == 3 else 0
        for fd in fds:
            os.close(fd)
        _send(control, {"pid": pid} if pid else {"why_not": "the fork failed (see the server's log)"})


def _fork_worker(control: socket.socket, fds: list[int], family: str, device: str, hello: dict) -> int:
    """Fork, fork again and let the middle process exit, so that the worker is re-parented to attn-doctor (the
    subreaper); the worker's pid once that has happened (0 if the fork failed)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid_read, pid_write = os.pipe()
    middle = os.fork()
    if middle == 0:
        os.close(pid_read)
        try:
            child = os.fork()
            if child == 0:
                os.close(pid_write)
                _become_worker(control, fds, family, device, hello)
            os.write(pid_write, str(child).encode())
        finally:
            os._exit(0)
    os.close(pid_write)
    with os.fdopen(pid_read, "rb") as told:
        said = told.read()
    os.waitpid(middle, 0)  # once the middle process is reaped, the worker has its new parent
    return int(said) if said else 0


def _become_worker(control: socket.socket, fds: list[int], family: str, device: str, hello: dict) -> None:
    """In the forked worker: its own session, the given stdin, stdout and stderr, then `worker.serve`; never
    returns."""
    code = 1
    try:
        control.close()
        os.setsid()
        _name_process(f"worker {family}")
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0 is now the pipe from attn-doctor
        from attn_doctor.execution import worker

        out = worker.protocol_stream()
        code = worker.profiled(family, lambda: worker.serve(family, device, hello, out))
    except BaseException:  # noqa: BLE001 - whatever happened is on the worker's stderr, where the pool reads it
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _prctl(option: int, value: int | bytes) -> bool:
    """Linux's prctl(option, value); False where it fails or there is none (not Linux)."""
    try:
        return ctypes.CDLL(None).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _name_process(name: str) -> None:
    """The name `ps -o comm` and /proc/PID/comm show (15 bytes at most): a forked worker's command line is its
    server's, so this is how one tells them apart (`worker te`)."""
    _prctl(_PR_SET_NAME, name.encode()[:15])


# -- in attn-doctor's process --

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_subreaper: list[bool | None] = [None]


def _become_subreaper() -> bool:
    """Mark this process the child subreaper of its descendants (once), so that a forked worker is its child;
    False where the system does not allow it (not Linux), and then no worker is forked."""
    if _subreaper[0] is None:
        _subreaper[0] = _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    return bool(_subreaper[0])


MAX_SERVERS = 6  # servers kept at once, the least recently used ended first (each holds its imports in memory)
_servers: dict[tuple, ForkServer] = {}
_refused: dict[tuple, str] = {}  # kinds whose server could not fork, or forked a worker that did not start: why
_servers_lock = threading.Lock()
_at_exit: list[bool] = []  # close_all registered to run at exit


def server_for(family: str, device: str, environment: dict[str, str]) -> ForkServer | None:
    """The fork server of this kind of worker, started now if there is none; None where workers of this kind are
    not forked (this system allows no subreaper, or a server of this kind failed: `_refused`, for the process's
    life). Keyed by the whole environment a worker would start with, so that a variable set since is never
    missed."""
    if not _become_subreaper():
        return None
    key = (family, device, tuple(sorted(processes.child_env(environment).items())))
    with _servers_lock:
        server = _servers.pop(key, None)
        if server is not None and server.broken is not None:
            _refused[key] = server.broken
            server = None
        if key in _refused:
            return None
        if server is None:
            if not _at_exit:
                import atexit

                atexit.register(close_all)
                _at_exit.append(True)
            server = ForkServer(family, device, environment)
        _servers[key] = server  # the most recently used last
        ended = [_servers.pop(old) for old in list(_servers)[:-MAX_SERVERS]]
    for old in ended:
        old.close()
    return server


def close_all() -> None:
    """End every server (their workers live on: each is a process of its own)."""
    with _servers_lock:
        ended = list(_servers.values())
        _servers.clear()
    for server in ended:
        server.close()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], sys.argv[2], int(sys.argv[3])))
