"""The worker process: serves one backend family's probes, one JSON line in, one JSON line out.

Run as `python -m attn_doctor.execution.worker FAMILY DEVICE`. It answers {"hello": ...} once set up, then one
reply per request. Replies go to a private copy of the original stdout; fd 1 is pointed at stderr so
that whatever a library prints cannot corrupt the protocol. A CUDA error may leave the context
unusable, so after one the worker replies with "fatal": true and exits; the parent starts a new one.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from attn_doctor.core.errors import first_line


def _protocol_stream():
    stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return stream


def _is_cuda_fault(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("CUDA error", "AcceleratorError", "illegal memory access", "CUBLAS_STATUS", "cudaError"))


def main(argv: list[str]) -> int:
    family, device_name = argv[0], argv[1]
    out = _protocol_stream()

    def reply(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    hello: dict = {"family": family, "pid": os.getpid()}
    if family == "te":
        # TE must be imported before anything loads torch's cuDNN (see backends/te.py).
        try:
            from attn_doctor.backends.te import load_te

            load_te()
        except Exception as exc:  # noqa: BLE001 - any import failure becomes the rows' SKIP reason
            hello["import_error"] = first_line(exc)
        from attn_doctor.machine.te_probe import probe_loaded_te

        hello["te_facts"] = probe_loaded_te()

    import torch

    from attn_doctor.backends import BackendSpec, build
    from attn_doctor.core.case import Case
    from attn_doctor.probes.run import CaseCache, DepthCache, run_depth_probe, run_probe, run_tp_probe
    from attn_doctor.execution.shared_reference import open_tensors

    device = torch.device(device_name)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # TE builds its modules and workspaces on the current device
    cache = CaseCache(device)
    depth_cache = DepthCache(device)
    backends: dict[str, object] = {}
    reply({"hello": hello})

    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "quit":
            cache.clear()  # release the parent's shared tensors before exiting, not during interpreter teardown
            depth_cache.clear()
            return 0
        job_id = request["id"]
        spec = BackendSpec.from_dict(request["backend"])
        # Opened whatever the job turns out to need: a handle's reference count comes back only when what
        # it opened is freed (see shared_reference). The caches keep what they use; the rest is freed after the job.
        cache.shared = depth_cache.shared = open_tensors(request.get("reference"))
        try:
            if "import_error" in hello:
                reply({"id": job_id, "status": "skip", "reason": f"transformer_engine not importable: {hello['import_error']}"})
                continue
            if spec.name not in backends:
                backends[spec.name] = build(spec)
            case = Case.from_dict(request["case"])
            backend, kind, params = backends[spec.name], request.get("kind", "layout"), request.get("params", {})
            if kind == "depth":
                outcome = run_depth_probe(backend, case, params["layers"], params.get("tp", 1), depth_cache)
            elif kind == "tp":
                outcome = run_tp_probe(backend, case, params["tp"], params["shards_as"], cache)
            else:
                outcome = run_probe(backend, case, request["layout"], cache)
            if outcome.status == "ok":
                source = depth_cache if kind == "depth" else cache
                outcome.extra["reference"] = source.reference_source
            reply({"id": job_id, **outcome.to_dict()})
        except Exception as exc:  # noqa: BLE001 - a failing kernel is an ERROR row, never a dead tool
            fatal = _is_cuda_fault(exc)
            reply({
                "id": job_id,
                "status": "error",
                "reason": first_line(exc),
                "detail": traceback.format_exc(limit=8),
                "fatal": fatal,
            })
            if fatal:
                return 3
        finally:
            cache.shared = depth_cache.shared = None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
