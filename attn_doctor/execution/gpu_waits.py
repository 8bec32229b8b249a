"""How a process waits for its GPU: spinning on a core (CUDA's default for a process with one context) or asleep
until the GPU signals (`ATTN_DOCTOR_GPU_WAIT=block`).

A sweep runs a dozen processes on one GPU and a 16-core host. Each waits for the GPU at every synchronisation, and
spinning, each holds a core meanwhile: the cores the driver's just-in-time compiler needs in the other processes
(cuDNN's runtime-compiled kernels, about a second each on a cold machine). Set before the process's CUDA context
exists, through the driver's primary-context flags, which every CUDA runtime in the process shares."""

from __future__ import annotations

import ctypes
import os

WAIT_VARIABLE = "ATTN_DOCTOR_GPU_WAIT"
CU_CTX_SCHED_BLOCKING_SYNC = 0x04  # cuda.h: the host thread sleeps on a synchronisation primitive


def wanted() -> str:
    """"block" or "spin" (CUDA's own choice, nothing set), from the environment."""
    return "block" if os.environ.get(WAIT_VARIABLE, "").strip().lower() == "block" else "spin"


def apply(device_index: int) -> str:
    """Set the waits `wanted` for the device's primary context, before anything makes it; what was set, or why not
    (a process whose waits cannot be set still runs, as CUDA's default has it)."""
    if wanted() != "block":
        return "spin"
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        device = ctypes.c_int()
        for step in (lambda: driver.cuInit(0), lambda: driver.cuDeviceGet(ctypes.byref(device), device_index),
                     lambda: driver.cuDevicePrimaryCtxSetFlags(device, CU_CTX_SCHED_BLOCKING_SYNC)):
            status = step()
            if status != 0:
                return f"spin (the driver answered {status})"
    except (OSError, AttributeError) as exc:
        return f"spin ({exc})"
    return "block"
