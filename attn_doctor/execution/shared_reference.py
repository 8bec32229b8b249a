"""One float64 reference per case, shared by every worker process that measures a backend on it.

The parent process computes a case's reference once and gives each worker a handle to those very tensors
instead of letting every backend family's worker recompute it: CUDA IPC on a GPU, a shared-memory file on
the CPU. A case's reference is its attention's (out, dQ, dK, dV, LSE) or, for a depth probe, the dQ at
every layer of the case's L-layer stack run in float64 (keyed by the case and L).

torch's own tensor pickling (what torch.multiprocessing sends through its queues) makes the handle; it
travels base64-encoded in the job's JSON. A CUDA handle carries a reference count that its one receiver
gives back when it frees what it opened: so every job gets a handle of its own, and the worker opens every
handle it receives, also when it already has the case (torch then gives the count back at once). The parent
keeps the tensors alive until the last job of the case has finished. Where sharing fails, the handle is
None and the worker computes the reference itself, as it would without a parent.

Threads: every serving thread of the session asks for references; one at a time works with torch here (`_gpu`:
computing, exporting, freeing a reference and giving cached memory back), so one reference is computed at a time
and its scratch is counted once.

Memory (`attn_doctor.execution.budget`): at most `max_live` references are kept at once: a job that would open
another waits until an older one's last job has finished. That bounds what the parent holds when families run at
different speeds (the fastest would otherwise open case after case). References are admitted in the order the
session serves their cases (`admit_in`), never a later case before an earlier one: then the oldest kept
reference's remaining jobs are each some family's next unit or already running, need no new reference, and free
its place, so the wait always ends. Admitted in whatever order the threads asked, it did not: with several workers
per family the threads of the fastest family filled every place with later cases, finished their jobs there and
waited to open the next, while a slower family's next case, older than all of those, waited for a place (issue
51's sweeps on the H100 stopped for good at 1,439 of 1,899 probes, every serving thread waiting for room and every
worker idle; `tests/test_memory_plan.py` reproduces it).
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time
from collections.abc import Callable

import torch

from attn_doctor.core.case import Case
from attn_doctor.core.errors import first_line


class ReferenceStore:
    """Parent side: computes each case's reference on first request and counts the jobs still using it."""

    def __init__(self, device: str, on_progress: Callable[[str], None] | None = None, max_live: int | None = None):
        self.device = device
        self.max_live = max_live  # references kept at once (None: no bound)
        self.on_progress = on_progress  # told as a depth stack's float64 replica advances
        self.seconds = 0.0  # computing references, summed
        self.computed = 0
        self.failure: str | None = None  # the last reason sharing fell back to the workers
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # told when a kept reference is freed
        # one thread at a time with torch on the GPU (see the module), so one computation at a time: its scratch is
        # counted once
        self._gpu = threading.RLock()
        self._live = 0  # references computed and not yet freed
        self._rank: dict[tuple, int] = {}  # the order cases are admitted in (`admit_in`), until admitted
        self._next_rank = 0  # the rank whose turn it is
        self._closed = False
        self._entries: dict[tuple, _Entry] = {}
        if device == "cpu":
            _start_shm_manager()

    def expect(self, case: Case, layers: int | None = None) -> None:
        """One more job will ask for this reference (the attention's; with `layers`, the depth stack's)."""
        with self._lock:
            self._entries.setdefault((case.key(), layers), _Entry()).pending += 1

    def admit_in(self, keys: list[tuple[Case, int | None]]) -> None:
        """The order in which the references of (case, layers) are admitted from now on: the session's, as it
        serves their jobs. A reference not in it (a probe retried alone) waits only for room."""
        with self._room:
            order = dict.fromkeys((case.key(), layers) for case, layers in keys)
            self._rank = {key: rank for rank, key in enumerate(order)}
            self._next_rank = 0
            self._room.notify_all()

    def handle(self, case: Case, layers: int | None = None) -> str | None:
        """A new handle, for one job, to the shared reference (computed now if this is its first request);
        None where the reference could not be computed or shared here."""
        with self._lock:
            entry = self._entries.setdefault((case.key(), layers), _Entry())
        with entry.lock:  # one computation per reference
            if not entry.ready:
                self._admit((case.key(), layers))
                entry.live = True
                with self._gpu:
                    entry.tensors = self._compute_timed(case, layers)
                entry.ready = True
            if entry.tensors is None:
                return None
            try:
                with self._gpu:
                    return export_tensors(entry.tensors)
            except Exception as exc:  # noqa: BLE001 - no shared memory, no IPC: this job's worker computes it
                self.failure = first_line(exc)
                return None

    def done(self, case: Case, layers: int | None = None) -> None:
        """One job using this reference finished; the last one frees it."""
        key = (case.key(), layers)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return
            entry.pending -= 1
            if entry.pending > 0:
                return
            del self._entries[key]
            if entry.live:
                self._live -= 1
                self._room.notify_all()
        with self._gpu:
            entry.tensors = None  # frees the tensors (and their CUDA IPC records) here, under the lock
            self._release_cached_memory()

    def kept_bytes(self) -> int:
        """Bytes of the references kept now."""
        with self._lock:
            entries = list(self._entries.values())
        return sum(t.numel() * t.element_size() for entry in entries if entry.tensors is not None
                   for t in entry.tensors if t is not None)

    def _admit(self, key: tuple) -> None:
        """Wait until this reference's turn (`admit_in`) and room to keep one more (`max_live`); interruptible by
        `clear`."""
        with self._room:
            rank = self._rank.get(key)
            while not self._closed and (self.max_live is not None and self._live >= self.max_live
                                        or rank is not None and rank != self._next_rank):
                self._room.wait(0.5)
            self._live += 1
            if rank is not None:
                del self._rank[key]  # admitted: computed again (a retry) it waits only for room
                self._next_rank = rank + 1
                self._room.notify_all()  # the next in line may be waiting

    def clear(self) -> None:
        """Forget every case (the session is over; workers have exited); release any job waiting for room."""
        with self._lock:
            self._entries.clear()
            self._live = 0
            self._closed = True
            self._room.notify_all()

    def _compute_timed(self, case: Case, layers: int | None) -> tuple[torch.Tensor, ...] | None:
        try:
            start = time.perf_counter()
            tensors = self._compute(case, layers)
        except Exception as exc:  # noqa: BLE001 - out of memory here, say: the workers compute it
            self.failure = first_line(exc)
            return None
        finally:
            self._release_cached_memory()  # the computation's scratch (a deep stack's: tens of GiB)
        with self._lock:
            self.seconds += time.perf_counter() - start
            self.computed += 1
        return tensors

    def _compute(self, case: Case, layers: int | None) -> tuple[torch.Tensor, ...]:
        from attn_doctor.numerics.inputs import make_inputs, synchronize
        from attn_doctor.numerics.standalone import TORCH_DTYPES
        from attn_doctor.numerics.reference import attention_reference
        from attn_doctor.probes.stack import float64_replica_dqs
        from attn_doctor.tracing.replay_source import source_of

        device = torch.device(self.device)
        if layers is not None:
            tensors = tuple(float64_replica_dqs(case, layers, device, TORCH_DTYPES[case.dtype], self.on_progress))
        else:
            inputs = make_inputs(case, device, source_of(case))
            reference = attention_reference(inputs.q, inputs.k, inputs.v, inputs.dout, softmax_scale=case.softmax_scale,
                                            semantics=inputs.semantics)
            tensors = reference.shared()
        synchronize(device)
        return tensors

    def _release_cached_memory(self) -> None:
        """Give free memory back for the workers, also references that workers have stopped mapping (CUDA
        IPC keeps a sent block alive until its consumers release it; ipc_collect frees the released ones)."""
        if self.device.startswith("cuda"):
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()


