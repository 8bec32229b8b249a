"""The memory budget: bytes all of a command's processes may hold together. --max-memory where given, else what
was free where the probes run when the command started, less a margin (`MARGIN_FRACTION`, `MARGIN_MIN`): beside a
training job that holds most of a card, the job's memory is not ours. How a request runs within it is
`attn_doctor.execution.memory_plan`'s. Nothing here imports torch: a command reads what is free before it starts
any process (`MemoryAsk`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attn_doctor.machine.memory import MemoryReading, read_free

GIB = 1 << 30
MIB = 1 << 20

# Left of what is free when attn-doctor starts, for what it does not plan (its own host process's growth, another
# job's next allocation): the larger of these.
MARGIN_FRACTION, MARGIN_MIN = 0.05, 512 * MIB


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes all of a command's processes may hold together, where, and how that was decided."""

    bytes: int
    where: str  # "cuda:0", "RAM"
    source: str  # "--max-memory 24.0 GiB" or "75.2 GiB free on cuda:0 at the start, less a margin"
    device_total: int | None = None  # the card's size (caps are fractions of it); None for the RAM

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def resolve_budget(reading: MemoryReading | None, max_memory: int | None) -> MemoryBudget | None:
    """The budget from --max-memory (`max_memory`, bytes) and what was free at the start (`reading`); None where
    neither is known (nothing is then planned against). A --max-memory above what is free is held to what is free:
    memory another process holds cannot be ours."""
    if reading is None:
        if max_memory is None:
            return None
        return MemoryBudget(max_memory, "the device", f"--max-memory {size(max_memory)}")
    total = reading.total if reading.on_gpu else None
    usable = max(0, reading.free - max(MARGIN_MIN, int(reading.free * MARGIN_FRACTION)))
    if max_memory is None:
        return MemoryBudget(usable, reading.where, f"{size(reading.free)} free {_on(reading)} at the start, less a "
                                                   "margin", total)
    if max_memory > usable:
        return MemoryBudget(usable, reading.where, f"--max-memory {size(max_memory)}, held to the "
                                                   f"{size(usable)} free {_on(reading)} less a margin", total)
    return MemoryBudget(max_memory, reading.where, f"--max-memory {size(max_memory)}", total)


def _on(reading: MemoryReading) -> str:
    return f"on {reading.where}" if reading.on_gpu else "in RAM"


@dataclass(frozen=True)
class MemoryAsk:
    """What a command was given for its memory: --max-memory (bytes; None: not given) and what was free when it
    started, read before any process of attn-doctor's held memory (None: read when the plan is made)."""

    max_memory: int | None = None
    free_at_start: MemoryReading | None = None

    def budget(self, device: str) -> MemoryBudget | None:
        """The budget of a command running on `device` (resolved: "cpu", "cuda", "cuda:N")."""
        reading = self.free_at_start
        if reading is None or reading.on_gpu != device.startswith("cuda"):
            reading = read_free(device)
        return resolve_budget(reading, self.max_memory)


def size(n: float) -> str:
    for unit, scale in (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", GIB), ("MiB", MIB)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"
