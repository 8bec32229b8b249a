"""Replaying captured calls: each distinct call becomes a case (its shapes, dtype, mask, window, lengths, kv
heads) that names the call (`Case.replay`), fed the captured values when they were recorded (seeded ones
otherwise) and, on the `captured` layout, the call's exact memory: every tensor a view with the captured
shape, strides and storage offset into a storage of the captured size, q, k, v sharing one storage when they
did. A path that takes another format than the captured call's gets the same values on the other layouts.

SDPA's boolean attn_mask (the same for every head) becomes an `arbitrary` mask whose source is the captured one.
Calls this cannot express yet are named with the reason (`case_of` returns a string): float or per-head SDPA
masks, dropout, a non-default softmax scale, TE biases and FP8.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

from attn_doctor.core.case import Case, make_case
from attn_doctor.core.errors import BadInput
from attn_doctor.core.layouts import QKV
from attn_doctor.numerics.inputs import TORCH_DTYPES
from attn_doctor.tracing.store import CapturedCall, load_values, read_capture

DTYPES = {str(dtype).removeprefix("torch."): name for name, dtype in TORCH_DTYPES.items()}  # "bfloat16" -> bf16


def reference_of(root: Path, call: CapturedCall) -> str:
    """The `Case.replay` text naming a call: DIR@RANK.PID.INDEX."""
    return f"{Path(root).resolve()}@{call.rank}.{call.meta['process']['pid']}.{call.index}"


@functools.lru_cache(maxsize=64)
def _calls(root: str) -> dict[tuple[int, int, int], CapturedCall]:
    return {(c.rank, c.meta["process"]["pid"], c.index): c for c in read_capture(Path(root))}


def load_call(reference: str) -> CapturedCall:
    root, _, ident = reference.rpartition("@")
    try:
        key = tuple(int(part) for part in ident.split("."))
        return _calls(root)[key]
    except (ValueError, KeyError):
        raise BadInput(f"--replay {reference!r} names no call of a capture (DIR@RANK.PID.INDEX, as `attn-doctor "
                       "replay` writes it)") from None


def native_format(call: CapturedCall) -> str:
    """The layout of the call's q, k, v: SDPA's [b, h, s, d] (`bhsd`), flash-attn's bshd, TE's qkv_format."""
    if call.meta["api"] == "torch.sdpa":
        return "bhsd"
    if call.meta["api"].startswith("flash_attn."):
        return "bshd"
    return _te_setting(call, "qkv_format") or "sbhd"


def _te_setting(call: CapturedCall, name: str) -> Any:
    value = call.meta["arguments"].get(name)
    return value if value is not None else call.meta["arguments"].get("module", {}).get(name)


def _lengths(argument: Any) -> tuple[int, ...] | None:
    if not isinstance(argument, dict) or "values" not in argument:
        return None
    offsets = argument["values"]
    return tuple(b - a for a, b in zip(offsets, offsets[1:]))


def case_of(call: CapturedCall, root: Path, seed: int = 1234) -> Case | str:
    """The case a captured call asks, or why it cannot be replayed yet."""
    meta, args = call.meta, call.meta["arguments"]
    shapes = {name: meta["tensors"][name]["shape"] for name in ("q", "k", "v") if name in meta["tensors"]}
    if set(shapes) != {"q", "k", "v"}:
        return "q, k and v were not all tensors"
    dtype = DTYPES.get(meta["tensors"]["q"]["dtype"])
    if dtype is None:
        return f"dtype {meta['tensors']['q']['dtype']} (attn-doctor checks bf16, fp16, fp32)"
    fields: dict[str, Any] = dict(dtype=dtype, seed=seed, replay=reference_of(root, call))
    fmt = native_format(call)
    if meta["api"] == "torch.sdpa":
        if args.get("attn_mask") is not None:
            reason = _mask_unsupported(call)
            if reason:
                return reason
            fields.update(mask_source="captured")
        if args.get("dropout_p"):
            return f"dropout {args['dropout_p']} (attn-doctor compares deterministic calls)"
        scale = args.get("scale")
        (b, h, s, d), (_, hkv, skv, _), dv = shapes["q"], shapes["k"], shapes["v"][-1]
        mask = "arbitrary" if "mask_source" in fields else "causal" if args.get("is_causal") else "no_mask"
        fields.update(mask=mask, qkv_format="bshd")
    elif meta["api"].startswith("flash_attn.") and meta["api"].endswith("flash_attn_func"):
        if args.get("dropout_p"):
            return f"dropout {args['dropout_p']} (attn-doctor compares deterministic calls)"
        scale = args.get("softmax_scale")
        (b, s, h, d), (_, skv, hkv, _), dv = shapes["q"], shapes["k"], shapes["v"][-1]
        window = args.get("window_size")
        fields.update(mask="causal" if args.get("causal") else "no_mask", qkv_format="bshd")
        if window is not None and list(window) != [-1, -1]:
            fields["window"] = tuple(window)
    elif meta["api"] == "te.DotProductAttention":
        module = args.get("module", {})
        if args.get("core_attention_bias_type") not in (None, "no_bias") or args.get("attention_mask") is not None:
            return "a TE bias or explicit attention_mask (not replayed yet)"
        if module.get("fp8_recipe"):
            return "FP8 (not replayed yet)"
        if args.get("bottom_right_diagonal") is not None or args.get("qkv_layer") is not None or args.get(
                "kv_layer") is not None:
            return "bottom_right_diagonal or packed qkv_layer/kv_layer arguments (not replayed yet)"
        if module.get("attention_dropout"):
            return f"dropout {module['attention_dropout']} (attn-doctor compares deterministic calls)"
        scale = module.get("softmax_scale")
        mask = _te_setting(call, "attn_mask_type") or "causal"
        window = _te_setting(call, "window_size")
        fields.update(mask=mask, qkv_format=fmt, softmax=module.get("softmax_type") or "vanilla")
        if window is not None and list(window) not in ([-1, -1], [-1, 0]):
            fields["window"] = tuple(window)
        lengths_q, lengths_kv = _lengths(args.get("cu_seqlens_q")), _lengths(args.get("cu_seqlens_kv"))
        if fmt == "thd":
            if lengths_q is None:
                return "thd without cu_seqlens_q"
            (_, h, d), (_, hkv, _), dv = shapes["q"], shapes["k"], shapes["v"][-1]
            b, s = len(lengths_q), args.get("max_seqlen_q") or max(lengths_q)
            skv = args.get("max_seqlen_kv") or max(lengths_kv or lengths_q)
        else:
            order = (1, 0) if fmt == "sbhd" else (0, 1)
            b, s = (shapes["q"][i] for i in order)
            skv = shapes["k"][order[1]]
            h, d, hkv, dv = shapes["q"][2], shapes["q"][3], shapes["k"][2], shapes["v"][3]
        if mask.startswith("padding") and lengths_q is not None:
            fields.update(seqlens=lengths_q, **({"seqlens_kv": lengths_kv} if lengths_kv != lengths_q else {}))
    else:
        return f"{meta['api']} (not replayed yet)"
    if scale is not None and not math.isclose(scale, d ** -0.5, rel_tol=1e-6):
        return f"softmax scale {scale} (attn-doctor uses 1/sqrt(head_dim) = {d ** -0.5:.6g})"
    fields.update(batch=b, seq=s, seq_kv=skv, heads=h, kv_heads=hkv, head_dim=d, head_dim_v=dv)
    try:
        return make_case(**fields)
    except BadInput as exc:
        return str(exc)


def case_of_reference(reference: str) -> Case:
    """The case of the call `reference` names (bad input when it cannot be replayed)."""
    call = load_call(reference)
    case = case_of(call, Path(reference.rpartition("@")[0]))
    if isinstance(case, str):
        raise BadInput(f"--replay {reference}: this call cannot be replayed yet: {case}")
    return case


def _mask_unsupported(call: CapturedCall) -> str | None:
    """Why SDPA's attn_mask of this call cannot be replayed (None: it can: a boolean mask, the same for every
    head, whose values were captured)."""
    tensor = call.meta["arguments"]["attn_mask"].get("tensor", {})
    if tensor.get("dtype") != "bool":
        return "a float attn_mask (an additive bias: not replayed yet)"
    shape = [1] * (4 - len(tensor["shape"])) + tensor["shape"]
    if shape[1] != 1:
        return "a per-head attn_mask (not replayed yet)"
    if call.values_path is None:
        return "an attn_mask whose values were not captured (capture with --values)"
    return None


def captured_mask(case: Case, device: torch.device) -> torch.Tensor:
    """The call's attn_mask as attn-doctor's allowed pairs [b, 1, s, s_kv] (SDPA's True = attend)."""
    call = load_call(case.replay)
    mask = load_values(call.values_path)["arg.attn_mask"].to(device)
    mask = mask.reshape([1] * (4 - mask.dim()) + list(mask.shape))
    return mask.expand(case.batch, 1, case.seq, case.seq_k).clone()


def _to_bshd(t: torch.Tensor, fmt: str) -> torch.Tensor:
    return {"bhsd": lambda x: x.transpose(1, 2), "bshd": lambda x: x, "sbhd": lambda x: x.transpose(0, 1)}[fmt](t)


def captured_inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """q, k, v and dout (bshd, on `device`) as the call saw them, or None when its values were not recorded
    (or are not in a padded format: thd values are not replayed yet)."""
    call = load_call(case.replay)
    fmt = native_format(call)
    if call.values_path is None or call.dout_path is None or fmt == "thd":
        return None
    values, dout = load_values(call.values_path), load_values(call.dout_path)["dout"]
    dout = with_heads(dout, values["q"])
    return tuple(_to_bshd(t, fmt).to(device) for t in (values["q"], values["k"], values["v"], dout))


def with_heads(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """An output (or its gradient) in q's layout with its own head dim: TE returns heads flattened, [s, b, h*dv]."""
    return t.reshape(*q.shape[:-1], -1)


def captured_views(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str) -> QKV:
    """q, k, v (bshd values) as views with the call's exact shapes, strides and storage offsets into storages
    of the captured sizes, presented in `fmt` (SDPA's bhsd views are presented as their bshd transposes, so a
    path that takes bshd and transposes, as SDPA's do, hands the kernel the captured views)."""
    from attn_doctor.backends import Unsupported

    call = load_call(case.replay)
    native = native_format(call)
    presented = "bshd" if native == "bhsd" else native
    if native == "thd":
        raise Unsupported("a captured thd call's packed views are not rebuilt yet (its contiguous row has its shapes)")
    if presented != fmt:
        raise Unsupported(f"the captured views are {native}; this path takes {fmt} (its other layouts have the "
                          "same values)")
    storages: dict[int, torch.Tensor] = {}
    views = []
    dtype = TORCH_DTYPES[case.dtype]
    element = torch.empty((), dtype=dtype).element_size()
    for name, values in (("q", q), ("k", k), ("v", v)):
        meta = call.meta["tensors"][name]
        sid = meta["storage"]["id"]
        if sid not in storages:
            storages[sid] = torch.zeros(meta["storage"]["nbytes"] // element, dtype=dtype, device=q.device)
        view = storages[sid].as_strided(meta["shape"], meta["stride"], meta["storage_offset"])
        with torch.no_grad():
            view.copy_(values.permute(0, 2, 1, 3) if native == "bhsd" else values.transpose(0, 1)
                       if native == "sbhd" else values)
        views.append(view)
    leaves = {sid: buffer.requires_grad_() for sid, buffer in storages.items()}
    views = [leaves[call.meta["tensors"][name]["storage"]["id"]].as_strided(
        view.shape, view.stride(), view.storage_offset()) for name, view in zip("qkv", views)]
    if native == "bhsd":
        views = [view.transpose(1, 2) for view in views]
    return QKV(*views, leaves=tuple(leaves.values()))


def view_geometry(t: torch.Tensor) -> dict[str, Any]:
    """What replay promises to reproduce of a captured tensor (compare with its metadata)."""
    return {"shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
            "storage_nbytes": t.untyped_storage().nbytes()}
