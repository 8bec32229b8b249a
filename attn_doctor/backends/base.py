"""The one small interface every attention implementation sits behind: TE paths, PyTorch SDPA kernels,
Megatron's local attention and a user's own kernel are all a `Backend`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from attn_doctor.core.case import Case


class Unsupported(Exception):
    """The kernel path refuses this case here (a SKIP row with this reason), as opposed to crashing."""


@dataclass(frozen=True)
class BackendSpec:
    """What travels to a worker process to build a backend there."""

    name: str  # the row's name, e.g. "te.fused", "sdpa.flash", "local", "my_kernel"
    family: str  # the worker that runs it: "te", "sdpa", "local", "kernel"
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BackendSpec":
        return cls(d["name"], d["family"], dict(d.get("options", {})))


class Backend(ABC):
    """An attention forward whose backward comes from autograd.

    `forward` receives q [.., heads, d] and k, v [.., kv_heads, d] in `qkv_format` ("bshd" or "sbhd"),
    possibly as non-contiguous views, and returns out [.., heads, d] in the same format.
    """

    qkv_format: str = "bshd"

    def __init__(self, spec: BackendSpec):
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    def unsupported(self, case: Case, device: torch.device) -> str | None:
        """A reason this backend cannot run `case` on `device`, known without running it."""
        return None

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case) -> torch.Tensor: ...

    def ran(self, out: torch.Tensor) -> str:
        """What really ran for the last forward, read from the library's own state where it has one."""
        return self.name
