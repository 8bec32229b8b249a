"""A user's own attention kernel, `--kernel [NAME=]TARGET:FUNC`.

FUNC is `fn(q, k, v, *, causal: bool, softmax_scale: float, **more) -> out` on bshd tensors
(q [batch, seq_q, heads, dim], k and v [batch, seq_kv, kv_heads, dim or head_dim_v]); gradients come
from autograd. TARGET is an importable module or a path to a .py file.

The rest of TE's API reaches the kernel through these keywords, each passed only when FUNC accepts it (by
name, or through **kwargs), so kernels written for the first signature keep working:

  allowed          bool [batch or 1, 1, seq_q, seq_kv], True = the query sees the key: every mask type,
                   padding, sliding window and explicit mask in one (None: all visible). Required for any
                   case that `causal` cannot describe (padding, windows, an explicit mask, a bottom-right
                   diagonal with seq_q != seq_kv); a kernel without it is SKIP on those.
  bias             broadcastable to [batch, heads, seq_q, seq_kv], added to the scaled scores (post_scale_bias,
                   ALiBi materialised; None without). Required for cases with a bias.
  softmax_offset   float32 [heads]: sink logits (softmax type off-by-one: zeros; learnable: requires grad,
                   its gradient is judged as dsink). Required for cases with a sink.
  seqlens_q, seqlens_kv   int32 [batch], each sequence's length (padding masks; None otherwise)
  mask_type, window       TE's attn_mask_type and window_size, for information
  return_max_logit True when the case asks for the max logit (`--max-logit`, TE's return_max_logit): the kernel
                   then returns (out, max_logit [heads]), judged against float64 like out. A kernel without
                   the keyword is judged on its other tensors.

A kernel whose backward takes the softmax backward's D = rowsum(dO * O) from the output it returned, as
FlashAttention's does, says so next to its definition, `FUNC.flash_style = True` at the top level of its file:
its dQ and dK are then judged with what such a backward's own rounding makes (`attn_doctor.verdict.rule`,
"Flash-style paths"). Read from the source without importing it, like the keywords.

`causal` is True for every causal mask type (its diagonal is in `allowed`). Sequences of a thd case arrive
padded (bshd), the lengths in `seqlens_q` / `seqlens_kv`; the padded rows' output is not compared.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from attn_doctor.backends.base import Backend, BackendSpec, ShortCall, Unsupported, short_mask_code
from attn_doctor.core.case import Case
from attn_doctor.core.errors import BadInput
from attn_doctor.core.paths import check_input
from attn_doctor.numerics.masks import Semantics
from attn_doctor.numerics.standalone import kernel_keywords, needs_mask


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
    options = {"target": target, "func": func}
    keywords = _keywords_in_source(origin, func) if origin is not None else None
    if keywords is not None:  # known before any worker starts: cases the signature cannot take are SKIP at once
        options["keywords"] = sorted(keywords)
    if origin is not None and _declares_flash_style(origin, func):
        options["flash_style"] = True
    return BackendSpec(name or func, "kernel", options)


def _target_source(target: str) -> Path | None:
    if target.endswith(".py"):
        path = Path(target)
        check_input(path, "--kernel", "file")
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


def _keywords_in_source(path: Path, name: str) -> set[str] | None:
    """The keyword names a top-level `def name` in the file takes ("**" with **kwargs); None when it is not a
    plain function there (an assignment, an import, a class: known only once imported)."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, OSError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            names = {a.arg for a in node.args.args + node.args.kwonlyargs}
            return names | ({"**"} if node.args.kwarg is not None else set())
    return None


