"""Recording the attention calls a model really makes: `attn-doctor capture -- <command>` and
`with attn_doctor.capture(DIR): ...`.

What is wrapped, for as long as the capture runs: `torch.nn.functional.scaled_dot_product_attention`, TE's
`DotProductAttention.forward`, flash-attn's `flash_attn_func` / `flash_attn_varlen_func`, Megatron-Core's own
core attention (`DotProductAttention.forward` of `megatron.core.transformer.dot_product_attention`) and the
forward of every module named with `modules` (`attn_doctor.tracing.clients`): each library when imported,
before or after the capture starts. Each call is passed through untouched (same arguments, same
tensors, no copy before the call, no synchronisation), so a capture never changes the numbers of the run it
observes. Its metadata is written at the call or when the model's forward pass ends (`Recorder._record`), into
`attn_doctor.tracing.store`'s files, as lines `attn_doctor.tracing.describe` makes (their repeating part once
per call signature): every tensor's shape, dtype, strides, storage offset and storage size (tensors sharing a
storage share its id, so packed q/k/v views replay as packed), the call's arguments (small integer tensors such
as cu_seqlens with their values), what TE chose (its backend, sub-backend and layout, read back from TE, and
TE's own reasons: the lines its debug log gives), FP8 state, the process rank and parallel sizes, the module
path and layer number, the forward-pass (step) number and the call's index; and, when the backward first
reaches a call site's output, its gradient's (dO's) geometry, through a tensor hook that returns nothing
(`Recorder._gradient_seen`; dO's layout is the model's: the gradient of `out.transpose(1, 2).reshape(...)` is a
view that is not contiguous). A call made inside another captured call (e.g. SDPA under a wrapper) is not
recorded twice.

Values (`values=True`) are recorded for the selected layers, steps and ranks only, within `max_bytes` per
process: q, k, v, out and the masks after the forward; the output gradient and dQ, dK, dV when the backward
reaches them (tensor hooks that return nothing, so no gradient changes). Nothing else is captured: no weights, no
model inputs, no other activations. Of the model itself, once, at the first call of its first forward pass, its
weights' fingerprint, run settings and a hash of its token ids (`Recorder._record_model`,
`attn_doctor.tracing.model_facts`), which `compare` reads first.

The layer is the first number in the module path (`decoder.layers.17.self_attention` -> 17: Megatron's and
Hugging Face's naming), else the call's position within its forward pass. The step counts forward passes of the
outermost module running at the first recorded call (the model), with a pre-hook on it alone (and a hook at its
end, which writes the calls deferred to it): no hook runs on the model's other modules. The module path is read
from the Python stack until the model is known; then a module of the model is named from the model's own names
(`Recorder._where`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib
import importlib.abc
import inspect
import json
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from attn_doctor.tracing import store
from attn_doctor.tracing.clients import MEGATRON_API, MEGATRON_LOCAL, ModuleSpec, megatron_settings, parse_module_spec
from attn_doctor.tracing.describe import CallDescriber, packed_source, selected_views, te_now

DEFAULT_MAX_BYTES = 256 * 2**20
ENV_OPTIONS = "ATTN_DOCTOR_CAPTURE"  # the options of `attn-doctor capture`, as JSON, for the child processes


@dataclass(frozen=True)
class Selection:
    """Which calls get their values recorded, and the budget for them."""

    values: bool = False
    layers: frozenset[int] | None = None
    steps: frozenset[int] | None = None
    ranks: frozenset[int] | None = None
    max_bytes: int = DEFAULT_MAX_BYTES

    def wants(self, layer: int | None, step: int, rank: int) -> bool:
        return self.values and all(chosen is None or value in chosen for chosen, value in (
            (self.layers, layer), (self.steps, step), (self.ranks, rank)))

    def to_dict(self) -> dict[str, Any]:
        return {"values": self.values, "max_bytes": self.max_bytes,
                **{name: sorted(getattr(self, name)) if getattr(self, name) is not None else None
                   for name in ("layers", "steps", "ranks")}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Selection":
        return cls(values=bool(d.get("values")), max_bytes=int(d.get("max_bytes", DEFAULT_MAX_BYTES)),
                   **{name: frozenset(d[name]) if d.get(name) is not None else None
                      for name in ("layers", "steps", "ranks")})


_parallel: dict[str, int] = {}
_parallel_said = 0  # how many times describe_parallel was called: a recorder reads the layout again after one


def describe_parallel(**sizes: int) -> None:
    """Tell the capture the parallel layout of this process when it cannot read it from Megatron, e.g.
    `describe_parallel(tp=2, tp_rank=1)` (also cp, cp_rank, dp, dp_rank)."""
    global _parallel_said
    _parallel.update(sizes)
    _parallel_said += 1


def _parallel_sizes() -> dict[str, int]:
    """TP/CP/DP sizes and ranks: what `describe_parallel` said, else Megatron's parallel_state if it is set up."""
    if _parallel:
        return dict(_parallel)
    state = sys.modules.get("megatron.core.parallel_state")
    try:
        if state is not None and state.model_parallel_is_initialized():
            return {"tp": state.get_tensor_model_parallel_world_size(),
                    "tp_rank": state.get_tensor_model_parallel_rank(),
                    "cp": state.get_context_parallel_world_size(), "cp_rank": state.get_context_parallel_rank(),
                    "dp": state.get_data_parallel_world_size(), "dp_rank": state.get_data_parallel_rank()}
    except Exception:  # noqa: BLE001 - a fact we could not read is absent, never a failed run
        pass
    return {}


