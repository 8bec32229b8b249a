"""Child processes: the one set of helpers that starts them, times them out, kills their process group and
collects their output. Every process attn-doctor starts (backend workers, the TE probe, torchrun and its
ranks) goes through here, in a session of its own (so a kill reaches whatever the kernel started), and is
remembered while it lives, so that Ctrl-C can take them all down at once (`kill_all`)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Sequence

from attn_doctor.core.errors import BadInput

PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])

_live: set[Any] = set()  # subprocess.Popen, or execution.fork_server.ForkedProcess
_lock = threading.Lock()
_for_children: dict[str, str | None] = {}  # variables every child gets (None: left out), `for_every_child`


def for_every_child(variables: dict[str, str | None]) -> None:
    """Give every child started from now on these variables (None: leave the variable out), whatever this
    process's own environment says: the command's private bytecode (`core.bytecode.use`)."""
    _for_children.update(variables)


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, with this copy of attn_doctor importable, output unbuffered, and `for_every_child`'s
    variables."""
    env = dict(os.environ)
    for name, value in _for_children.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    env["PYTHONPATH"] = PACKAGE_PARENT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


def last_json_object(output: str) -> dict | None:
    """The last line of a child's output that is a JSON object (what a child reporting facts prints last, after
    whatever its libraries printed), or None."""
    import json

    for line in reversed(output.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                found = json.loads(line)
            except ValueError:
                continue
            if isinstance(found, dict):
                return found
    return None


def describe_exit(returncode: int) -> str:
    """'exit code 9', 'signal SIGABRT', or for a shell-style code above 128 'exit code 134 (signal SIGABRT?)'."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    if returncode > 128:
        try:
            return f"exit code {returncode} (signal {signal.Signals(returncode - 128).name}?)"
        except ValueError:
            pass
    return f"exit code {returncode}"


def start(command: Sequence[str], *, stdin: Any = subprocess.DEVNULL, stdout: Any = subprocess.PIPE,
          stderr: Any = subprocess.PIPE, env: dict[str, str] | None = None, text: bool = False,
          pass_fds: Sequence[int] = ()) -> subprocess.Popen:
    """Start `command` in a new session, remembered until it is reaped by `wait`, `kill_group` or `stop`."""
    kwargs: dict[str, Any] = {"errors": "replace"} if text else {}
    proc = subprocess.Popen(list(command), stdin=stdin, stdout=stdout, stderr=stderr, env=env or child_env(),
                            start_new_session=True, text=text, pass_fds=tuple(pass_fds), **kwargs)
    remember(proc)
    return proc


def remember(proc: Any) -> None:
    """Remember a child this module did not start (a worker forked by a fork server and re-parented here: it has
    Popen's pid, poll, wait and kill) until it is reaped, so that Ctrl-C takes it down with the rest."""
    with _lock:
        _live.add(proc)


def _forget(proc: subprocess.Popen) -> None:
    with _lock:
        _live.discard(proc)


def signal_group(pid: int, sig: int, only_if_leader: bool = False) -> None:
    """Send `sig` to the process group led by `pid` (with `only_if_leader`: only if `pid` still leads a
    group of its own, so that a reused pid is left alone)."""
    try:
        if only_if_leader and os.getpgid(pid) != pid:
            return
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_group(proc: subprocess.Popen) -> int | None:
    """SIGKILL the process's whole group and reap it; its exit code (None if it would not die)."""
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            try:
                proc.kill()
            except OSError:
                pass
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None
    _forget(proc)
    return code


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process's group, give it `grace_s` to finish, then SIGKILL the group."""
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)


def wait(proc: subprocess.Popen, timeout_s: float | None = None) -> int:
    """Wait for the process (TimeoutExpired past `timeout_s`) and forget it."""
    code = proc.wait(timeout=timeout_s)
    _forget(proc)
    return code


@dataclass
class Finished:
    returncode: int | None  # None: killed at the time-out
    stdout: str
    stderr: str


def run_collect(command: Sequence[str], timeout_s: float, env: dict[str, str] | None = None) -> Finished:
    """Run a command to completion with text output; killed with its group past `timeout_s`."""
    proc = start(command, env=env, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        return Finished(None, out or "", err or "")
    except BaseException:
        kill_group(proc)
        raise
    _forget(proc)
    return Finished(proc.returncode, out, err)


def kill_all() -> None:
    """SIGKILL every live child's group (Ctrl-C: nothing attn-doctor started may outlive it)."""
    with _lock:
        procs = list(_live)
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc.pid, signal.SIGKILL)
    for proc in procs:
        try:
            proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass
        _forget(proc)


def kill_other_children() -> None:
    """SIGKILL this process's children that `start` did not start: those a library started on attn-doctor's
    behalf, e.g. torch's shared-memory manager (`torch_shm_manager`, which outlived an interrupted run for
    seconds). Read from /proc; nothing where there is none."""
    me = str(os.getpid())
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, IndexError, ValueError):
            continue


def read_tail(stream: IO[bytes], lines: int) -> str:
    """The last `lines` lines of a file opened for reading and writing (a child's captured stderr)."""
    stream.flush()
    stream.seek(0)
    text = stream.read().decode(errors="replace").strip().splitlines()
    return "\n".join(text[-lines:])


MAX_TIMEOUT_S = 7 * 24 * 3600.0  # one week: deadlines stay far inside what time arithmetic and locks accept


def check_timeout(timeout_s: object) -> None:
    """A probe's timeout is a number of seconds above 0 and at most MAX_TIMEOUT_S (the Python API's requests are
    checked as the command line's --timeout is)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise BadInput(f"--timeout takes a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f} (a week), got "
                       f"{timeout_s!r}")


def seconds_since_start() -> float | None:
    """How long this process has run, from the kernel's record of its start (interpreter and imports included,
    which a clock started in Python misses); None where that cannot be read (not Linux)."""
    import time

    try:
        stat = Path("/proc/self/stat").read_text()
        # the fields after the command's name (which may hold spaces), counted from the state as field 3
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None
