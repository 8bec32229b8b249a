"""What a recorded call says about itself: its tensors' geometry, its arguments, TE's module settings and TE's
choice, as the JSON lines the capture writes (`attn_doctor.tracing.store`); and what keeps that cheap.

A model makes the same call again and again (every layer, every step). So the part of a call's description that
does not change between such calls is written once per *signature*, as a line of its own numbered in the calls
file, and each call is a short line naming it: its index, module path, layer, step and values file. Describing a
call (building its dict and encoding it) cost more than half of the capture's time per call, and writing the
whole description each time a fifth more (and made a long run's calls file gigabytes). A signature is known by a
key: a tuple of the raw facts the description is made from (shapes, strides, offsets, dtypes, storage sizes and
which tensors share a storage; argument values and types; the TE module's attributes; TE's selection state),
cheaper to build than the description and equal only when the descriptions are equal. Whatever cannot be keyed
exactly (an argument of another type, e.g. an object whose repr could change) is described in full, in a line of
its own that names no signature.

A key may hold ids of objects (a TE module's attributes, TE's parameters object): its entry keeps those objects
alive, so that no other object can take their id while the entry is cached.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import operator
import sys
import weakref
from collections.abc import Hashable
from itertools import compress, count
from typing import Any

import torch

from attn_doctor.tracing.clients import megatron_config

SMALL_INT_TENSOR = 65_536  # integer tensors up to this many elements (lengths, offsets) keep their values


def tensor_meta(t: torch.Tensor, storages: dict[int, int]) -> dict[str, Any]:
    """A tensor's geometry: what replay needs to rebuild the same view into a storage of the same size."""
    storage = t.untyped_storage()
    sid = storages.setdefault(storage.data_ptr(), len(storages))
    return {"shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
            "dtype": str(t.dtype).removeprefix("torch."), "device": str(t.device),
            "storage": {"id": sid, "nbytes": storage.nbytes()}, "requires_grad": t.requires_grad}


def _keeps_values(t: torch.Tensor) -> bool:
    return not t.is_floating_point() and t.dtype != torch.bool and t.numel() <= SMALL_INT_TENSOR


class SmallValues:
    """The values of small integer tensors (cu_seqlens), read once per tensor: reading a GPU tensor waits for
    the GPU, and a model passes the same cu_seqlens to every layer. A tensor is known by its identity and its
    version counter (which in-place writes bump); a weak reference tells a freed tensor from a new one that
    took its id."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref, int, tuple[int, ...]]] = {}

    def of(self, t: torch.Tensor) -> tuple[int, ...]:
        known = self._known.get(id(t))
        if known is not None and known[0]() is t and known[1] == t._version:
            return known[2]
        values = tuple(t.detach().to("cpu").reshape(-1).tolist())
        if len(self._known) > 256:
            self._known = {key: entry for key, entry in self._known.items() if entry[0]() is not None}
        self._known[id(t)] = (weakref.ref(t), t._version, values)
        return values


def describe_value(value: Any, storages: dict[int, int], small: SmallValues | None = None) -> Any:
    """An argument as JSON: tensors by their geometry (small integer ones with their values), the rest as
    plain values or their repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        meta: dict[str, Any] = {"tensor": tensor_meta(value, storages)}
        if _keeps_values(value):
            meta["values"] = list((small or SmallValues()).of(value))
        return meta
    if isinstance(value, (list, tuple)):
        return [describe_value(v, storages, small) for v in value]
    if isinstance(value, dict):
        return {str(k): describe_value(v, storages, small) for k, v in value.items()}
    return {"repr": repr(value)[:500]}


_GEOMETRY = operator.attrgetter("shape", "dtype", "device", "requires_grad")


def tensors_key(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple, list[int]]:
    """What `tensor_meta` is made from for each of `tensors` (their storages numbered in order), and the
    storages' addresses: five runs of a fact per tensor, each gathered by one loop in C. A Python loop over the
    tensors ran a fifth of the capture's bytecodes per call; without it a call's capture took a fifth less time
    on this project's CPU machine (none measurably less on the H200's host: reports/h200/capture/deferred/)."""
    storages = [*map(torch.Tensor.untyped_storage, tensors)]
    addresses = [*map(torch.UntypedStorage.data_ptr, storages)]
    return (*map(_GEOMETRY, tensors), *map(torch.Tensor.stride, tensors), *map(torch.Tensor.storage_offset, tensors),
            *map(addresses.index, addresses), *map(torch.UntypedStorage.nbytes, storages)), addresses


