"""How much memory is free where the probes will run, read without holding any: NVML for a GPU (it makes no CUDA
context, so the reading can be taken before any process of attn-doctor's holds device memory), /proc/meminfo for
the RAM. Facts that never raise: None where they cannot be known."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MemoryReading:
    free: int  # bytes
    total: int
    where: str  # "cuda:0", "RAM"

    @property
    def on_gpu(self) -> bool:
        return self.where.startswith("cuda")


def read_free(device_name: str) -> MemoryReading | None:
    """What is free on `device_name` ("auto", "cpu", "cuda", "cuda:N") now. "auto" reads the first GPU where the
    machine has an NVIDIA driver, else the RAM (as `attn_doctor.machine.devices.resolve_device` will choose)."""
    if device_name == "cpu" or (device_name == "auto" and not os.path.exists("/dev/nvidiactl")):
        return read_ram()
    index = int(device_name.split(":")[1]) if ":" in device_name else 0
    return _read_nvml(index) or _read_torch(index)


def read_ram() -> MemoryReading | None:
    """MemAvailable (what the kernel can give without swapping) and MemTotal."""
    try:
        fields = {}
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            fields[name] = int(value.split()[0]) * 1024
        return MemoryReading(fields["MemAvailable"], fields["MemTotal"], "RAM")
    except (OSError, ValueError, IndexError, KeyError):
        pass
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return MemoryReading(os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page, "RAM")
    except (ValueError, OSError, AttributeError):
        return None


def _visible(index: int) -> str | None:
    """The NVML name of CUDA's device `index`: its index or UUID as CUDA_VISIBLE_DEVICES maps it (NVML ignores that
    variable); None where the mapping is not one NVML can follow (MIG instances)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if index >= len(entries) or entries[index].startswith("MIG"):
        return None
    return entries[index]


def _read_nvml(index: int) -> MemoryReading | None:
    name = _visible(index)
    if name is None:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            if name.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(name))
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(name)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            return MemoryReading(int(info.free), int(info.total), f"cuda:{index}")
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML, no driver, no such device: another way or none
        return None


def _read_torch(index: int) -> MemoryReading | None:
    """torch's reading, where NVML has none (it makes this process's CUDA context first)."""
    try:
        import torch

        free, total = torch.cuda.mem_get_info(index)
        return MemoryReading(int(free), int(total), f"cuda:{index}")
    except Exception:  # noqa: BLE001 - no GPU: nothing to read
        return None
