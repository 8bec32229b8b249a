"""A captured call as a case: each distinct call becomes a `Case` (its shapes, dtype, mask, window, lengths, kv
heads, bias, softmax type and scale, FP8 recipe) that names the call (`Case.replay`: DIR@RANK.PID.INDEX), and
what a captured call's arguments mean. Serving the call's numbers while probes run is
`attn_doctor.tracing.replay_source`; a case, once made, needs its capture only for its numbers.

What each API's arguments mean here:
- SDPA: a boolean attn_mask (True = attend) or a float one (its -inf entries mask, the rest is a bias) becomes
  the case's captured `arbitrary` mask and `post_scale_bias`; is_causal is TE's top-left `causal`.
- flash-attn: `causal` and windows are aligned bottom-right (`causal_bottom_right` when the lengths differ);
  the varlen function's packed tensors are a thd call.
- TE: a packed qkv_layer or kv_layer (TE >= 2.20's MultiheadAttention) is replayed as the views TE selects
  from it (the capture records them as q, k, v: the same storage, strides and offsets), which attn-doctor's TE
  path passes as q, k and v, TE then finding the same packed layout from their pointers; a padding
  attention_mask gives the lengths (it must be right padding: TE's fused paths read only its counts); an
  arbitrary one the captured mask; a thd call's cu_seqlens the lengths and its padded offsets each sequence's
  slot (`captured_slots`), so the packed tensors come back token for token.
Calls this cannot express are named with the reason (`case_of` returns a string): dropout, per-head masks,
masks whose values were not captured, softcap, custom ALiBi slopes, KV caches, FP8 recipes other than delayed
and current scaling, and tokens outside every sequence of a packed tensor.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

from attn_doctor.core.case import Case, make_case
from attn_doctor.core.errors import BadInput
from attn_doctor.core.paths import check_input
from attn_doctor.numerics.standalone import TORCH_DTYPES
from attn_doctor.tracing.clients import MEGATRON_API
from attn_doctor.tracing.store import HEADER, CapturedCall, load_values, read_capture

# attn-doctor's dtype names by torch's, as a capture records them: "bfloat16" -> "bf16".
DTYPE_BY_TORCH_NAME = {str(dtype).removeprefix("torch."): name for name, dtype in TORCH_DTYPES.items()}


def reference_of(root: Path, call: CapturedCall) -> str:
    """The `Case.replay` text naming a call: DIR@RANK.PID.INDEX."""
    return f"{Path(root).resolve()}@{call.rank}.{call.meta['process']['pid']}.{call.index}"


@functools.lru_cache(maxsize=64)
def _calls(root: str) -> dict[tuple[int, int, int], CapturedCall]:
    return {(c.rank, c.meta["process"]["pid"], c.index): c for c in read_capture(Path(root))}


def capture_of(reference: str) -> Path:
    """The capture folder a `Case.replay` reference names."""
    return Path(reference.rpartition("@")[0])


def readable(reference: str) -> bool:
    """Whether the call a reference names can be read here (its capture folder may have been moved away since
    this process read it: the folder is looked for on disk, not in what was read)."""
    if not (capture_of(reference) / HEADER).is_file():
        return False
    try:
        load_call(reference)
    except BadInput:
        return False
    return True


def load_call(reference: str) -> CapturedCall:
    root, _, ident = reference.rpartition("@")
    try:
        key = tuple(int(part) for part in ident.split("."))
        return _calls(root)[key]
    except (ValueError, KeyError):
        raise BadInput(f"--replay {reference!r} names no call of a capture (DIR@RANK.PID.INDEX, as `attn-doctor "
                       "replay` writes it)") from None


def native_format(call: CapturedCall) -> str:
    """The layout of the call's q, k, v: SDPA's [b, h, s, d] (`bhsd`), flash-attn's bshd (its varlen function's
    thd), Megatron's sbhd, a named module's own (`--module ...:layout=`), TE's qkv_format."""
    api = call.meta["api"]
    if api == "torch.sdpa":
        return "bhsd"
    if api.startswith("flash_attn."):
        return "thd" if api.endswith("varlen_func") else "bshd"
    if api == MEGATRON_API:
        return "sbhd"
    if api.startswith("module:"):
        return call.meta["arguments"].get("module", {}).get("layout") or "bshd"
    return _te_setting(call, "qkv_format") or "sbhd"