def tensor_key(t: torch.Tensor, storages: dict[int, int]) -> Hashable:
    """What `tensor_meta(t, storages)` is made from, with the same effect on `storages`."""
    geometry, (address,) = tensors_key((t,))
    return geometry, storages.setdefault(address, len(storages))


QKVO = ("q", "k", "v", "out")


def _tensors_of(inputs: tuple) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
    """The names (of QKVO) and the tensors of those of a call's q, k, v and output that are tensors."""
    if all(map(isinstance, inputs, (torch.Tensor,) * len(inputs))):
        return QKVO, inputs
    present = [(name, t) for name, t in zip(QKVO, inputs) if isinstance(t, torch.Tensor)]
    return tuple(name for name, _ in present), tuple(t for _, t in present)


def packed_source(q: Any, k: Any, v: Any,
                  arguments: dict[str, Any]) -> tuple[torch.Tensor, int, tuple[str, ...]] | None:
    """The packed argument a TE call's missing k and v (and q) are in, the dimension TE selects them along and
    their names: `qkv_layer` when q, k and v are None, `kv_layer` when k and v are (TE >= 2.20's
    MultiheadAttention passes its fused projection's output so, where TE before detected the packing from the
    views' pointers). None when the call passes its q, k and v, or its packed argument is not what TE accepts."""
    if k is not None or v is not None:
        return None
    packed, names = (arguments.get("qkv_layer"), QKVO[:3]) if q is None else (arguments.get("kv_layer"), QKVO[1:3])
    dim = arguments.get("qkv_interleave_dim", -3)  # TE's default; a call's arguments leave defaults out
    if not isinstance(packed, torch.Tensor) or type(dim) is not int or dim not in (-3, -2) or packed.dim() < 3 or (
            packed.shape[dim] != len(names)):
        return None
    return packed, dim, names