def _rank_and_world() -> tuple[int, int]:
    """torch.distributed's rank and world size once its process group is up, torchrun's environment before."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _binder(function: Callable) -> Callable[[tuple, dict], dict[str, Any] | None]:
    """The arguments of a call by name, as the call passed them (defaults left out): positional ones zipped with
    the parameters' names, a tenth of what `inspect.Signature.bind` costs per call. None for a call that passes
    more positional arguments than the function names (the wrapper then passes it through unrecorded)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds]

    def bind(args: tuple, kwargs: dict) -> dict[str, Any] | None:
        return dict(zip(names, args)) | kwargs if len(args) <= len(names) else None

    return bind


class _Busy(threading.local):
    def __init__(self) -> None:
        self.busy = False  # inside a recorded call: calls it makes are not recorded again


# The frame every module call runs through (absent in a torch without it: no module path, no error).
_CALL_IMPL = getattr(getattr(torch.nn.Module, "_call_impl", None), "__code__", None)
# How far up from Recorder._where the code that called the attention function is: _where <- _record <- _call <-
# the wrapper <- its caller. The walk for the running modules starts there: the capture's own frames hold no
# module, and each frame walked through is a frame object made.
_CALLER = 4


def _module_calls(frame: Any) -> Iterator[tuple[torch.nn.Module, Any]]:
    """The modules whose forward is running in this thread, innermost first, each with its call frame: the `self`
    of each of nn.Module's call frames from `frame` up. Read only when a call is recorded, so that the model's
    other modules run without any hook of the capture (global module hooks cost every module call
    microseconds)."""
    while frame is not None and _CALL_IMPL is not None:
        if frame.f_code is _CALL_IMPL:
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module):
                yield module, frame
        frame = frame.f_back


def innermost_module(frame: Any) -> torch.nn.Module | None:
    """The innermost module whose forward is running in this thread."""
    return next((module for module, _ in _module_calls(frame)), None)


def _layer_of(path: str) -> int | None:
    """The first number in a module path (`decoder.layers.17.self_attention` -> 17)."""
    return next((int(part) for part in path.split(".") if part.isdigit()), None)


class _ImportHook(importlib.abc.MetaPathFinder):
    """Wraps a module's loader so that `patch(module)` runs right after the module is imported."""

    def __init__(self, targets: dict[str, Callable[[Any], None]]):
        self.targets = targets

    def find_spec(self, name, path, target=None):
        if name not in self.targets:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None and spec.loader is not None:
                loader, patch = spec.loader, self.targets[name]
                original = loader.exec_module

                def exec_module(module, _original=original, _patch=patch):
                    _original(module)
                    _patch(module)

                loader.exec_module = exec_module
                return spec
        return None