def _te_setting(call: CapturedCall, name: str) -> Any:
    value = call.meta["arguments"].get(name)
    return value if value is not None else call.meta["arguments"].get("module", {}).get(name)


def _offsets(argument: Any) -> list[int] | None:
    return list(argument["values"]) if isinstance(argument, dict) and "values" in argument else None


def lengths_of(offsets: list[int] | None) -> tuple[int, ...] | None:
    return None if offsets is None else tuple(b - a for a, b in zip(offsets, offsets[1:]))


def packed_offsets(call: CapturedCall) -> dict[str, tuple[list[int] | None, list[int] | None]]:
    """A packed call's sequence offsets and slot offsets, per side (q, kv): TE's cu_seqlens_*_padded, or the
    side's cu_seqlens when it has none (as TE takes them); flash-attn's varlen calls have no slots of their
    own. A call without cu_seqlens_kv uses the query side's."""
    args = call.meta["arguments"]
    te = call.meta["api"] == "te.DotProductAttention"
    cu_q, cu_kv = _offsets(args.get("cu_seqlens_q")), _offsets(args.get("cu_seqlens_kv" if te else "cu_seqlens_k"))
    padded_q, padded_kv = ((_offsets(args.get("cu_seqlens_q_padded")), _offsets(args.get("cu_seqlens_kv_padded")))
                           if te else (None, None))
    cu_kv = cu_kv or cu_q
    return {"q": (cu_q, padded_q or cu_q), "kv": (cu_kv, padded_kv or cu_kv)}


class UnexpectedShapes(Exception):
    """q, k and v's recorded shapes are not what the call's API takes: the call cannot be replayed."""


def case_of(call: CapturedCall, root: Path, seed: int = 1234) -> Case | str:
    """The case a captured call asks, or why it cannot be replayed yet."""
    meta = call.meta
    shapes = {name: meta["tensors"][name]["shape"] for name in ("q", "k", "v") if name in meta["tensors"]}
    if set(shapes) != {"q", "k", "v"}:
        if meta["arguments"].get("qkv_layer") is not None or meta["arguments"].get("kv_layer") is not None:
            return "TE's packed qkv_layer/kv_layer, captured without the views TE selects from it: capture again"
        return "q, k and v were not all tensors"
    dtype = DTYPE_BY_TORCH_NAME.get(meta["tensors"]["q"]["dtype"])
    if dtype is None:
        return f"dtype {meta['tensors']['q']['dtype']} (attn-doctor checks bf16, fp16, fp32)"
    fields: dict[str, Any] = dict(dtype=dtype, seed=seed, replay=reference_of(root, call))
    api = meta["api"]
    try:
        if api == "torch.sdpa":
            reason = _sdpa_fields(call, shapes, fields)
        elif api in ("flash_attn.flash_attn_func", "flash_attn.flash_attn_varlen_func"):
            reason = _flash_fields(call, shapes, fields)
        elif api == "te.DotProductAttention":
            reason = _te_fields(call, shapes, fields)
        elif api == MEGATRON_API:
            reason = _megatron_fields(call, shapes, fields)
        elif api.startswith("module:"):
            reason = _module_fields(call, shapes, fields)
        else:
            reason = f"{api} (not replayed yet)"
    except UnexpectedShapes as exc:
        reason = str(exc)
    if reason is not None:
        return reason
    try:
        return make_case(**fields)
    except BadInput as exc:
        return str(exc)


def _sdpa_fields(call: CapturedCall, shapes: dict, fields: dict) -> str | None:
    """SDPA: [b, h, s, d] tensors; is_causal is top-left (TE's `causal`); attn_mask is a boolean mask (True =
    attend) or an additive float one, whose -inf entries are its mask and the rest its bias."""
    args = call.meta["arguments"]
    if args.get("dropout_p"):
        return f"dropout {args['dropout_p']} (attn-doctor compares deterministic calls)"
    fields.update(_dims(shapes, "bhsd"), qkv_format="bshd", mask="causal" if args.get("is_causal") else "no_mask",
                  scale=args.get("scale"))
    if args.get("attn_mask") is None:
        return None
    mask = captured_tensor(call, "attn_mask")
    if isinstance(mask, str):
        return mask
    hidden = ~sdpa_visible(mask)
    if hidden.any():
        if _per_head(hidden):
            return "a per-head attn_mask (attn-doctor's explicit mask is the same for every head)"
        fields.update(mask="arbitrary", mask_source="captured")
    if mask.is_floating_point() and bool(mask.masked_fill(hidden, 0).ne(0).any()):
        fields["bias"] = f"post_scale_bias:{_bias_shape(mask.shape)}"
    return None


