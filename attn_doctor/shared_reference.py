"""One float64 reference per case, shared by every worker process that measures a backend on it.

The parent process computes a case's reference once and gives each worker a handle to those very tensors
instead of letting every backend family's worker recompute it: CUDA IPC on a GPU, a shared-memory file on
the CPU. torch's own tensor pickling (what torch.multiprocessing sends through its queues) makes the
handle; it travels base64-encoded in the job's JSON. The parent keeps the tensors alive until the last job
of the case has finished. Where sharing fails, the handle is None and the worker computes the reference
itself, as it would without a parent.
"""

from __future__ import annotations

import base64
import io
import pickle
import threading
import time

import torch

from attn_doctor.case import Case
from attn_doctor.reference import Reference


class ReferenceStore:
    """Parent side: computes each case's reference on first request and counts the jobs still using it."""

    def __init__(self, device: str):
        self.device = device
        self.seconds = 0.0  # computing references, summed
        self.computed = 0
        self.failure: str | None = None  # the last reason sharing fell back to the workers
        self._lock = threading.Lock()
        self._entries: dict[tuple, _Entry] = {}

    def expect(self, case: Case, jobs: int) -> None:
        """`jobs` more jobs will ask for this case's reference."""
        with self._lock:
            self._entries.setdefault(case.key(), _Entry()).pending += jobs

    def handle(self, case: Case) -> str | None:
        """The case's shared reference (computed now if it is the first request), or None."""
        with self._lock:
            entry = self._entries.setdefault(case.key(), _Entry())
        with entry.lock:  # one computation per case; other cases proceed in parallel
            if not entry.ready:
                entry.payload, entry.tensors = self._share(case)
                entry.ready = True
            return entry.payload

    def done(self, case: Case) -> None:
        """One job of this case finished; the last one frees the reference."""
        with self._lock:
            entry = self._entries.get(case.key())
            if entry is None:
                return
            entry.pending -= 1
            if entry.pending > 0:
                return
            del self._entries[case.key()]
        entry.tensors = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()  # give the memory back for the workers

    def clear(self) -> None:
        """Forget every case (the session is over; workers have exited)."""
        with self._lock:
            self._entries.clear()

    def _share(self, case: Case) -> tuple[str | None, tuple | None]:
        from attn_doctor.probe import make_inputs, synchronize
        from attn_doctor.reference import attention_reference

        try:
            device = torch.device(self.device)
            start = time.perf_counter()
            inputs = make_inputs(case, device)
            reference = attention_reference(inputs.q, inputs.k, inputs.v, inputs.dout, causal=case.causal,
                                            softmax_scale=case.softmax_scale, window=case.window)
            synchronize(device)
            tensors = (reference.out, reference.dq, reference.dk, reference.dv, reference.lse)
            payload = export_tensors(tensors)
        except Exception as exc:  # noqa: BLE001 - out of memory, no shared memory: the workers compute it
            self.failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
            return None, None
        with self._lock:
            self.seconds += time.perf_counter() - start
            self.computed += 1
        return payload, tensors


class _Entry:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pending = 0
        self.ready = False
        self.payload: str | None = None
        self.tensors: tuple | None = None


def export_tensors(tensors: tuple) -> str:
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing

    # Named shared-memory files, which any process can open; the default (file descriptors) only reaches
    # processes that torch.multiprocessing itself started.
    torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(tensors)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def open_reference(payload: str) -> Reference:
    """Worker side: the parent's reference tensors, mapped (not copied) into this process."""
    import torch.multiprocessing.reductions  # noqa: F401 - registers how shared tensors are rebuilt

    out, dq, dk, dv, lse = pickle.loads(base64.b64decode(payload))
    return Reference(out=out, dq=dq, dk=dk, dv=dv, lse=lse)