def _this_process() -> dict[str, Any]:
    return {"pid": os.getpid(), "started": datetime.datetime.now(datetime.timezone.utc).isoformat()}


_RUNNING: "weakref.WeakSet[Recorder]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for recorder in list(_RUNNING):
        recorder._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Recorder:
    """One process's capture: wraps the attention functions, tracks the module path, writes each call."""

    def __init__(self, root: Path, selection: Selection | None = None, modules: tuple[ModuleSpec, ...] = ()):
        self.root = Path(root)
        self.selection = selection or Selection()
        self.modules = tuple(modules)
        self._noted: set[tuple[str, str]] = set()  # (module, why) of the named modules' calls not recorded
        self.calls = 0
        self.value_bytes = 0
        self.seconds = 0.0  # spent in the capture's own code at the calls (not the calls, not the gradient hooks)
        self._thread = _Busy()
        self._names: dict[int, tuple[torch.nn.Module, dict[int, tuple[str, int | None]]]] = {}
        self._model: torch.nn.Module | None = None
        self._model_names: dict[int, tuple[str, int | None]] | None = None  # self._names' entry of the model
        self._step = 0
        self._ordinal = 0
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []
        self._log: store.CallLog | None = None
        self._describer = CallDescriber(_this_process())
        self._read: tuple[tuple[int, int], tuple[int, int, dict[str, int]]] | None = None  # what _layout read
        self._in_model = 0  # the model's forward passes running: its pre-hook counts them in, its hook out
        self._deferred: list[tuple] = []  # calls to describe when the model's forward pass ends (`_record`)
        self._dout_sites: set[tuple[str, int]] = set()  # (module path, signature) whose dO geometry is written

    # -- starting and stopping --

    def start(self) -> "Recorder":
        self.root.mkdir(parents=True, exist_ok=True)
        header = self.root / store.HEADER
        if not header.exists():
            store.write_json(header, {"format": store.FORMAT, "format_version": store.FORMAT_VERSION,
                                      "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                                      "selection": self.selection.to_dict(), "command": sys.argv})
        import torch.nn.functional as F

        self._wrap_attribute(F, "scaled_dot_product_attention", self._sdpa)
        targets = {"transformer_engine.pytorch": self._patch_te, "flash_attn": self._patch_flash,
                   MEGATRON_LOCAL: self._patch_megatron}
        for package in dict.fromkeys(spec.package for spec in self.modules):
            targets[package] = functools.partial(self._patch_named, package)
        for name, patch in list(targets.items()):
            if name in sys.modules:
                patch(sys.modules[name])
                del targets[name]
        if targets:
            hook = _ImportHook(targets)
            sys.meta_path.insert(0, hook)
            self._undo.append(lambda: sys.meta_path.remove(hook) if hook in sys.meta_path else None)
        _RUNNING.add(self)
        return self

    def stop(self) -> None:
        _RUNNING.discard(self)
        self._flush()
        while self._undo:
            self._undo.pop()()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _forked(self) -> None:
        """In a child process forked while this capture runs (e.g. a data loader's worker): its calls go to
        a calls file of its own. The parent's file, which the child inherited mapped, is never written or
        closed by the child."""
        self._lock = threading.Lock()  # another thread may have held it at the fork
        self._log = None
        self._deferred = []  # the parent's calls
        self._describer = CallDescriber(_this_process())
        self._dout_sites = set()  # the parent's signature numbers

    def _wrap_attribute(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        original = getattr(owner, name, None)
        if original is None or getattr(original, "_attn_doctor_original", None) is not None:
            return
        wrapped = make(original)
        wrapped._attn_doctor_original = original
        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, original))

    def _patch_te(self, te: Any) -> None:
        cls = getattr(te, "DotProductAttention", None)
        if cls is not None:
            self._wrap_attribute(cls, "forward", self._te_forward)

    def _patch_flash(self, flash: Any) -> None:
        for name in ("flash_attn_func", "flash_attn_varlen_func"):
            self._wrap_attribute(flash, name, functools.partial(self._generic, f"flash_attn.{name}"))

    def _patch_megatron(self, module: Any) -> None:
        cls = getattr(module, "DotProductAttention", None)
        if cls is not None:
            self._wrap_attribute(cls, "forward", self._megatron_forward)

    def _patch_named(self, package: str, module: Any) -> None:
        for spec in self.modules:
            cls = getattr(module, spec.class_name, None) if spec.package == package else None
            if isinstance(cls, type) and callable(getattr(cls, "forward", None)):
                self._wrap_attribute(cls, "forward", functools.partial(self._named_forward, spec))

    # -- where we are in the model --

    def _where(self, called: Any) -> tuple[str, int | None]:
        """The module path of the recorded call (the innermost running module, named from the outermost) and
        its layer. The first outermost module seen is the model: a pre-hook on it alone counts the steps. Once
        the model is known, a module of it is named without walking the whole stack (a fifth of a call's cost
        on the H200's host): a wrapped module's call (TE's, Megatron's, a named one) is that module, a
        function's the innermost running module."""
        if self._model_names is not None:
            inner = called if called is not None else innermost_module(sys._getframe(_CALLER))
            found = self._model_names.get(id(inner))
            if found is not None:
                return found
        self._read = None  # a call outside the model's forward: the rank and parallel layout are read again
        calls = list(_module_calls(sys._getframe(_CALLER)))[::-1]
        if not calls:
            return "", None
        stack = [module for module, _ in calls]
        outermost = stack[0]
        first = False
        with self._lock:
            if self._model is None:  # its first forward is running: step 0; the hook counts the next ones
                self._model = outermost
                self._undo.append(outermost.register_forward_pre_hook(self._next_step).remove)
                self._undo.append(outermost.register_forward_hook(self._forward_done, always_call=True).remove)
                first = True
            known = self._names.get(id(outermost))
            if known is None or known[0] is not outermost:
                known = self._names[id(outermost)] = (outermost, {
                    id(m): (name, _layer_of(name)) for name, m in outermost.named_modules()})
            if outermost is self._model:
                self._model_names = known[1]
        if first:
            self._record_model(outermost, calls[0][1].f_locals)
        return known[1].get(id(stack[-1]), (type(stack[-1]).__name__, None))

    def _record_model(self, model: torch.nn.Module, call: dict[str, Any]) -> None:
        """The model's facts (`attn_doctor.tracing.model_facts`: its weights' fingerprint, run settings, data),
        once, from its first forward pass's call (`call`: the locals of its module call, its args and kwargs)."""
        from attn_doctor.tracing.model_facts import model_facts

        try:
            rank, _, parallel = self._layout()
            facts = model_facts(model, tuple(call.get("args", ())), dict(call.get("kwargs", {})), rank, parallel)
            store.write_json(store.model_facts_path(self.root, rank, os.getpid()), facts)
        except Exception as exc:  # noqa: BLE001 - the capture must never break the user's run
            print(f"attn-doctor capture: the model's weights and settings not recorded ({type(exc).__name__}: "
                  f"{exc})", file=sys.stderr)

    def _next_step(self, module: torch.nn.Module, args: Any) -> None:
        with self._lock:
            self._step += 1
            self._ordinal = 0
            self._in_model += 1

    def _forward_done(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The model's forward pass returned or raised: its deferred calls are written now."""
        start = time.perf_counter()
        with self._lock:
            self._in_model = max(0, self._in_model - 1)  # its first pass ran before the pre-hook was set
            ended = self._in_model == 0
        if ended:
            self._flush()
        self.seconds += time.perf_counter() - start

    # -- the wrappers --

    def _sdpa(self, original: Callable) -> Callable:
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")

        @functools.wraps(original)
        def sdpa(*args, **kwargs):
            bound = dict(zip(names, args)) | kwargs
            return self._call("torch.sdpa", original, args, kwargs, bound, ("query", "key", "value"))

        return sdpa

    def _te_forward(self, original: Callable) -> Callable:
        return self._module_forward("te.DotProductAttention", original, ("query_layer", "key_layer", "value_layer"),
                                    te=True)

    def _megatron_forward(self, original: Callable) -> Callable:
        """Megatron-Core's local core attention: its q, k, v ([s, b, heads, dim]), mask, and what the module
        computes with them, read from the module at the call (`_megatron_arguments`)."""
        return self._module_forward(MEGATRON_API, original, ("query", "key", "value"), _megatron_arguments)

    def _module_forward(self, api: str, original: Callable, qkv: tuple[str, str, str],
                        describe: Callable[[Any, dict], None] | None = None, te: bool = False) -> Callable:
        """A module's forward, recorded as `api`: its arguments bound by name (self left out), and what
        `describe(module, bound)` adds to them."""
        bind = _binder(original)

        @functools.wraps(original)
        def forward(module, *args, **kwargs):
            bound = bind((module, *args), kwargs)
            if bound is None:
                return original(module, *args, **kwargs)
            bound.pop(next(iter(bound)), None)  # self
            if describe is not None:
                describe(module, bound)
            return self._call(api, original, (module, *args), kwargs, bound, qkv, te_module=module if te else None,
                              module=module)

        return forward

    def _named_forward(self, spec: ModuleSpec, original: Callable) -> Callable:
        """A module named with `--module`: q, k and v found by its mapping (`ModuleSpec.bind`); a call whose
        arguments the mapping does not find runs untouched and is noted once, with why."""
        kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        parameters = [p.name for p in inspect.signature(original).parameters.values() if p.kind in kinds][1:]

        @functools.wraps(original)
        def forward(module, *args, **kwargs):
            if self._thread.busy:
                return original(module, *args, **kwargs)
            try:
                found = spec.bind(parameters, args, kwargs)
            except ValueError as exc:
                self._note(spec.target, str(exc))
                return original(module, *args, **kwargs)
            bound = {name: value for name, value in zip(parameters, args)} | kwargs
            for name, value in found.items():  # q, k, v under their own names, each once
                bound = {key: other for key, other in bound.items() if other is not value}
                bound[name] = value
            bound["module"] = spec.recorded_settings()
            return self._call(spec.api, original, (module, *args), kwargs, bound, ("q", "k", "v"), module=module)

        return forward

    def _note(self, target: str, why: str) -> None:
        """Say once, in the capture folder, why a named module's call was not recorded (the CLI reads it)."""
        if (target, why) in self._noted:
            return
        self._noted.add((target, why))
        try:
            store.write_note(self.root, self._layout()[0], os.getpid(), {"module": target, "not_recorded": why})
        except Exception as exc:  # noqa: BLE001 - the capture must never break the user's run
            print(f"attn-doctor capture: {target}: {why} ({type(exc).__name__}: {exc})", file=sys.stderr)

    def _generic(self, api: str, original: Callable) -> Callable:
        bind = _binder(original)

        @functools.wraps(original)
        def call(*args, **kwargs):
            bound = bind(args, kwargs)
            if bound is None:
                return original(*args, **kwargs)
            return self._call(api, original, args, kwargs, bound, ("q", "k", "v"))

        return call

    def _call(self, api: str, original: Callable, args: tuple, kwargs: dict, bound: dict,
              qkv: tuple[str, str, str], te_module: Any = None, module: Any = None) -> Any:
        if self._thread.busy:
            return original(*args, **kwargs)
        self._thread.busy = True
        try:
            out = original(*args, **kwargs)
        finally:
            self._thread.busy = False
        start = time.perf_counter()
        try:
            self._record(api, bound, qkv, out, te_module, te_module if module is None else module)
        except Exception as exc:  # noqa: BLE001 - the capture must never break the user's run
            print(f"attn-doctor capture: call not recorded ({type(exc).__name__}: {exc})", file=sys.stderr)
        self.seconds += time.perf_counter() - start  # one thread's += can be lost to another's: a measure only
        return out

    # -- writing a call --

    DEFERRED = 1024  # calls held at most before they are written, whatever the model's forward pass does

    def _record(self, api: str, bound: dict, qkv: tuple[str, str, str], out: Any, te_module: Any,
                module: Any = None) -> None:
        """Records a call: its values now (when selected); its lines now, or at the end of the model's forward
        pass when autograd keeps the call's tensors until the backward anyway (`_kept_for_backward`).

        Why defer: inside a forward pass bound by the CPU, describing a call right after it ran does so on
        caches the model's own code has filled; describing the pass's calls one after another at its end cut
        the capture's time per TE call by a quarter on the H200's host (63 against 85 us in the same process,
        reports/h200/capture/deferred/). The price: a process killed in the middle of a forward pass loses
        that pass's calls (one that raises keeps them: the hook that writes them runs then too)."""
        path, layer = self._where(module)
        with self._lock:
            index = self.calls
            self.calls += 1
            ordinal = self._ordinal
            self._ordinal += 1
        layer = layer if layer is not None else ordinal
        step = self._step
        output = out[0] if isinstance(out, (tuple, list)) else out
        values = None
        if self.selection.values:
            rank = self._layout()[0]
            if self.selection.wants(layer, step, rank):
                stem = store.values_stem(self.root, rank, os.getpid(), index)
                values = self._save_values(stem, bound, qkv, output)
        call = (api, bound, qkv, output, te_module, None if te_module is None else te_now(), index, path, layer, step,
                values)
        if self._in_model and _kept_for_backward(output):
            with self._lock:
                self._deferred.append(call)
                if len(self._deferred) < self.DEFERRED:
                    return
            self._flush()
        else:
            self._write([call])

    def _flush(self) -> None:
        """Writes the deferred calls."""
        with self._lock:
            calls, self._deferred = self._deferred, []
        if calls:
            try:
                self._write(calls)
            except Exception as exc:  # noqa: BLE001 - the capture must never break the user's run
                print(f"attn-doctor capture: {len(calls)} calls not recorded ({type(exc).__name__}: {exc})",
                      file=sys.stderr)

    def _write(self, calls: list[tuple]) -> None:
        """The calls' lines, each call's described and written before the next's, so that a signature's line
        comes before the calls naming it. The process's rank and parallel layout are read here, not at each call
        (`_layout`): the calls written together are of one forward pass, or each written at its call."""
        with self._lock:
            rank, world, parallel = self._layout()
            if self._log is None:  # the first call: the rank is known now (torchrun sets it up after start)
                _write_env(store.rank_dir(self.root, rank) / "env.json")
                self._log = store.CallLog(self.root, rank, os.getpid())
            describer = self._describer
            hooked = []  # (output, index, site) of the calls whose output gradient is to be described
            try:
                for api, *call in calls:
                    for line in describer.lines(api, rank, world, parallel, *call):
                        self._log.append(line)
                    output, index, site = call[2], call[5], (call[6], describer.last_signature)
                    if isinstance(output, torch.Tensor) and output.requires_grad and site not in self._dout_sites:
                        hooked.append((output, index, site))
            except BaseException:
                describer.forget()  # a signature it numbered may not be in the file
                raise
        for output, index, site in hooked:
            try:
                output.register_hook(functools.partial(self._gradient_seen, describer, index, site))
            except Exception as exc:  # noqa: BLE001 - the capture must never break the user's run
                print(f"attn-doctor capture: call {index}'s output gradient will not be recorded "
                      f"({type(exc).__name__}: {exc})", file=sys.stderr)

    def _gradient_seen(self, describer: CallDescriber, index: int, site: tuple[str, int | None],
                       gradient: torch.Tensor) -> None:
        """A hook on a written call's output, run when the backward reaches it: the geometry of the output
        gradient the attention's backward gets (`CallDescriber.gradient_lines`), once per call *site* (module
        path and signature). dO's layout is set by the model's code after the call, which a site runs again at
        every step: a hook at every call cost the launch-bound SDPA stack's step 4-5% on the H200 (Python in
        the autograd thread's GIL-free backward), so later calls of a described site set none, and the reader
        gives them the site's geometry (`store.read_calls`). A call named by no signature is hooked each time.
        It returns nothing, so the gradient is unchanged; a failure is said on stderr, never raised into the
        backward. Nothing is written once the capture has ended, or in a forked child (whose describer is
        another: the call is the parent's)."""
        try:
            with self._lock:
                if self._log is None or describer is not self._describer:
                    return
                try:
                    for line in describer.gradient_lines(index, gradient):
                        self._log.append(line)
                except BaseException:
                    describer.forget()
                    raise
                if site[1] is not None:
                    self._dout_sites.add(site)
        except Exception as exc:  # noqa: BLE001 - the capture must never break the user's run
            print(f"attn-doctor capture: call {index}'s output gradient not recorded ({type(exc).__name__}: {exc})",
                  file=sys.stderr)

    def _layout(self) -> tuple[int, int, dict[str, int]]:
        """The process's rank, world size and parallel layout (`_rank_and_world`, `_parallel_sizes`), read once
        per forward pass of the model (reading them cost a call's capture several microseconds, six calls into
        Megatron's parallel_state among them), and again after each describe_parallel and for each call outside
        the model (`_where`)."""
        stamp = self._step, _parallel_said
        if self._read is None or self._read[0] != stamp:
            self._read = stamp, (*_rank_and_world(), _parallel_sizes())
        return self._read[1]

    def _save_values(self, stem: Path, bound: dict, qkv: tuple[str, str, str], output: Any) -> str:
        """The call's values now, and hooks that save its gradients when the backward reaches them. A TE call's
        q, k, v selected from a packed argument (`describe.packed_source`) are saved as q, k, v, the packed
        argument itself is not, and their gradients are the packed argument's gradient selected the same way."""
        given = dict(zip(("q", "k", "v"), (bound.get(key) for key in qkv)))
        source = packed_source(*given.values(), bound)
        if source is not None:
            given.update(selected_views(source))
        values = {name: t for name, t in given.items() if isinstance(t, torch.Tensor)}
        if isinstance(output, torch.Tensor):
            values["out"] = output
        for name, value in bound.items():  # masks and biases (integer tensors are in the metadata already)
            if name in qkv or (source is not None and value is source[0]):
                continue
            parts = {f"arg.{name}": value} if not isinstance(value, (tuple, list)) else {  # TE's (q, kv) masks
                f"arg.{name}.{i}": part for i, part in enumerate(value)}
            values.update({key: t for key, t in parts.items() if isinstance(t, torch.Tensor) and (
                t.is_floating_point() or t.dtype == torch.bool)})
        size = sum(t.numel() * t.element_size() for t in values.values())
        grad = isinstance(output, torch.Tensor) and output.requires_grad
        inputs = {name: values[name] for name in ("q", "k", "v") if name in values and values[name].requires_grad}
        needed = size + (output.numel() * output.element_size() if grad else 0) + sum(
            t.numel() * t.element_size() for t in inputs.values())
        with self._lock:
            if self.value_bytes + needed > self.selection.max_bytes:
                return f"skipped: over the budget of {self.selection.max_bytes} bytes (--max-bytes)"
            self.value_bytes += needed
        store.save_values(stem.with_suffix(".safetensors"), values)
        hooks: list[tuple[torch.Tensor, dict[str, tuple[Path, tuple[int, int] | None]]]] = []  # tensor, what of it
        if grad:
            hooks.append((output, {"dout": (stem.with_name(stem.name + ".dout.safetensors"), None)}))
        paths = {name: stem.with_name(f"{stem.name}.d{name}.safetensors") for name in inputs}
        if source is not None and source[0].requires_grad:  # a view made here is not in the graph: hook its source
            packed, dim, names = source
            hooks.append((packed, {f"d{name}": (paths[name], (dim, i))
                                   for i, name in enumerate(names) if name in paths}))
            inputs = {name: tensor for name, tensor in inputs.items() if name not in names}
        # dQ, dK, dV as the backward computed them (compare needs them)
        hooks += [(tensor, {f"d{name}": (paths[name], None)}) for name, tensor in inputs.items()]
        for tensor, wanted in hooks:
            if wanted:
                tensor.register_hook(functools.partial(_save_gradient, wanted))
        return stem.name + ".safetensors"


def _save_gradient(wanted: dict[str, tuple[Path, tuple[int, int] | None]], gradient: torch.Tensor) -> None:
    """A gradient hook: saves the gradient, or the slices `wanted` names ((dim, index) of a packed argument's
    gradient), each into its file. It returns nothing, so the gradient is unchanged; a write that fails is said
    on stderr, never raised into the backward of the run it observes."""
    try:
        for name, (path, part) in wanted.items():
            store.save_values(path, {name: gradient if part is None else gradient.select(*part)})
    except Exception as exc:  # noqa: BLE001 - the capture must never break the user's run
        print(f"attn-doctor capture: a gradient not recorded ({type(exc).__name__}: {exc})", file=sys.stderr)


def _kept_for_backward(output: Any) -> bool:
    """Whether autograd keeps the call's tensors until the backward anyway, so that holding them until the
    forward pass ends costs no memory: gradients on, an output that needs one, and no saved-tensor hooks
    (activation checkpointing or offloading, which drop or move what autograd saves). An attention function
    saves q, k and v for its backward, and TE's and SDPA's fused kernels also the output (SDPA's math path
    saves its intermediates instead of the output, which is then held longer than it would be)."""
    return (torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad
            and not _saved_tensor_hooks_on())


def _saved_tensor_hooks_reader() -> Callable[[], bool]:
    """Whether saved-tensor hooks are on in this thread, as a function found once (torch's is private)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        top(False)
        return lambda: top(False) is not None
    except TypeError:  # absent, or a torch whose function takes no argument
        return (lambda: top() is not None) if callable(top) else (lambda: True)  # unknowable: as if on


_saved_tensor_hooks_on = _saved_tensor_hooks_reader()


def _write_env(path: Path) -> None:
    try:
        from attn_doctor.machine.fingerprint import collect_env

        store.write_json(path, collect_env(read_te=False).to_dict())
    except Exception as exc:  # noqa: BLE001 - the fingerprint never stops a capture
        store.write_json(path, {"error": f"{type(exc).__name__}: {exc}"})


def _megatron_arguments(module: Any, bound: dict) -> None:
    """A Megatron local attention call's arguments as recorded: its mask type (an enum the module ignores) by
    name, and under `module` what the module computes (`clients.megatron_settings`)."""
    if bound.get("attn_mask_type") is not None:
        bound["attn_mask_type"] = getattr(bound["attn_mask_type"], "name", str(bound["attn_mask_type"]))
    try:
        bound["module"] = megatron_settings(module, bound.get("query"), bound.get("key"), bound.get("attention_mask"))
    except Exception as exc:  # noqa: BLE001 - the capture must never break the user's run
        bound["module"] = {"unreadable": f"{type(exc).__name__}: {exc}"[:200]}


@contextlib.contextmanager
def capture(directory: str | os.PathLike, *, values: bool = False, layers=None, steps=None, ranks=None,
            max_bytes: int = DEFAULT_MAX_BYTES, modules=()) -> Iterator[Recorder]:
    """Record every attention call made inside the `with` block into `directory` (see the module docstring);
    `values=True` records the tensors of the selected `layers`, `steps` and `ranks` within `max_bytes`;
    `modules` names attention modules to wrap too, as `capture --module` does ("PKG.Class[:MAPPING]",
    `attn_doctor.tracing.clients.ModuleSpec`)."""
    selection = Selection(values=values, max_bytes=max_bytes,
                          **{name: frozenset(chosen) if chosen is not None else None
                             for name, chosen in (("layers", layers), ("steps", steps), ("ranks", ranks))})
    specs = tuple(spec if isinstance(spec, ModuleSpec) else parse_module_spec(spec) for spec in modules)
    recorder = Recorder(Path(directory), selection, specs).start()
    try:
        yield recorder
    finally:
        recorder.stop()


def start_from_environment() -> Recorder | None:
    """What a child process of `attn-doctor capture` runs at start-up (its sitecustomize)."""
    options = os.environ.get(ENV_OPTIONS)
    if not options:
        return None
    document = json.loads(options)
    specs = tuple(parse_module_spec(text) for text in document.get("modules", ()))
    recorder = Recorder(Path(document["out"]), Selection.from_dict(document), specs).start()
    import atexit

    atexit.register(recorder.stop)
    return recorder


__all__ = ["Recorder", "Selection", "capture", "describe_parallel", "start_from_environment"]