def _flash_fields(call: CapturedCall, shapes: dict, fields: dict) -> str | None:
    """flash-attn: bshd tensors (varlen: thd with cu_seqlens); `causal` and the window are aligned to the
    bottom-right corner of each sequence's scores (flash-attn >= 2.1), TE's `*_bottom_right` masks."""
    args = call.meta["arguments"]
    if args.get("dropout_p"):
        return f"dropout {args['dropout_p']} (attn-doctor compares deterministic calls)"
    for name in ("alibi_slopes", "block_table"):
        if args.get(name) is not None:
            return f"flash-attn's {name} (not replayed yet)"
    if args.get("softcap"):
        return f"softcap {args['softcap']} (attn-doctor checks uncapped scores)"
    causal = bool(args.get("causal"))
    window = args.get("window_size")
    if window is not None and list(window) != [-1, -1]:
        fields["window"] = tuple(window)
    fields["scale"] = args.get("softmax_scale")
    if call.meta["api"].endswith("varlen_func"):
        reason = _thd_fields(call, shapes, fields, args.get("max_seqlen_q"), args.get("max_seqlen_k"))
        if reason is not None:
            return reason
        same = fields["seqlens"] == fields.get("seqlens_kv", fields["seqlens"])
        fields["mask"] = ("padding_causal" if same else "padding_causal_bottom_right") if causal else "padding"
        return None
    fields.update(_dims(shapes, "bshd"), qkv_format="bshd")
    fields["mask"] = ("causal" if fields["seq"] == fields["seq_kv"] else "causal_bottom_right") if causal else "no_mask"
    return None


def _te_fields(call: CapturedCall, shapes: dict, fields: dict) -> str | None:
    """TE's DotProductAttention: its format, mask type (lengths from cu_seqlens, or from a padding
    attention_mask's values), window, bias, softmax type, scale and FP8 recipe."""
    args, module = call.meta["arguments"], call.meta["arguments"].get("module", {})
    if args.get("inference_params") is not None:
        return "a KV cache (inference_params: attn-doctor checks training calls)"
    if module.get("attention_dropout"):
        return f"dropout {module['attention_dropout']} (attn-doctor compares deterministic calls)"
    fp8, reason = _fp8_recipe(module.get("fp8_recipe"))
    if reason is not None:
        return reason
    fmt = native_format(call)
    mask = _te_setting(call, "attn_mask_type") or "causal"
    window = _te_setting(call, "window_size")
    fields.update(mask=mask, qkv_format=fmt, softmax=module.get("softmax_type") or "vanilla", fp8=fp8,
                  scale=module.get("softmax_scale"))
    if window is not None and list(window) not in ([-1, -1], [-1, 0]):
        fields["window"] = tuple(window)
    bias_type = args.get("core_attention_bias_type") or "no_bias"
    if bias_type == "post_scale_bias" and isinstance(args.get("core_attention_bias"), dict):
        fields["bias"] = f"post_scale_bias:{_bias_shape(args['core_attention_bias']['tensor']['shape'])}"
    elif bias_type == "alibi":
        if args.get("alibi_slopes") is not None:
            return "ALiBi with its own slopes (attn-doctor uses TE's default slopes)"
        fields["bias"] = "alibi"
    elif bias_type != "no_bias":
        return f"core_attention_bias_type {bias_type} (not replayed yet)"
    if _te_setting(call, "bottom_right_diagonal") is False and mask not in ("causal", "padding_causal") and (
            "window" in fields or bias_type == "alibi"):
        return "bottom_right_diagonal=False with a window or ALiBi (attn-doctor aligns them as TE's default does)"
    if fmt == "thd":
        return _thd_fields(call, shapes, fields, args.get("max_seqlen_q"), args.get("max_seqlen_kv"))
    fields.update(_dims(shapes, fmt))
    if mask == "arbitrary":
        allowed = te_arbitrary_mask(call)
        if isinstance(allowed, str):
            return allowed
        fields["mask_source"] = "captured"
    elif mask.startswith("padding"):
        lengths = _te_padding_lengths(call)
        if isinstance(lengths, str):
            return lengths
        lengths_q, lengths_kv = lengths
        fields.update(seqlens=lengths_q, **({"seqlens_kv": lengths_kv} if lengths_kv != lengths_q else {}))
    return None


