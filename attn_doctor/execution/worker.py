"""The worker process: serves one backend family's probes, one JSON line in, one JSON line out.

Run as `python -m attn_doctor.execution.worker FAMILY DEVICE`. It prepares the family's library first
(TE must load before anything touches torch's cuDNN), answers {"hello": ...}, then one reply per request
({"op": "run", "coords": ..., "reference": ..., "repeats": N}),
with {"progress": "..."} lines while a long probe advances. Replies go to a private copy of the original
stdout; fd 1 is pointed at stderr so that whatever a library prints cannot corrupt the protocol. A CUDA
error may leave the context unusable, so after one the worker replies with "fatal": true and exits; the
parent starts a new one.

Errors are attributed: what the kernel under test raised is an "error" reply naming the kernel; anything
else that fails here is attn-doctor's own ("internal": true), never blamed on the kernel.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _protocol_stream():
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def main(argv: list[str]) -> int:
    family, device_name = argv[0], argv[1]
    out = _protocol_stream()

    def reply(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    from attn_doctor.machine.cudnn_builds import torch_preloads_wanted_build

    with torch_preloads_wanted_build():  # a cuDNN build asked for: torch preloads it, not pip's
        import torch  # noqa: F401 - first here, under the context
    from attn_doctor.backends import prepare_process

    hello: dict = {"family": family, "pid": os.getpid(), **prepare_process(family)}

    import torch

    from attn_doctor.backends import Unsupported, build
    from attn_doctor.core.coords import Coords
    from attn_doctor.core.errors import KernelError, first_line, is_cuda_fault, kernel_code
    from attn_doctor.execution.shared_reference import open_tensors
    from attn_doctor.probes import Caches, run_probe
    from attn_doctor.tracing.replay_source import source_of

    device = torch.device(device_name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # TE builds its modules and workspaces on the current device
    caches = Caches(device, source_of)
    backends: dict[str, object] = {}
    reply({"hello": hello})

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
            reply({"id": job_id, **outcome.to_dict()})
        except Exception as exc:  # noqa: BLE001 - a failing kernel is an ERROR row, never a dead tool
            cause = exc.cause if isinstance(exc, KernelError) else exc
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
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
