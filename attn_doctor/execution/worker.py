"""The worker process: serves one backend family's probes, one JSON line in, one JSON line out.

Run as `python -m attn_doctor.execution.worker FAMILY DEVICE`. It prepares the family's library first
(TE must load before anything touches torch's cuDNN), answers {"hello": ...}, then one reply per request
({"op": "run", "coords": ..., "reference": ..., "repeats": N}),
with {"progress": "..."} lines while a long probe advances. Replies go to a private copy of the original
stdout; fd 1 is pointed at stderr so that whatever a library prints cannot corrupt the protocol. A CUDA
error may leave the context unusable, so after one the worker replies with "fatal": true and exits; the
parent starts a new one.

Errors are attributed: what the kernel under test raised is an "error" reply naming the kernel; anything
else that fails here is attn-doctor's own ("internal": true), never blamed on the kernel. Running out of memory is
neither: an "oom" reply, with what the allocator held and the allocation that failed, after which the worker
frees what it keeps (the parent retries the probe alone). A job's "memory_cap" (bytes) holds this process's
allocator to its share of the budget (torch's per-process memory fraction) for that job, and "release" gives the
allocator's cache back after it (the families take turns); on a GPU the reply's extra says what the allocator
reserved at the probe's peak ("allocator_peak_bytes").
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from typing import Callable


def protocol_stream():
    """The protocol's own copy of stdout; fd 1 and sys.stdout pointed at stderr, so that nothing a library prints
    reaches the protocol."""
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def main(argv: list[str]) -> int:
    family, device_name = argv[0], argv[1]
    out = protocol_stream()
    return serve(family, device_name, prepare(family), out)


def prepare(family: str) -> dict:
    """Everything a worker does before it serves, none of it on the device: its library loaded first
    (`prepare_process`: TE before anything touches torch's cuDNN), the modules serving needs imported; the hello's
    facts (what the library loaded). A fork server runs this once for every worker it forks (`fork_server`)."""
    import faulthandler
    import signal

    # SIGUSR1 prints every thread's stack to this worker's stderr (where a probe that stopped advancing waits).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from attn_doctor.machine.cudnn_builds import torch_preloads_wanted_build

    with torch_preloads_wanted_build():  # a cuDNN build asked for: torch preloads it, not pip's
        import torch  # noqa: F401 - first here, under the context
    from attn_doctor.backends import prepare_process

    hello = {"family": family, **prepare_process(family)}
    import attn_doctor.backends  # noqa: F401 - what serving imports, imported once where workers are forked
    import attn_doctor.core.errors  # noqa: F401
    import attn_doctor.execution.shared_reference  # noqa: F401
    import attn_doctor.probes  # noqa: F401
    import attn_doctor.tracing.replay_source  # noqa: F401

    return hello


def serve(family: str, device_name: str, hello: dict, out) -> int:
    """Answer {"hello": ...} once the device answers, then serve requests from stdin until "quit" or its end."""

    def reply(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    import torch

    from attn_doctor.backends import Unsupported, build
    from attn_doctor.core.coords import Coords
    from attn_doctor.core.errors import (
        InternalError,
        KernelError,
        first_line,
        is_cuda_fault,
        is_out_of_memory,
        kernel_code,
    )
    from attn_doctor.execution.shared_reference import open_tensors
    from attn_doctor.probes import Caches, run_probe
    from attn_doctor.tracing.replay_source import source_of

    device = torch.device(device_name)
    if device.type == "cuda":
        if device.index is not None:
            torch.cuda.set_device(device)  # TE builds its modules and workspaces on the current device
        # The context made, and a kernel run, before the hello: a worker whose device does not answer (a fork
        # CUDA refuses) fails its start, not its first probe.
        torch.ones(1, device=device).add_(1).item()
    caches = Caches(device, source_of)
    backends: dict[str, object] = {}
    reply({"hello": {**hello, "pid": os.getpid()}})

    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            caches.clear()  # release the parent's shared tensors before exiting, not during interpreter teardown
            return 0
        job_id = request["id"]
        # Opened whatever the job turns out to need: a handle's reference count comes back only when what
        # it opened is freed (see shared_reference). The caches keep what they use; the rest is freed after the job.
        caches.share(open_tensors(request.get("reference")))
        try:
            hold_to(request.get("memory_cap"), device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            coords = Coords.from_dict(request["coords"])
            spec = coords.backend
            if spec.name not in backends:
                try:
                    with kernel_code(passthrough=(Unsupported,)):  # building a --kernel imports the user's module
                        backends[spec.name] = build(spec)
                except Unsupported as exc:
                    backends[spec.name] = exc
            backend = backends[spec.name]
            if isinstance(backend, Unsupported):
                reply({"id": job_id, "status": "skip", "reason": str(backend)})
                continue
            outcome = run_probe(backend, coords, caches,
                                progress=lambda text: reply({"id": job_id, "progress": text}),
                                repeats=request.get("repeats", 1))
            if device.type == "cuda":  # what the probe held at its peak: the plan's estimate of it, measured
                outcome.extra["allocator_peak_bytes"] = torch.cuda.max_memory_reserved(device)
            reply({"id": job_id, **outcome.to_dict()})
        except Exception as exc:  # noqa: BLE001 - a failing kernel is an ERROR row, never a dead tool
            cause = exc.cause if isinstance(exc, (KernelError, InternalError)) else exc
            if is_out_of_memory(cause):
                reply({"id": job_id, "status": "oom", "reason": first_line(cause), **held_memory(cause, device)})
                del exc, cause
                caches.clear()
                free_memory(device)
                continue
            fatal = is_cuda_fault(cause)
            internal = not isinstance(exc, KernelError) and not fatal
            reply({
                "id": job_id,
                "status": "error",
                "reason": first_line(cause),
                "detail": "".join(traceback.format_exception(cause, limit=8)),
                "fatal": fatal,
                "internal": internal,
            })
            if fatal:
                return 3
        finally:
            caches.share(None)
            if request.get("release") and device.type == "cuda":
                torch.cuda.empty_cache()  # the families take turns: the next one's turn needs this memory
    return 0


_cap: list = [None]  # the cap this process's allocator is held to now


def hold_to(cap: int | None, device) -> None:
    """Hold this process's CUDA allocator to `cap` bytes (None: the whole card), as torch's per-process memory
    fraction does: an allocation beyond it frees cached blocks, then raises OutOfMemoryError."""
    if device.type != "cuda" or cap == _cap[0]:
        return
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if cap is None else min(1.0, cap / total), index)
    _cap[0] = cap


_TRIED = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def held_memory(cause: BaseException, device) -> dict:
    """The allocation that failed ("tried", as torch's message says) and on a GPU what the allocator held when it
    ran out ("reserved")."""
    found = _TRIED.search(str(cause))
    held = {"tried": int(float(found.group(1)) * _UNIT[found.group(2)]) if found else 0}
    if device.type == "cuda":
        import torch

        held["reserved"] = torch.cuda.memory_reserved(device)
    return held


def free_memory(device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


# A folder to write each worker's cProfile into (worker-FAMILY-PID.prof): where a worker's time goes, imports
# included (a forked worker's imports are its fork server's: not in its profile), for the benchmarks
# (benchmarks/h100/cold-sweep.sh with PROFILE=1); unset, nothing is profiled.
PROFILE_DIR = "ATTN_DOCTOR_PROFILE_DIR"


def profiled(family: str, run: Callable[[], int]) -> int:
    """`run()`, under cProfile when PROFILE_DIR is set (the profile written however the worker ends)."""
    folder = os.environ.get(PROFILE_DIR)
    if not folder:
        return run()
    import cProfile

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        return run()
    finally:
        profiler.disable()
        os.makedirs(folder, exist_ok=True)
        profiler.dump_stats(os.path.join(folder, f"worker-{family}-{os.getpid()}.prof"))


if __name__ == "__main__":
    sys.exit(profiled(sys.argv[1], lambda: main(sys.argv[1:])))
