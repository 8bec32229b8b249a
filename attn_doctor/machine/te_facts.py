"""What Transformer Engine is: its versions and the cuDNN that TE itself loaded, read in a process of its own.

Run as ``python -m attn_doctor.machine.te_facts`` in a fresh process (importing TE can fail,
or poison a process that already loaded another cuDNN); it prints one JSON object on
its last stdout line. A worker that already imported TE can call
:func:`loaded_te_facts` in-process instead.

This module imports only the standard library (and attn-doctor modules that do) at import time, and never touches
torch's cuDNN: TE must be the first to load a cuDNN in the process that reads it.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import sys
import warnings

from attn_doctor.core.errors import first_line
from attn_doctor.machine.cudnn_builds import decode_cudnn_version, loaded_libraries

TE_FACT_KEYS = ("te", "te_core", "te_torch", "te_cudnn", "te_cudnn_int", "te_cudnn_libraries", "error")

_CORE_RE = re.compile(r"^transformer-engine-cu\d+$")


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def dist_version(*names: str) -> str | None:
    """Version of the first installed distribution among ``names``, else None."""
    for name in names:
        try:
            return md.version(name)
        except Exception:  # PackageNotFoundError, or broken metadata
            continue
    return None


def te_core_version() -> str | None:
    """``"transformer-engine-cu13 2.20.2"`` for the installed core wheel(s), else None."""
    found: set[str] = set()
    try:
        for dist in md.distributions():
            try:
                name = dist.metadata["Name"]
            except Exception:
                continue
            if name and _CORE_RE.match(_normalize(name)):
                found.add(f"{_normalize(name)} {dist.version}")
    except Exception:
        return None
    # More than one core wheel (cu12 and cu13) is itself worth seeing, so list all.
    return ", ".join(sorted(found)) or None


def te_package_versions() -> dict[str, str | None]:
    """TE versions from package metadata only (no import)."""
    return {
        "te": dist_version("transformer-engine"),
        "te_core": te_core_version(),
        "te_torch": dist_version("transformer-engine-torch"),
    }


def loaded_te_facts() -> dict:
    """Import TE (or reuse the loaded one) and report its versions and cuDNN; never raises.

    Returns a dict with keys ``te``, ``te_core``, ``te_torch``, ``te_cudnn`` (str or
    None), ``te_cudnn_int`` (int or None) and ``error`` (first line of the import or
    query error, else None).
    """
    out: dict = dict.fromkeys(TE_FACT_KEYS)
    try:
        out.update(te_package_versions())
    except Exception as exc:
        out["error"] = first_line(exc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            import transformer_engine
            import transformer_engine.pytorch  # noqa: F401  (loads cuDNN and the extension)
            import transformer_engine_torch as tex
        except Exception as exc:
            out["error"] = first_line(exc)
            return out
        version = getattr(transformer_engine, "__version__", None)
        if version:
            out["te"] = str(version)
        torch_version = getattr(tex, "__version__", None)
        if torch_version and not out["te_torch"]:
            out["te_torch"] = str(torch_version)
        try:
            encoded = int(tex.get_cudnn_version())
            out["te_cudnn_int"] = encoded
            out["te_cudnn"] = decode_cudnn_version(encoded)
        except Exception as exc:
            out["error"] = first_line(exc)
    out["te_cudnn_libraries"] = loaded_libraries()  # which files: read back from this process's memory map
    return out


def _main() -> int:
    # Anything TE prints while loading (Python or C level) goes to stderr, so the JSON
    # object is the only thing on stdout.
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        try:
            facts = loaded_te_facts()
        except BaseException as exc:  # KeyboardInterrupt/SystemExit from a misbehaving import
            facts = dict.fromkeys(TE_FACT_KEYS)
            facts["error"] = first_line(exc)
        sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    sys.stdout.write(json.dumps(facts) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(_main())


def te_installed() -> bool:
    """Whether transformer_engine can be found (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):
        return False
