"""Workers forked from a fork server of their kind (`attn_doctor.execution.fork_server`; issue 51's speed: each kind
imports its libraries once), and the server started before the session asks (issue 43's speed: TE's import
overlapping the command's own start, `attn_doctor.execution.pool.prestart`).

The fork is a shortcut, never a condition of a row: a forked worker serves as a launched one does, is this
process's child (exit codes and signals exact, Ctrl-C's kill reaches it), crashes and restarts like one; a server
that cannot fork, or whose worker does not start, makes the pool start workers as processes of their own. And the
guess from the flags: TE only where TE, a GPU and no --cudnn."""

from __future__ import annotations

import os
import signal

import pytest

from attn_doctor.core import processes
from attn_doctor.execution import fork_server, pool
from attn_doctor.execution.pool import Worker, prestart, prestart_servers

pytestmark = pytest.mark.slow

ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def fresh_servers():
    fork_server.close_all()
    fork_server._refused.clear()
    yield
    fork_server.close_all()
    fork_server._refused.clear()


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])


def test_the_sessions_workers_are_forked_from_the_prestarted_server_of_their_key_only():
    prestart("sdpa", "cpu", ENV)
    (server,) = fork_server._servers.values()
    other = Worker("sdpa", "cpu", 60.0, {"OMP_NUM_THREADS": "2"})  # another environment: a server of its own
    workers = [Worker("sdpa", "cpu", 60.0, dict(ENV)) for _ in range(2)]
    try:
        assert other.ensure_started() is None
        assert other.hello["forked"]["server_pid"] != server.proc.pid
        for worker in workers:
            assert worker.ensure_started() is None
            assert worker.hello["forked"]["server_pid"] == server.proc.pid
            assert worker.hello["pid"] == worker._proc.pid
            cost = worker.hello["forked"]  # what the server's start took: the sweep's profile reports it
            assert 0 < cost["cpu_s"] and 0 < cost["ready_s"] < 120 and cost["major_faults"] >= 0
            assert _parent_of(worker._proc.pid) == os.getpid()  # re-parented here: waited for like any child
            assert worker._proc in processes._live
        reply = workers[0].request({"op": "nonsense"})  # a forked process serves jobs as any worker does
        assert reply["status"] == "error" and reply["internal"]
    finally:
        for worker in (other, *workers):
            worker.close()
    assert all(worker._proc is None for worker in workers) and len(fork_server._servers) == 2


def test_a_forked_worker_that_dies_is_reported_with_its_signal_and_forked_again():
    worker = Worker("sdpa", "cpu", 60.0, dict(ENV))
    try:
        assert worker.ensure_started() is None
        first = worker._proc
        os.kill(first.pid, signal.SIGSEGV)
        assert first.wait(timeout=10) == -signal.SIGSEGV  # the exit status, exactly, as for a launched process
        reply = worker.request({"op": "nonsense"})  # the next job gets a fresh worker, forked again
        assert reply["status"] == "error" and worker.starts == 2
        assert worker._proc.pid != first.pid and "forked" in worker.hello
    finally:
        worker.close()


def test_a_server_that_cannot_fork_leaves_workers_launched_as_processes_of_their_own(monkeypatch):
    prestart("local", "cpu", ENV)
    (server,) = fork_server._servers.values()
    processes.kill_group(server.proc)  # the server is gone before its first fork
    worker = Worker("local", "cpu", 60.0, dict(ENV))
    try:
        assert worker.ensure_started() is None and "forked" not in worker.hello
        assert "fork server died" in server.broken
        again = Worker("local", "cpu", 60.0, dict(ENV))  # that kind is not forked again in this process
        assert again.ensure_started() is None and "forked" not in again.hello
        again.close()
    finally:
        worker.close()


def test_a_forked_worker_that_does_not_start_is_started_again_as_a_process_of_its_own(monkeypatch):
    worker = Worker("sdpa", "cpu", 60.0, dict(ENV))
    monkeypatch.setattr(fork_server.ForkServer, "fork",
                        lambda self, stderr: fork_server.ForkedProcess(_dead_child(), _eof(), _eof()))
    try:
        assert worker.ensure_started() is None and "forked" not in worker.hello and worker.starts == 2
        assert fork_server.server_for("sdpa", "cpu", dict(ENV)) is None  # that kind is forked no more
        assert any("a worker it forked did not start" in why for why in fork_server._refused.values())
    finally:
        worker.close()


def _dead_child() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    return pid


def _eof():
    read, write = os.pipe()
    os.close(write)
    return os.fdopen(read, "rb")


def test_the_servers_prestarted_are_those_the_flags_ask_for_on_a_gpu_te_only_without_cudnn_builds(monkeypatch):
    started = []
    monkeypatch.setattr(pool, "prestart", lambda family, device, environment=None: started.append((family, device)))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # TE "installed"
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/nvidiactl")

    def guessed(*args) -> list[tuple[str, str]]:
        started.clear()
        prestart_servers(*args)
        return list(started)

    assert guessed((), None, "auto") == [("te", "cuda"), ("sdpa", "cuda"), ("local", "cuda")]
    assert guessed(("te.fused",), None, "cuda:1") == [("te", "cuda:1"), ("local", "cuda:1")]
    assert guessed(("sdpa",), None, "cuda") == [("sdpa", "cuda"), ("local", "cuda")]  # no TE path asked for
    assert guessed(("sdpa.cudnn", "te"), None, "cuda") == [("te", "cuda"), ("sdpa", "cuda"), ("local", "cuda")]
    # TE's layers run in a worker of their own family; each cuDNN build's or TE release's processes have their
    # own variables
    assert guessed(("te.mha", "te.module"), None, "cuda") == [("local", "cuda")]
    assert guessed((), "9.14.0", "cuda") == [("sdpa", "cuda"), ("local", "cuda")]
    assert guessed((), None, "cpu") == []
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # TE not installed
    assert guessed(("te.fused",), None, "cuda") == [("local", "cuda")]
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    assert guessed((), None, "auto") == []  # no GPU here