def selected_views(source: tuple[torch.Tensor, int, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """The views TE selects from a packed argument (`packed_source`), by name: the same storage, strides and
    offsets as TE's own views."""
    packed, dim, names = source
    return {name: packed.select(dim, i) for i, name in enumerate(names)}


def unpacked(q: Any, k: Any, v: Any, arguments: dict[str, Any]) -> tuple[Any, Any, Any]:
    """A call's q, k and v as the tensors the kernel reads: the views TE selects from a packed argument, else
    as passed."""
    source = packed_source(q, k, v, arguments)
    if source is None:
        return q, k, v
    views = selected_views(source)
    return views.get("q", q), views["k"], views["v"]


_PLAIN = frozenset({type(None), bool, int, str})  # values whose value and type are their description


class Unkeyable(Exception):
    """A value whose description no key determines exactly: the call is described in full."""


def value_key(value: Any, storages: dict[int, int], small: SmallValues) -> Hashable:
    """What `describe_value(value, storages)` is made from, with the same effect on `storages`. Types are part
    of the key (True, 1 and 1.0 are equal in Python, not in JSON), floats by their repr (-0.0 == 0.0)."""
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is str:
        return kind, value
    if kind is float:
        return kind, repr(value)
    if isinstance(value, torch.Tensor):
        values = None if value.is_floating_point() or not _keeps_values(value) else small.of(value)
        return tensor_key(value, storages), values
    if kind is tuple or kind is list:
        kinds = tuple(map(type, value))
        if _PLAIN.issuperset(kinds):  # e.g. a window (-1, 0)
            return list, kinds, tuple(value)
        return list, tuple(value_key(v, storages, small) for v in value)
    if kind is dict:
        return dict, tuple((str(k), value_key(v, storages, small)) for k, v in value.items())
    raise Unkeyable(kind.__name__)


TE_SETTINGS = ("qkv_format", "attn_mask_type", "window_size", "softmax_type", "num_attention_heads",
               "num_gqa_groups", "hidden_size_per_attention_head_k", "hidden_size_per_attention_head_v",
               "hidden_size_per_attention_head", "softmax_scale", "attention_type", "tp_size", "deterministic",
               "layer_number", "cp_comm_type", "bottom_right_diagonal")
# the attributes te_module_settings reads; `config`: the TransformerConfig of Megatron's TEDotProductAttention
TE_READ = TE_SETTINGS + ("attention_dropout", "cp_group", "config")


TE_DPA = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
TE_FP8 = ("transformer_engine.pytorch.fp8", "transformer_engine.pytorch.quantization")  # TE's FP8 state, by version


def te_now() -> tuple[dict | None, Any]:
    """What of TE's state a call's description needs, as it is right after the call: its selection state (a
    copy: TE changes it in place at its next call) and the FP8 recipe in force (None while FP8 is off). Run at
    every TE call: its lookups are written out here rather than in helpers."""
    modules = sys.modules
    state = getattr(modules.get(TE_DPA), "_attention_backends", None)  # imported by the TE call just made
    manager = getattr(modules.get(TE_FP8[0]) or modules.get(TE_FP8[1]), "FP8GlobalStateManager", None)
    try:
        recipe = manager.get_fp8_recipe() if manager is not None and manager.is_fp8_enabled() else None
    except Exception:  # noqa: BLE001 - an older or newer TE: no recipe read, never a failed run
        recipe = None
    return (state.copy() if isinstance(state, dict) else None), recipe


def te_module_settings(module: Any, recipe: Any) -> dict[str, Any]:
    """The DotProductAttention constructor settings a call depends on (read from the module), and the FP8
    recipe in force at the call (`te_now`)."""
    attributes = vars(module)  # plain attributes: nn.Module's __getattr__ makes each missing name cost microseconds
    settings = {name: describe_value(attributes[name], {}) for name in TE_SETTINGS if name in attributes}
    if "softmax_scale" not in settings:  # TE keeps the scale on its backends (fused_attention, ...), not itself
        inner = getattr(getattr(module, "fused_attention", None), "softmax_scale", None)
        if isinstance(inner, (int, float)):
            settings["softmax_scale"] = inner
    dropout = attributes.get("attention_dropout")
    settings["attention_dropout"] = getattr(dropout, "p", dropout) if not isinstance(dropout, (int, float)) else dropout
    group = attributes.get("cp_group")
    with contextlib.suppress(Exception):
        settings["cp_size"] = torch.distributed.get_world_size(group) if group is not None else 1
    megatron = megatron_config(module)  # Megatron's TE spec: its settings (the call is TE's, recorded once)
    if megatron is not None:
        settings["megatron"] = megatron
    if recipe is not None:
        settings["fp8_recipe"] = {
            "type": type(recipe).__name__, "fp8_dpa": bool(getattr(recipe, "fp8_dpa", False)),
            "format": str(getattr(recipe, "fp8_format", "")).rpartition(".")[2] or None,
            "margin": getattr(recipe, "margin", None), "repr": repr(recipe)[:500]}
    return settings


_MISSING = object()
_MISSINGS = (_MISSING,) * len(TE_READ)


TE_CHOICE = ("use_flash_attention", "flash_attention_backend", "use_fused_attention", "fused_attention_backend",
             "use_unfused_attention")


def te_key(module: Any, now: tuple[dict | None, Any], pins: list) -> Hashable:
    """What `te_module_settings(module)` and `te_choice` are made from: the objects they read from the module,
    by identity (their values are immutable: strings, numbers, tuples, a process group); the FP8 recipe's fields
    by value (a recipe is a mutable dataclass); TE's selection flags, and its parameters object by identity (TE
    replaces the object when the parameters change); `now`: TE's state at the call (`te_now`). `pins` gets
    what must stay alive for the ids to hold."""
    attributes = vars(module)
    read = [*map(attributes.get, TE_READ, _MISSINGS)]
    if "softmax_scale" not in attributes:  # the submodule by its dict: nn.Module's __getattr__ costs microseconds
        read.append(getattr(attributes.get("_modules", {}).get("fused_attention"), "softmax_scale", None))
    dropout = attributes.get("attention_dropout")
    if dropout is not None and not isinstance(dropout, (int, float)):
        read.append(getattr(dropout, "p", None))  # a Dropout module: its p may be set in place
    state, recipe = now
    choice = None
    if state is not None:
        read.append(state.get("attention_params"))
        choice = tuple(map(state.get, TE_CHOICE))
    pins.append(read)
    if recipe is None:
        return tuple(map(id, read)), choice
    fields = tuple(vars(recipe).items())
    if not all(isinstance(value, Hashable) for _, value in fields):
        raise Unkeyable(type(recipe).__name__)
    return tuple(map(id, read)), choice, type(recipe), fields


def te_choice(state: dict | None, reasons: dict[int, tuple[Any, list[str]]]) -> dict[str, Any]:
    """The backend TE chose for the call, read from TE's own selection state at the call and named as the TE
    backend's rows name it (`attn_doctor.backends.te.describe_state`), and why: TE's own reasons, found once
    per parameters object (finding them runs TE's selection again, which costs about as much as the call; TE
    keeps its parameters object while they do not change). `reasons` holds the objects it keyed, so that their
    ids are not reused while it knows them."""
    from attn_doctor.backends.te import describe_state

    if state is None:  # an older or newer TE: the choice is unknown, not an error
        return {"backend": "unknown (TE's selection state not readable)"}
    params = state.get("attention_params")
    known = reasons.get(id(params))
    if params is not None and (known is None or known[0] is not params):
        if len(reasons) >= 64:
            reasons.clear()
        known = reasons[id(params)] = (params, te_reasons(params))
    return {"backend": describe_state(state), "qkv_layout": getattr(params, "qkv_layout", None),
            "deterministic": getattr(params, "deterministic", None), "reasons": known[1] if known else []}


TE_REASONS = ("Disabling", "Available backends", "Selected backend")


def te_reasons(params: Any) -> list[str]:
    """TE's account of its choice: its selection function run again on the same parameters with its debug log
    caught (the "Disabling X due to ..." lines TE prints under NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2), nothing
    printed and TE's logging left as it was."""
    from attn_doctor.backends.te import LogLines

    try:
        utils = importlib.import_module("transformer_engine.pytorch.attention.dot_product_attention.utils")
        settings = utils.AttentionLogging
        logger = logging.getLogger("DotProductAttention")
    except Exception as exc:  # noqa: BLE001 - an older or newer TE: no reasons, never a failed run
        return [f"unreadable ({type(exc).__name__})"]
    caught = LogLines()
    saved = (settings._log_level, logger.level, logger.propagate, logger.handlers[:])
    settings._log_level, logger.propagate, logger.handlers = logging.DEBUG, False, [caught]
    try:
        utils.get_attention_backend(params)
    except Exception as exc:  # noqa: BLE001
        caught.lines.append(f"unreadable ({type(exc).__name__}: {exc})")
    finally:
        settings._log_level, level, logger.propagate, logger.handlers = saved
        logger.setLevel(level)
    return [m[:500] for m in caught.lines if m.startswith(TE_REASONS + ("unreadable",))]


_NONES = (None,) * 3


class CallDescriber:
    """A call's lines for the calls file: the unchanging part of its description as a *signature* line, written
    once per signature, and a short line per call that names it (see the module docstring).

    `lines(...)` describes with the cache; `memo=False` describes the call in full each time, as one line that
    names no signature (the tests check that both read back the same). A call that cannot be keyed is also
    written as such a whole line."""

    LIMIT = 4096  # signatures kept; a model has a handful (one per distinct call), a step-varying one many

    def __init__(self, process: dict[str, Any]) -> None:
        self.process = process
        self.small = SmallValues()
        self.te_reasons: dict[int, tuple[Any, list[str]]] = {}  # TE's reasons, by its parameters object
        self._numbers: dict[Hashable, tuple[int, list]] = {}  # signature key -> (its number, what its key pins)
        self._next = 0
        self._paths: dict[str, str] = {}
        self._geometries: dict[Hashable, int] = {}  # an output gradient's geometry key -> its number
        self._next_geometry = 0
        self.last_signature: int | None = None  # the signature `lines` named last (None: a whole line)

    @property
    def signatures(self) -> int:
        return self._next

    def forget(self) -> None:
        """Forgets the signatures (and output gradients' geometries) numbered so far, so that each is described
        again, under a new number: for a caller whose lines did not all reach the file (a signature named by a
        call but never written would make the whole capture unreadable)."""
        self._numbers.clear()
        self._geometries.clear()

    def lines(self, api: str, rank: int, world_size: int, parallel: dict[str, int], bound: dict[str, Any],
              qkv: tuple[str, str, str], output: Any, te_module: Any, te_state: tuple | None, index: int,
              module_path: str, layer: int | None, step: int, values: str | None, memo: bool = True) -> list[str]:
        """The lines to append for this call, in order: its signature's line when the signature is new, then
        the call's, each ending in a newline. `bound`: the call's arguments by name, q, k and v under the names
        `qkv`; `output`: what it returned; `te_module`: the TE module called, or None, and `te_state` what
        `te_now` gave right after the call; `values`: the values file's name, or why there is none. The caller
        appends them before another call is described, so that a signature's line always comes before the
        lines that name it."""
        arguments = bound.copy()
        inputs = (*map(arguments.pop, qkv, _NONES), output)
        if inputs[1] is None:  # k not passed: the views TE selects from a packed qkv_layer or kv_layer
            inputs = (*unpacked(*inputs[:3], arguments), output)
        key = pins = None
        if memo:
            pins = []
            try:
                key = self._key(api, rank, world_size, parallel, arguments, inputs, te_module, te_state, pins)
                known = self._numbers.get(key)
            except (Unkeyable, TypeError):  # TypeError: an unhashable value in TE's state or settings
                key = known = None
            if known is not None:
                self.last_signature = known[0]
                return [f'{self._head(index, module_path, layer, step, values)},"signature":{known[0]}}}\n']
        storages: dict[int, int] = {}
        whole = {"api": api, "process": self.process, "rank": rank, "world_size": world_size, "parallel": parallel,
                 "tensors": {name: tensor_meta(t, storages) for name, t in zip(*_tensors_of(inputs))},
                 "arguments": {name: describe_value(v, storages, self.small) for name, v in arguments.items()}}
        if te_module is not None:
            whole["arguments"]["module"] = te_module_settings(te_module, te_state[1])
            whole["te"] = te_choice(te_state[0], self.te_reasons)
        text = json.dumps(whole, separators=(",", ":"))
        head = self._head(index, module_path, layer, step, values)
        self.last_signature = None
        if key is None:
            return [f"{head},{text[1:]}\n"]
        if len(self._numbers) >= self.LIMIT:
            self._numbers.clear()
        number = self._next
        self._next += 1
        self._numbers[key] = number, pins
        self.last_signature = number
        return [f'{{"signature":{number},{text[1:]}\n', f'{head},"signature":{number}}}\n']

    def gradient_lines(self, index: int, gradient: torch.Tensor) -> list[str]:
        """The lines saying the geometry of the output gradient (dO) the backward gave call `index` (shape,
        dtype, strides, storage offset and storage size, as for the call's own tensors), in order: the
        geometry's line when it is new (numbered in a series of its own, like signatures), then a line naming
        it. A model's dO has a few geometries (often a view that is not contiguous: the gradient of
        `out.transpose(1, 2).reshape(...)`), written once each."""
        key = tensor_key(gradient, {})
        number = self._geometries.get(key)
        lines = []
        if number is None:
            if len(self._geometries) >= self.LIMIT:
                self._geometries.clear()
            number = self._geometries[key] = self._next_geometry
            self._next_geometry += 1
            meta = json.dumps(tensor_meta(gradient, {}), separators=(",", ":"))
            lines.append(f'{{"gradient_geometry":{number},"tensor":{meta}}}\n')
        lines.append(f'{{"gradient_of":{index},"geometry":{number}}}\n')
        return lines

    def _key(self, api: str, rank: int, world_size: int, parallel: dict[str, int], arguments: dict[str, Any],
             inputs: tuple, te_module: Any, te_state: tuple | None, pins: list) -> Hashable:
        """The raw facts the description is made from, equal only when the descriptions are (`inputs`: q, k, v
        and the output), gathered in few bytecodes (see `tensors_key`)."""
        names, tensors = _tensors_of(inputs)
        geometry, addresses = tensors_key(tensors)
        given = [*arguments.values()]
        kinds = tuple(map(type, given))
        if not _PLAIN.issuperset(kinds):  # a tensor, float or container among them: its value_key instead
            storages = dict(zip(dict.fromkeys(addresses), count()))  # as tensor_meta numbers them: q, k, v, out first
            for position in compress(count(), map(operator.not_, map(_PLAIN.__contains__, kinds))):  # not plain
                given[position] = value_key(given[position], storages, self.small)
        return (api, rank, world_size, tuple(parallel.items()), names, geometry, tuple(arguments), kinds,
                tuple(given), None if te_module is None else te_key(te_module, te_state, pins))

    def _head(self, index: int, module_path: str, layer: int | None, step: int, values: str | None) -> str:
        """What a call's line says of the call itself, the closing brace left off."""
        path = self._paths.get(module_path)
        if path is None:  # a model's few module paths, encoded once each
            if len(self._paths) >= self.LIMIT:
                self._paths.clear()
            path = self._paths[module_path] = json.dumps(module_path)
        return (f'{{"index":{index},"module":{path},"layer":{"null" if layer is None else layer},"step":{step},'
                f'"values":{"null" if values is None else json.dumps(values)}')
