"""Attention modules the capture wraps beside the attention functions: Megatron-Core's own (`local`) core
attention, and any module a user names (`capture --module`), with what each call of them means.

Megatron-Core's `DotProductAttention` (`megatron.core.transformer.dot_product_attention`, the core attention
of `get_gpt_layer_local_spec()`, `--transformer-impl local`) computes baddbmm, a masked softmax
(`FusedScaleMaskSoftmax`) and bmm on [s, b, heads, dim] tensors. What it computes depends on its settings, not
on the call's `attn_mask_type` argument (which it ignores), so the capture reads them from the module at each
call (`megatron_settings`), and which softmax ran is read back from Megatron (`is_kernel_available`):

- the scale: its `softmax_scale` (1/sqrt(dim), divided by the layer number under
  `apply_query_key_layer_scaling`), times the softmax's own `scale` (the layer number again);
- the mask: with a sliding window, Megatron's own window mask (the mask passed is ignored); with the fused
  kernel under the causal mask type, the causal mask (ignored too); else the mask passed (True = masked out,
  filled with -10000 before the softmax), or the causal mask when none is passed and the type is causal;
- the softmax in fp32 (`attention_softmax_in_fp32`) or in the inputs' dtype; the layer number Megatron gives
  the module; attention dropout; the softmax type (off-by-one, learnable offsets).

Megatron's TE spec (`TEDotProductAttention`) is TE's DotProductAttention and is recorded as TE (its calls reach
TE's forward once); `megatron_config` adds the Megatron settings of its `config`.

A named module (`--module PKG.Class[:MAPPING]`) is wrapped the same way: its forward's q, k and v are found by
the MAPPING (`ModuleSpec`), and the call replays as plain softmax attention on them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from attn_doctor.core.errors import BadInput

MEGATRON_LOCAL = "megatron.core.transformer.dot_product_attention"  # the module that defines it
MEGATRON_API = "megatron.DotProductAttention"
# Megatron's TransformerConfig settings a TE spec's call depends on or a report names.
MEGATRON_CONFIG = ("apply_query_key_layer_scaling", "attention_softmax_in_fp32", "masked_softmax_fusion",
                   "tensor_model_parallel_size", "context_parallel_size", "num_attention_heads", "num_query_groups",
                   "kv_channels", "fp16", "bf16", "attention_dropout", "softmax_type")


def _plain(value: Any) -> Any:
    """A setting as JSON: an enum by its name, a tuple as a list, other objects by their repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    name = getattr(value, "name", None)
    return name if isinstance(name, str) else repr(value)[:200]


def megatron_config(module: Any) -> dict[str, Any] | None:
    """The Megatron settings of a module's `config` (a TransformerConfig), or None when it has none."""
    config = vars(module).get("config")
    if config is None or type(config).__name__ != "TransformerConfig":
        return None
    return {name: _plain(getattr(config, name, None)) for name in MEGATRON_CONFIG}


def megatron_settings(module: Any, query: Any, key: Any, attention_mask: Any) -> dict[str, Any]:
    """What one call of Megatron's local DotProductAttention computes, read from the module (see the module
    docstring); `fused_softmax` is Megatron's own answer for this call's shapes."""
    softmax = getattr(module, "scale_mask_softmax", None)
    dropout = getattr(module, "attention_dropout", None)
    settings = {
        "layer_number": getattr(module, "layer_number", None),
        "softmax_scale": getattr(module, "softmax_scale", None),
        "softmax_coeff": getattr(softmax, "scale", None),
        "attn_mask_type": _plain(getattr(softmax, "attn_mask_type", getattr(module, "attn_mask_type", None))),
        "window_size": _plain(getattr(softmax, "window_size", None)),
        "softmax_in_fp32": getattr(softmax, "softmax_in_fp32", None),
        "attention_dropout": getattr(dropout, "p", dropout),
        "softmax_type": getattr(getattr(module, "config", None), "softmax_type", "vanilla"),
        "heads_per_partition": getattr(module, "num_attention_heads_per_partition", None),
        "query_groups_per_partition": getattr(module, "num_query_groups_per_partition", None),
        "fused_softmax": None,
    }
    with contextlib.suppress(Exception):  # a Megatron without it, or shapes it cannot take: unknown
        sq, b, heads = query.shape[0], query.shape[1], query.shape[2]
        settings["fused_softmax"] = bool(softmax.is_kernel_available(attention_mask, b, heads, sq, key.shape[0]))
    config = megatron_config(module)
    if config is not None:
        settings["config"] = config
    return settings


FORMATS = ("bshd", "sbhd", "bhsd")


