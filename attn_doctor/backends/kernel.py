"""A user's own attention kernel, `--kernel [NAME=]TARGET:FUNC`.

FUNC is `fn(q, k, v, *, causal: bool, softmax_scale: float) -> out` on bshd tensors
(q [batch, seq_q, heads, dim], k and v [batch, seq_kv, kv_heads, dim]); gradients come from autograd.
TARGET is an importable module or a path to a .py file.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import shlex
import sys
from pathlib import Path
from typing import Callable

import torch

from attn_doctor.backends.base import Backend, BackendSpec
from attn_doctor.core.case import Case
from attn_doctor.core.errors import BadInput


def parse_kernel_spec(text: str) -> BackendSpec:
    """Check `[NAME=]TARGET:FUNC` without importing it (importing belongs in the worker)."""
    name, sep, rest = text.partition("=")
    if not sep or ":" in name or "/" in name:
        name, rest = "", text
    target, sep, func = rest.rpartition(":")
    if not sep or not target or not func.isidentifier():
        raise BadInput(f"--kernel {text!r}: expected [NAME=]TARGET:FUNC, e.g. mykernels.py:attention or pkg.mod:fn")
    origin = _target_source(target)
    if origin is not None and not _defines(origin, func):
        raise BadInput(f"--kernel {text!r}: {origin} defines no top-level {func!r}")
    path = Path(target)
    if target.endswith(".py"):
        target = str(path.resolve())
    return BackendSpec(name or func, "kernel", {"target": target, "func": func})


def _target_source(target: str) -> Path | None:
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise BadInput(f"--kernel: no file {target}; give an existing .py file or an importable module")
        return path
    try:
        spec = importlib.util.find_spec(target)
    except (ImportError, ValueError) as exc:
        raise BadInput(f"--kernel: cannot find module {target!r} ({exc}); is it on PYTHONPATH?") from None
    if spec is None:
        raise BadInput(f"--kernel: no module {target!r} on the Python path; pass a .py path or fix PYTHONPATH")
    if spec.origin and spec.origin.endswith(".py"):
        return Path(spec.origin)
    return None  # compiled or namespace module: checked when the worker imports it


def _defines(path: Path, name: str) -> bool:
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"--kernel: cannot read {path}: {exc}") from None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((alias.asname or alias.name.split(".")[0]) == name for alias in node.names):
                return True
    return False


def load_function(target: str, func: str) -> Callable:
    if target.endswith(".py"):
        module_name = f"attn_doctor_user_kernel_{abs(hash(target))}"
        spec = importlib.util.spec_from_file_location(module_name, target)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, func)


REPRO_SOURCE = '''

FORMAT = "bshd"
import importlib  # noqa: E402
import importlib.util  # noqa: E402

TARGET, FUNC = {target!r}, {func!r}
if TARGET.endswith(".py"):
    spec = importlib.util.spec_from_file_location("user_kernel", TARGET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
else:
    module = importlib.import_module(TARGET)


def kernel(q, k, v, case):
    return getattr(module, FUNC)(q, k, v, causal=case["mask"] == "causal", softmax_scale=case["head_dim"] ** -0.5)
'''


class UserKernel(Backend):
    family = "kernel"
    qkv_format = "bshd"
    cp_method = "queries at their global positions in a zero-padded sequence (the --kernel signature has no mask)"

    @classmethod
    def static_skip(cls, spec: BackendSpec, case: Case, device: str) -> str | None:
        if case.window is not None:
            return "the --kernel signature fn(q, k, v, *, causal, softmax_scale) has no sliding-window argument"
        return None

    @classmethod
    def selector(cls, spec: BackendSpec) -> str:
        target, func = spec.options.get("target"), spec.options.get("func")
        return f"--kernel {shlex.quote(f'{spec.name}={target}:{func}')}"

    @classmethod
    def repro_source(cls, spec: BackendSpec) -> str:
        return REPRO_SOURCE.format(target=spec.options["target"], func=spec.options["func"])

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        self.fn = load_function(spec.options["target"], spec.options["func"])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case) -> torch.Tensor:
        return self.fn(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale)

    def ran(self, out: torch.Tensor) -> str:
        return f"{self.spec.options['target']}:{self.spec.options['func']}"