def _dims(shapes: dict, fmt: str) -> dict[str, int]:
    """The case's sizes from q, k, v's shapes in a padded format (bshd, sbhd or bhsd), as every API's reader
    takes them."""
    if any(len(shapes[name]) != len(fmt) for name in ("q", "k", "v")):
        raise UnexpectedShapes(f"q, k, v of shapes {shapes['q']}, {shapes['k']}, {shapes['v']}: not {fmt} as the "
                               "call's API and arguments say")
    q, k = (dict(zip(fmt, shapes[name])) for name in ("q", "k"))
    return dict(batch=q["b"], seq=q["s"], seq_kv=k["s"], heads=q["h"], kv_heads=k["h"], head_dim=q["d"],
                head_dim_v=shapes["v"][fmt.index("d")])


def _megatron_fields(call: CapturedCall, shapes: dict, fields: dict) -> str | None:
    """Megatron-Core's local core attention, as its settings at the call say it computes
    (`attn_doctor.tracing.clients`): sbhd tensors; its scale times its softmax's; its own sliding window, or
    the causal mask (the fused kernel's, or the type's when no mask is passed), or the mask passed (True =
    masked out). Megatron fills masked scores with -10000, which is the others' -inf wherever a row sees a key;
    a row that sees none it averages where every other path gives 0, so such a call is not replayed."""
    args, module = call.meta["arguments"], call.meta["arguments"].get("module", {})
    if "unreadable" in module:
        return f"Megatron's settings could not be read at the call ({module['unreadable']})"
    if module.get("attention_dropout"):
        return f"dropout {module['attention_dropout']} (attn-doctor compares deterministic calls)"
    for name in ("attention_bias", "packed_seq_params"):
        if args.get(name) is not None:
            return f"Megatron's {name} (its local attention refuses it too)"
    softmax = module.get("softmax_type") or "vanilla"
    if softmax == "learnable":
        return "learnable softmax offsets (their values are the model's parameters, not captured)"
    fields.update(_dims(shapes, "sbhd"), qkv_format="sbhd", softmax=softmax,
                  scale=module["softmax_scale"] * (module.get("softmax_coeff") or 1))
    window = module.get("window_size")
    if window is not None:  # Megatron's bottom-right sliding window replaces the mask
        left, right = window
        causal = "causal" if fields["seq"] == fields["seq_kv"] else "causal_bottom_right"
        fields.update(mask=causal if right == 0 else "no_mask", window=(left, right))
        return None
    causal_type = module.get("attn_mask_type") == "causal"
    if causal_type and (module.get("fused_softmax") or args.get("attention_mask") is None):
        fields["mask"] = "causal"  # the fused causal kernel ignores the mask passed
        return None
    if args.get("attention_mask") is None:
        fields["mask"] = "no_mask"
        return None
    allowed = te_arbitrary_mask(call)  # the same convention as TE's: True = masked out
    if isinstance(allowed, str):
        return allowed.replace("an arbitrary attention_mask", "a Megatron attention_mask")
    rows = allowed.reshape([1] * (4 - allowed.dim()) + list(allowed.shape)).expand(
        fields["batch"], 1, fields["seq"], fields["seq_kv"])
    if not bool(rows.any(-1).all()):
        return ("rows that see no key (Megatron's -10000 fill averages them where every other path gives 0: "
                "not one computation)")
    top_left = torch.ones(fields["seq"], fields["seq_kv"], dtype=torch.bool).tril()
    if torch.equal(rows, top_left.expand_as(rows)):
        fields["mask"] = "causal"
    else:
        fields.update(mask="arbitrary", mask_source="captured")
    return None