@dataclass(frozen=True)
class ModuleSpec:
    """A module the capture wraps by name: `PKG.Class[:MAPPING]`, MAPPING a comma list of

    - `q=NAME,k=NAME,v=NAME`: the forward's arguments holding q, k and v, by keyword name or by position (0 is
      the first argument after self); default `q=0,k=1,v=2`;
    - `layout=bshd|sbhd|bhsd`: their layout (default bshd); the output is the same layout, its heads possibly
      flattened;
    - `causal=true|false` (default false) and `scale=NUMBER` (default 1/sqrt(head dim)): what the module
      computes, softmax(scale q k^T + causal mask) v.
    """

    target: str  # PKG.Class
    arguments: tuple[str, str, str] = ("0", "1", "2")
    layout: str = "bshd"
    causal: bool = False
    scale: float | None = None

    @property
    def package(self) -> str:
        return self.target.rpartition(".")[0]

    @property
    def class_name(self) -> str:
        return self.target.rpartition(".")[2]

    @property
    def api(self) -> str:
        return f"module:{self.target}"

    def recorded_settings(self) -> dict[str, Any]:
        """What a call's line says of the module's meaning (the replay reads it)."""
        return {"layout": self.layout, "causal": self.causal, "softmax_scale": self.scale,
                "arguments": list(self.arguments)}

    def to_text(self) -> str:
        names = dict(zip("qkv", self.arguments))
        parts = [f"{name}={names[name]}" for name in "qkv"] + [f"layout={self.layout}",
                                                               f"causal={str(self.causal).lower()}"]
        if self.scale is not None:
            parts.append(f"scale={self.scale!r}")
        return f"{self.target}:{','.join(parts)}"

    def bind(self, parameters: list[str], args: tuple, kwargs: dict) -> dict[str, Any]:
        """q, k, v of one call (by the forward's parameter names after self), or ValueError saying why not."""
        found = {}
        for name, where in zip("qkv", self.arguments):
            if where.isdigit():
                position = int(where)
                if position < len(args):
                    found[name] = args[position]
                elif position < len(parameters) and parameters[position] in kwargs:
                    found[name] = kwargs[parameters[position]]
                else:
                    raise ValueError(f"{name} is argument {position}, but the call passed {len(args)} positional "
                                     f"arguments and no {parameters[position] if position < len(parameters) else '?'}")
            elif where in kwargs:
                found[name] = kwargs[where]
            elif where in parameters and parameters.index(where) < len(args):
                found[name] = args[parameters.index(where)]
            else:
                raise ValueError(f"{name} is the argument {where!r}, which the call did not pass (its parameters: "
                                 f"{', '.join(parameters) or 'none'})")
        bad = [name for name, value in found.items() if getattr(value, "dim", lambda: 0)() != 4]
        if bad:
            raise ValueError(f"{', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a tensor of 4 dimensions "
                             f"({self.layout}: the heads apart)")
        return found


def parse_module_spec(text: str) -> ModuleSpec:
    """`--module PKG.Class[:MAPPING]` (`ModuleSpec`), or bad input saying what is wrong."""
    target, _, mapping = text.partition(":")
    if "." not in target or not all(part.isidentifier() for part in target.split(".")):
        raise BadInput(f"--module {text!r}: expected PKG.Class[:q=NAME,k=NAME,v=NAME,layout=bshd|sbhd|bhsd,"
                       "causal=true|false,scale=NUMBER], e.g. mymodel.attention.CoreAttention:q=query,k=key,v=value")
    names = {"q": "0", "k": "1", "v": "2"}
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in mapping.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise BadInput(f"--module {text!r}: {item!r} is not KEY=VALUE")
        if key in names:
            if not (value.isdigit() or value.isidentifier()):
                raise BadInput(f"--module {text!r}: {key}={value} must name an argument or give its position")
            names[key] = value
        elif key == "layout":
            if value not in FORMATS:
                raise BadInput(f"--module {text!r}: layout {value!r}; choose one of {', '.join(FORMATS)}")
            fields["layout"] = value
        elif key == "causal":
            if value.lower() not in ("true", "false"):
                raise BadInput(f"--module {text!r}: causal={value}; use true or false")
            fields["causal"] = value.lower() == "true"
        elif key == "scale":
            try:
                fields["scale"] = float(value)
            except ValueError:
                raise BadInput(f"--module {text!r}: scale={value} is not a number") from None
            if not 0 < fields["scale"] < float("inf"):
                raise BadInput(f"--module {text!r}: scale={value} must be a positive number")
        else:
            raise BadInput(f"--module {text!r}: unknown key {key!r} (q, k, v, layout, causal, scale)")
    return ModuleSpec(target, (names["q"], names["k"], names["v"]), **fields)


def unrecorded_module(specs: list[ModuleSpec], apis: set[str], notes: list[dict[str, Any]]) -> str | None:
    """Why the first named module whose calls a capture holds none of (`apis`: the APIs it recorded) was not
    recorded: its calls' arguments could not be mapped (the capture's notes say how), or it was never called;
    None when every named module was recorded."""
    for spec in specs:
        if spec.api in apis:
            continue
        why = [note["not_recorded"] for note in notes if note.get("module") == spec.target]
        if why:
            return (f"--module {spec.target}: its calls' arguments cannot be mapped: {why[0]}; fix the mapping "
                    "(q=NAME,k=NAME,v=NAME)")
        return f"--module {spec.target}: was never called (check the class's module path, and that the command uses it)"
    return None
