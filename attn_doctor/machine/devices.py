"""Which device a command runs on: `auto`, `cpu`, `cuda` or `cuda:N`, checked against what torch sees."""

from __future__ import annotations

import re

from attn_doctor.core.errors import BadInput

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> str:
    """Refuse a device name attn-doctor does not know, before torch is imported."""
    if not DEVICE_PATTERN.fullmatch(name):
        raise BadInput(f"--device {name!r}: choose auto, cpu, cuda or cuda:N")
    return name


def resolve_device(name: str) -> str:
    """The device to run on: `auto` picks CUDA when torch sees a GPU; a CUDA device torch cannot see is refused."""
    import torch

    check_device_name(name)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInput(f"--device {name}: torch sees no CUDA GPU here; use --device cpu or auto")
        index = int(name.split(":")[1]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise BadInput(f"--device {name}: torch sees {torch.cuda.device_count()} CUDA device(s) "
                           f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return name
