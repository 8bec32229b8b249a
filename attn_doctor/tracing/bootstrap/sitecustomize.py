"""Started by `attn-doctor capture -- <command>` in every Python process of the command (this folder is put
first on PYTHONPATH): starts the capture, then hands over to the environment's own sitecustomize, if any."""

import importlib
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
try:
    from attn_doctor.tracing.record import start_from_environment

    start_from_environment()
except Exception as exc:  # noqa: BLE001 - never break the user's program
    sys.stderr.write(f"attn-doctor capture: not started in this process ({type(exc).__name__}: {exc})\n")

_mine = sys.modules.pop("sitecustomize", None)
_path = sys.path[:]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
try:
    importlib.import_module("sitecustomize")  # the environment's own, when there is one
except ImportError:
    if _mine is not None:
        sys.modules["sitecustomize"] = _mine
finally:
    sys.path[:] = _path
