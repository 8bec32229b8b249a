"""Registry of backends: which rows exist, which worker family runs each, and how a worker builds one."""

from __future__ import annotations

import importlib.util

from attn_doctor.backends.base import Backend, BackendSpec, Unsupported
from attn_doctor.core.errors import BadInput

BASELINE = "local"
SDPA_NAMES = ("sdpa.flash", "sdpa.efficient", "sdpa.cudnn", "sdpa.math")


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def builtin_specs() -> list[BackendSpec]:
    """Every built-in row, in table order: TE paths, PyTorch SDPA kernels, then the local baseline."""
    from attn_doctor.backends.te import te_paths

    specs = [BackendSpec(name, "te", options) for name, options in te_paths()]
    specs += [BackendSpec(name, "sdpa", {"kernel": name.split(".", 1)[1]}) for name in SDPA_NAMES]
    specs.append(BackendSpec(BASELINE, "local"))
    return specs


def resolve(names: list[str]) -> list[BackendSpec]:
    """Specs for the names given with --backend (all built-ins when none), refusing unknown names."""
    known = {spec.name: spec for spec in builtin_specs()}
    if not names:
        return list(known.values())
    chosen = []
    for name in names:
        if name in ("te", "sdpa"):
            chosen += [spec for spec in known.values() if spec.family == name]
        elif name in known:
            chosen.append(known[name])
        else:
            raise BadInput(
                f"unknown backend {name!r}; choose from {', '.join(known)} (or 'te', 'sdpa'), "
                "or pass your own with --kernel"
            )
    return list({spec.name: spec for spec in chosen}.values())


def build(spec: BackendSpec) -> Backend:
    """Instantiate a backend inside a worker process (imports happen here, not in the CLI)."""
    if spec.family == "local":
        from attn_doctor.backends.local import LocalAttention

        return LocalAttention(spec)
    if spec.family == "sdpa":
        from attn_doctor.backends.sdpa import SdpaKernel

        return SdpaKernel(spec)
    if spec.family == "te":
        from attn_doctor.backends.te import TEAttention

        return TEAttention(spec)
    if spec.family == "kernel":
        from attn_doctor.backends.kernel import UserKernel

        return UserKernel(spec)
    raise ValueError(f"unknown backend family {spec.family!r}")


__all__ = ["Backend", "BackendSpec", "Unsupported", "BASELINE", "builtin_specs", "resolve", "build", "te_installed"]