class _Entry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending = 0
        self.ready = False
        self.live = False  # counted among the kept references
        self.tensors: tuple | None = None


_shm_manager_started = False


def _start_shm_manager() -> None:
    """Start torch's shared-memory manager (the daemon behind file_system sharing on the CPU) now, with
    stderr pointed at /dev/null: it inherits stderr, and it outlives this process by a couple of seconds,
    which would hold a pipe reading attn-doctor's stderr (`2>&1 | tee`) open after attn-doctor has exited.
    Called from the thread that makes the session, before any worker or other thread writes to stderr."""
    global _shm_manager_started
    if _shm_manager_started:
        return
    _shm_manager_started = True
    import os

    import torch.multiprocessing

    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        torch.multiprocessing.set_sharing_strategy("file_system")
        torch.empty(1).share_memory_()
    except Exception:  # noqa: BLE001 - then torch starts it later, as it would anyway
        pass
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def export_tensors(tensors: tuple) -> str:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    # Named shared-memory files, which any process can open; the default (file descriptors) only reaches
    # processes that torch.multiprocessing itself started.
    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def open_tensors(payload: str | None) -> tuple[torch.Tensor, ...] | None:
    """Worker side: the parent's reference tensors, mapped (not copied) into this process; None without a
    handle or with one this process cannot open (the worker then computes the reference itself)."""
    if payload is None:
        return None
    import torch.multiprocessing.reductions  # noqa: F401 - registers how shared tensors are rebuilt

    try:
        return pickle.loads(base64.b64decode(payload))
    except Exception:  # noqa: BLE001 - whatever the reason, computing the reference here is the way out
        return None
