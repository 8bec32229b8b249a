"""A worker started before the session asked (issue 43's speed: TE's import overlapping the command's own start,
`attn_doctor.execution.pool.prestart`): the session's worker of that family, device and environment takes it
(the same process answers), one of another key is not taken, a prestarted process that died is replaced, and
one nobody took is killed at exit. And the guess from the flags: TE only where TE, a GPU and no --cudnn."""

from __future__ import annotations

import os

import pytest

from attn_doctor.execution import pool
from attn_doctor.execution.pool import Worker, prestart, prestart_te

ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def nothing_prestarted():
    yield
    pool._discard_prestarted()


def _pid(key: tuple) -> int:
    return pool._prestarted[key][0].pid


def test_the_sessions_worker_takes_the_prestarted_process_of_its_key_only():
    prestart("sdpa", "cpu", ENV)
    early = _pid(pool._key("sdpa", "cpu", ENV))
    other = Worker("sdpa", "cpu", 60.0, {"OMP_NUM_THREADS": "2"})  # another environment: its own process
    assert other.ensure_started() is None and other.hello["pid"] != early
    other.close()
    worker = Worker("sdpa", "cpu", 60.0, dict(ENV))
    try:
        assert worker.ensure_started() is None
        assert worker.hello["pid"] == early and not pool._prestarted
        reply = worker.request({"op": "nonsense"})  # the taken process serves jobs as any worker does
        assert reply["status"] == "error" and reply["internal"]
    finally:
        worker.close()


def test_a_prestarted_process_that_died_is_replaced_and_one_not_taken_is_killed():
    prestart("sdpa", "cpu", ENV)
    proc = pool._prestarted[pool._key("sdpa", "cpu", ENV)][0]
    proc.kill()
    proc.wait()
    worker = Worker("sdpa", "cpu", 60.0, dict(ENV))
    try:
        assert worker.ensure_started() is None and worker.hello["pid"] != proc.pid
    finally:
        worker.close()
    prestart("local", "cpu", ENV)
    left = pool._prestarted[pool._key("local", "cpu", ENV)][0]
    pool._discard_prestarted()
    assert left.wait(timeout=5) is not None and not pool._prestarted


def test_te_is_prestarted_only_for_te_paths_on_a_gpu_without_cudnn_builds(monkeypatch):
    started = []
    monkeypatch.setattr(pool, "prestart", lambda family, device, environment=None: started.append((family, device)))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())  # TE "installed"
    monkeypatch.setattr(os.path, "exists", lambda path: path == "/dev/nvidiactl")
    prestart_te((), None, "auto")
    prestart_te(("te.fused",), None, "cuda:1")
    prestart_te(("sdpa",), None, "cuda")  # no TE path asked for
    prestart_te(("te.mha", "te.module"), None, "cuda")  # TE's layers run in a worker of their own family
    prestart_te((), "9.14.0", "cuda")  # each build's process has its own variables
    prestart_te((), None, "cpu")
    assert started == [("te", "cuda"), ("te", "cuda:1")]
    monkeypatch.setattr(os.path, "exists", lambda path: False)
    prestart_te((), None, "auto")  # no GPU here
    assert len(started) == 2