def _module_fields(call: CapturedCall, shapes: dict, fields: dict) -> str | None:
    """A module named with `--module`: softmax(scale q k^T + a top-left causal mask when `causal`) v, in its
    layout (`attn_doctor.tracing.clients.ModuleSpec`); its other arguments are recorded, not replayed."""
    settings = call.meta["arguments"].get("module", {})
    layout = settings.get("layout") or "bshd"
    if any(len(shapes[name]) != 4 for name in "qkv"):
        return "q, k and v are not all 4-dimensional (the heads apart)"
    fields.update(_dims(shapes, layout), qkv_format="sbhd" if layout == "sbhd" else "bshd",
                  mask="causal" if settings.get("causal") else "no_mask", scale=settings.get("softmax_scale"))
    return None


def _thd_fields(call: CapturedCall, shapes: dict, fields: dict, max_q: int | None,
                max_kv: int | None) -> str | None:
    """A packed call's sequences: lengths from cu_seqlens, slots from the padded offsets (`packed_offsets`);
    every token of the packed tensors must sit in a sequence's slot."""
    sides = {}
    offsets_by_side = packed_offsets(call)
    for side, tokens, longest in (("q", shapes["q"][0], max_q), ("kv", shapes["k"][0], max_kv)):
        offsets, slot_offsets = offsets_by_side[side]
        if offsets is None:
            return f"thd without the values of cu_seqlens_{side}"
        lengths, slots = lengths_of(offsets), lengths_of(slot_offsets)
        if len(slots) != len(lengths) or slot_offsets[0] != 0 or any(n > m for n, m in zip(lengths, slots)):
            return f"cu_seqlens_{side}_padded {slot_offsets} that do not hold the sequences {offsets}"
        if slot_offsets[-1] != tokens:
            return (f"{tokens} {side} tokens, {slot_offsets[-1]} of them in sequences (tokens past the last sequence "
                    "are not replayed yet)")
        sides[side] = (lengths, slots, max(longest or 0, max(slots, default=0), 1))
    (lengths_q, slots_q, seq), (lengths_kv, slots_kv, seq_kv) = sides["q"], sides["kv"]
    (_, h, d), (_, hkv, _), dv = shapes["q"], shapes["k"], shapes["v"][-1]
    fields.update(batch=len(lengths_q), seq=seq, seq_kv=seq_kv, heads=h, kv_heads=hkv, head_dim=d, head_dim_v=dv,
                  qkv_format="thd", seqlens=lengths_q, pad_between_seqs=slots_q != lengths_q or slots_kv != lengths_kv)
    if lengths_kv != lengths_q or seq_kv != seq:
        fields["seqlens_kv"] = lengths_kv
    return None


def _fp8_recipe(recipe: Any) -> tuple[str, str | None]:
    """attn-doctor's FP8 recipe for TE's (as the capture recorded it), or why it is not one attn-doctor runs.
    FP8 attention needs fp8_dpa: under any other recipe TE's attention runs in the inputs' dtype."""
    if not recipe:
        return "none", None
    if not isinstance(recipe, dict):
        return "none", "FP8 recorded by an older attn-doctor (capture again to replay it)"
    if not recipe.get("fp8_dpa"):
        return "none", None
    kind = {"DelayedScaling": "delayed", "Float8CurrentScaling": "current"}.get(recipe.get("type"))
    if kind is None:
        return "none", f"FP8 recipe {recipe.get('type')} (attn-doctor runs DelayedScaling and Float8CurrentScaling)"
    if recipe.get("format") not in (None, "HYBRID") or recipe.get("margin") not in (None, 0):
        return "none", (f"FP8 format {recipe.get('format')}, margin {recipe.get('margin')} (attn-doctor runs "
                        "TE's default HYBRID, margin 0)")
    return kind, None


def _bias_shape(shape: list[int]) -> str:
    """TE's name for the shape of an additive bias [b|1, h|1, s|1, s_kv] (SDPA's float masks broadcast like
    it), widened to the nearest shape TE takes (b11s as b1ss: the captured values are expanded)."""
    shape = [1] * (4 - len(shape)) + list(shape)
    name = "".join(c if n > 1 else "1" for c, n in zip("bhs", shape[:3])) + "s"
    return {"b11s": "b1ss", "1h1s": "1hss", "bh1s": "bhss"}.get(name, name)