def _declares_flash_style(path: Path, name: str) -> bool:
    """Whether the file says, at its top level, `name.flash_style = True` (see the module docstring)."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (SyntaxError, OSError, UnicodeDecodeError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and node.value.value is True:
            if any(isinstance(t, ast.Attribute) and t.attr == "flash_style" and isinstance(t.value, ast.Name)
                   and t.value.id == name for t in node.targets):
                return True
    return False


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


def required_keywords(case: Case) -> list[str]:
    """The keywords a kernel must take to be given this case."""
    return ((["allowed"] if needs_mask(case.plain()) else []) + (["bias"] if case.bias != "no_bias" else [])
            + (["softmax_offset"] if case.softmax != "vanilla" else []))


def missing_keyword(func: str, keywords: set[str], required: list[str]) -> str | None:
    """Why a kernel taking `keywords` cannot be given a case that needs `required`, or None."""
    missing = [name for name in required if name not in keywords and "**" not in keywords]
    if not missing:
        return None
    return (f"this case needs the --kernel keyword{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
            f"(see attn-doctor's --kernel convention); {func} does not take {'them' if len(missing) > 1 else 'it'}")


def accepted_keywords(fn: Callable) -> set[str]:
    """The keyword names fn takes ("**" when it takes any)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: only the first convention
        return set()
    names = {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        names.add("**")
    return names


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
import inspect  # noqa: E402

TARGET, FUNC = {target!r}, {func!r}
if TARGET.endswith(".py"):
    spec = importlib.util.spec_from_file_location("user_kernel", TARGET)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
else:
    module = importlib.import_module(TARGET)


def kernel(q, k, v, case):
    """The user's kernel with attn-doctor's --kernel keywords (kernel_keywords), each passed only when it takes it."""
    fn = getattr(module, FUNC)
    taken = {{p.name for p in inspect.signature(fn).parameters.values()}}
    anything = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    offered = kernel_keywords(case, EXPLICIT, BIAS, case["sink"], q.dtype, DEVICE)
    extra = {{name: value for name, value in offered.items() if anything or name in taken}}
    return fn(q, k, v, causal="causal" in case["mask"], softmax_scale=case["scale"], **extra)
'''


class UserKernel(Backend):
    family = "kernel"
    qkv_format = "bshd"
    required_options = ("target", "func")
    cp_method = "queries at their global positions in a zero-padded sequence (the --kernel signature has no mask)"

    @classmethod
    def static_skip(cls, spec: BackendSpec, case: Case, device: str) -> str | None:
        if case.fp8 != "none":
            return "--kernel paths take the inputs' dtype; FP8 attention is TE's (--fp8)"
        keywords = spec.options.get("keywords")
        if keywords is not None:
            return missing_keyword(spec.options["func"], set(keywords), required_keywords(case))
        return None

    @classmethod
    def flash_style(cls, spec: BackendSpec) -> bool:
        return bool(spec.options.get("flash_style"))

    @classmethod
    def selector(cls, spec: BackendSpec) -> str:
        target, func = spec.options.get("target"), spec.options.get("func")
        return f"--kernel {shlex.quote(f'{spec.name}={target}:{func}')}"

    @classmethod
    def repro_source(cls, spec: BackendSpec) -> str:
        return REPRO_SOURCE.format(target=spec.options["target"], func=spec.options["func"])

    @classmethod
    def short_call(cls, spec: BackendSpec, case: Case) -> ShortCall:
        from attn_doctor.numerics.standalone import draw_side_inputs

        plain = case.plain()
        target, func = spec.options["target"], spec.options["func"]
        load = ("FN = runpy.run_path(TARGET)[FUNC]  # the file run as a module, as attn-doctor loads it\n"
                if target.endswith(".py") else "FN = getattr(importlib.import_module(TARGET), FUNC)\n")
        # The keywords attn-doctor offers (kernel_keywords), each as the script's name for its value
        explicit, bias, sink = draw_side_inputs(plain, "cpu")
        code = {"allowed": short_mask_code(plain), "bias": "BIAS.to(DTYPE)", "softmax_offset": "SINK",
                "seqlens_q": "torch.tensor(LENS_Q, dtype=torch.int32, device=DEVICE)",
                "seqlens_kv": "torch.tensor(LENS_KV, dtype=torch.int32, device=DEVICE)"}
        offered = {name: code[name] if name in code and value is not None else repr(value)
                   for name, value in kernel_keywords(plain, explicit, bias, sink, torch.float32, "cpu").items()}
        from attn_doctor.core.source_text import call_lines

        keywords = call_lines("    offered = dict(", [f"{name}={code}" for name, code in offered.items()])
        return ShortCall("bshd", ("import runpy\n" if target.endswith(".py") else
                                  "import importlib\n") + "import inspect\n\n"
                                 f"TARGET, FUNC = {target!r}, {func!r}  # the --kernel\n" + load, f'''

def kernel(q, k, v):
    """The --kernel function, given attn-doctor's keywords (each only if it takes it, by name or **kwargs)."""
{keywords}    taken = inspect.signature(FN).parameters
    extra = {{n: x for n, x in offered.items() if n in taken or any(p.kind is p.VAR_KEYWORD for p in taken.values())}}
    return FN(q, k, v, causal={case.causal}, softmax_scale=SCALE, **extra)
''')

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        self.fn = load_function(spec.options["target"], spec.options["func"])
        self.keywords = accepted_keywords(self.fn)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case,
                semantics: Semantics | None = None) -> torch.Tensor:
        why_not = missing_keyword(self.spec.options["func"], self.keywords, required_keywords(case))
        if why_not:
            raise Unsupported(why_not)
        semantics = semantics or Semantics(case)
        offered = kernel_keywords(case.plain(), semantics.allowed, semantics.bias, semantics.sink, q.dtype, q.device)
        extra = {name: value for name, value in offered.items() if name in self.keywords or "**" in self.keywords}
        self._max_logit = None
        if case.return_max_logit and "return_max_logit" in self.keywords:
            out, self._max_logit = self.fn(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale,
                                           return_max_logit=True, **extra)
            return out
        return self.fn(q, k, v, causal=case.causal, softmax_scale=case.softmax_scale, **extra)

    def max_logit(self) -> torch.Tensor | None:
        return getattr(self, "_max_logit", None)

    def ran(self, out: torch.Tensor) -> str:
        return f"{self.spec.options['target']}:{self.spec.options['func']}"