def sdpa_visible(mask: torch.Tensor) -> torch.Tensor:
    """The pairs SDPA's attn_mask lets through: True in a boolean mask, every entry but -inf in a float one."""
    return mask if mask.dtype == torch.bool else mask != -math.inf


def _per_head(hidden: torch.Tensor) -> bool:
    full = hidden.reshape([1] * (4 - hidden.dim()) + list(hidden.shape))
    return full.shape[1] > 1 and bool((full != full[:, :1]).any())


def captured_tensor(call: CapturedCall, name: str) -> torch.Tensor | str:
    """An argument's captured values, or why they are missing."""
    if call.values_path is None:
        return f"{'an' if name[0] in 'aeiou' else 'a'} {name} whose values were not captured (capture with --values)"
    values = load_values(call.values_path, lambda key: key == f"arg.{name}" or key.startswith(f"arg.{name}."))
    if f"arg.{name}" in values:
        return values[f"arg.{name}"]
    parts = [values[key] for key in sorted(values)]
    return parts if parts else f"{name} whose values were not captured"


def te_arbitrary_mask(call: CapturedCall) -> torch.Tensor | str:
    """TE's arbitrary attention_mask (True = masked out) as the pairs it lets through."""
    mask = captured_tensor(call, "attention_mask")
    if isinstance(mask, str):
        return mask
    if isinstance(mask, list) or mask.dtype != torch.bool:
        return "an arbitrary attention_mask that is not one boolean tensor"
    if _per_head(mask):
        return "a per-head attention_mask (attn-doctor's explicit mask is the same for every head)"
    return ~mask


def _te_padding_lengths(call: CapturedCall) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """The sequence lengths of a padded sbhd/bshd TE call: from cu_seqlens, or from its attention_mask (one
    [b, 1, 1, s] mask, or one for the queries and one for the keys; True = padding). TE's fused and flash paths
    read only how many tokens each mask lets through, so a mask must be right padding to mean one call."""
    args = call.meta["arguments"]
    lengths_q = lengths_of(_offsets(args.get("cu_seqlens_q")))
    if lengths_q is not None:
        return lengths_q, lengths_of(_offsets(args.get("cu_seqlens_kv"))) or lengths_q
    if args.get("attention_mask") is None:
        return "a padding mask without cu_seqlens or attention_mask"
    masks = captured_tensor(call, "attention_mask")
    if isinstance(masks, str):
        return masks
    masks = masks if isinstance(masks, list) else [masks, masks]
    lengths = []
    for mask in masks:
        kept = ~mask.reshape(mask.shape[0], -1)
        counts = kept.sum(-1)
        if not torch.equal(kept, torch.arange(kept.shape[1])[None, :] < counts[:, None]):
            return "a padding attention_mask that is not right padding (TE's fused paths read only its counts)"
        lengths.append(tuple(int(n) for n in counts))
    return lengths[0], lengths[1]


def case_of_reference(reference: str) -> Case:
    """The case of the call `reference` names (bad input when it cannot be replayed)."""
    check_input(capture_of(reference), "--replay", "folder")
    call = load_call(reference)
    case = call.values_problem() or case_of(call, capture_of(reference))
    if isinstance(case, str):
        raise BadInput(f"--replay {reference}: this call cannot be replayed: {case}")
    return case


def values_source(call: CapturedCall) -> str:
    """Where a replay of the call takes its numbers from, in words (`captured_inputs`)."""
    if call.values_path is not None:
        return "captured values" if call.dout_path is not None else "captured q, k, v, seeded output gradient"
    return "seeded values" + (" (through the shared storage)" if shares_storage(call) else "")


def shares_storage(call: CapturedCall) -> bool:
    ids = [call.meta["tensors"][name]["storage"]["id"] for name in "qkv"]
    return len(set(ids)) < 3


def check_captured_shapes(case: Case) -> None:
    """A replayed call keeps its captured shapes (its values and views have them): a case that names a call
    but was given other shapes (`run --replay REF --seq N`) is bad input."""
    call = load_call(case.replay)
    if native_format(call) != "thd" and math.prod(call.meta["tensors"]["q"]["shape"]) != (
            case.batch * case.seq * case.heads * case.head_dim):
        raise BadInput("a replayed call keeps its captured shapes; drop --replay to change them")
