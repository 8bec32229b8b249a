"""A replayed call's numbers while probes run: the `Source` (`attn_doctor.numerics.source`) of every case that
names a captured call, fed the captured values when they were recorded (seeded ones otherwise) and, on the
`captured` layout, the call's exact memory: every tensor a view with the captured shape, strides and storage
offset into a storage of the captured size, q, k, v sharing one storage when they did. A path that takes
another format than the captured call's gets the same values on the other layouts. The worker process hands
`source_of` to the probes; the case itself comes from `attn_doctor.tracing.replay_case`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from attn_doctor.backends.base import Unsupported
from attn_doctor.core import layouts
from attn_doctor.core.case import Case
from attn_doctor.numerics import views
from attn_doctor.numerics.source import SEEDED, Slots, Source
from attn_doctor.numerics.standalone import TORCH_DTYPES
from attn_doctor.numerics.views import QKV
from attn_doctor.tracing.clients import MEGATRON_API
from attn_doctor.tracing.replay_case import (
    captured_tensor,
    lengths_of,
    load_call,
    native_format,
    packed_offsets,
    sdpa_visible,
    shares_storage,
    te_arbitrary_mask,
)
from attn_doctor.tracing.store import CapturedCall, load_values


def captured_slots(case: Case) -> Slots | None:
    """A replayed thd call's own slots (query side, key side: its padded offsets' differences) where its
    packed tensors have padding between sequences; None where each slot is its sequence (the case's)."""
    if not case.pad_between_seqs:
        return None
    offsets = packed_offsets(load_call(case.replay))
    return lengths_of(offsets["q"][1]), lengths_of(offsets["kv"][1])


def captured_packing(case: Case) -> layouts.Packing:
    """Where a replayed thd call's tokens sit in its packed tensors: its sequences in its own slots."""
    return layouts.packing(case, captured_slots(case))


def captured_mask(case: Case, device: torch.device) -> torch.Tensor:
    """The call's explicit mask as attn-doctor's allowed pairs [b, 1, s, s_kv] (True = attend): SDPA's boolean
    attn_mask, the finite entries of its float one, or the complement of TE's arbitrary attention_mask."""
    call = load_call(case.replay)
    if call.meta["api"] in ("te.DotProductAttention", MEGATRON_API):  # True = masked out
        allowed = te_arbitrary_mask(call)
    else:
        allowed = sdpa_visible(captured_tensor(call, "attn_mask"))
    allowed = allowed.to(device)
    allowed = allowed.reshape([1] * (4 - allowed.dim()) + list(allowed.shape))[:, :1]
    return allowed.expand(case.batch, 1, case.seq, case.seq_kv).clone()


def captured_bias(case: Case, device: torch.device) -> torch.Tensor | None:
    """The call's additive bias in the shape of `case.bias` and the inputs' dtype (SDPA's float attn_mask
    with its -inf entries zeroed, or TE's core_attention_bias), or None when its values were not recorded
    (a seeded bias of its shape stands in, as seeded q, k, v do)."""
    call = load_call(case.replay)
    name = "core_attention_bias" if call.meta["api"] == "te.DotProductAttention" else "attn_mask"
    bias = captured_tensor(call, name)
    if not isinstance(bias, torch.Tensor):
        return None
    bias = bias.masked_fill(~sdpa_visible(bias), 0).to(device)  # the masked pairs are the mask's
    bias = bias.reshape([1] * (4 - bias.dim()) + list(bias.shape))
    return bias.expand(case.bias_shape).to(TORCH_DTYPES[case.dtype]).clone()


def captured_inputs(case: Case, device: torch.device) -> tuple[torch.Tensor, ...] | None:
    """q, k, v and dout (bshd, on `device`) as the call saw them, or None when the plain seeded inputs stand in.

    - Recorded values come back as they were; a packed (thd) call's tokens at their sequences' places in the
      padded tensors, slot padding too. A call whose backward was not recorded gets a seeded output gradient.
    - Without values, q, k, v that share a storage are read through their views from one seeded storage, so
      views that alias (q is k, overlapping slices) hold the same numbers, as they did in the run."""
    call = load_call(case.replay)
    fmt = native_format(call)
    if call.values_path is not None:
        values = load_values(call.values_path, lambda key: key in ("q", "k", "v"))
        q, k, v = values["q"], values["k"], values["v"]
    elif shares_storage(call):
        q, k, v = _seeded_through_storages(case, call)
    else:
        return None
    packed = captured_packing(case) if fmt == "thd" else None
    native_q = q
    q, k, v = (as_bshd(t.to(device), fmt, packed, side) for t, side in ((q, "q"), (k, "kv"), (v, "kv")))
    if call.dout_path is not None:
        dout = as_bshd(with_heads(load_values(call.dout_path)["dout"], native_q).to(device), fmt, packed, "q")
    else:
        generator = torch.Generator(device=device).manual_seed(case.seed + 1)
        dout = torch.randn(case.batch, case.seq, case.heads, case.head_dim_v, generator=generator,
                           device=device).to(TORCH_DTYPES[case.dtype])
    return q, k, v, dout


def _storage_views(call: CapturedCall, dtype: torch.dtype,
                   new_storage: Callable[[int], torch.Tensor]) -> tuple[dict[int, torch.Tensor], list[torch.Tensor]]:
    """The call's q, k, v views (exact shapes, strides, storage offsets) into one new storage per captured
    storage id, of its captured size (`new_storage(elements)`, made in q, k, v's order); and those storages."""
    element = torch.empty((), dtype=dtype).element_size()
    storages: dict[int, torch.Tensor] = {}
    placed = []
    for name in "qkv":
        meta = call.meta["tensors"][name]
        sid = meta["storage"]["id"]
        if sid not in storages:
            storages[sid] = new_storage(meta["storage"]["nbytes"] // element)
        placed.append(storages[sid].as_strided(meta["shape"], meta["stride"], meta["storage_offset"]))
    return storages, placed


def _seeded_through_storages(case: Case, call: CapturedCall) -> list[torch.Tensor]:
    """q, k, v read through the call's views from standard-normal storages of the captured sizes (seeded)."""
    generator = torch.Generator().manual_seed(case.seed)
    dtype = TORCH_DTYPES[case.dtype]
    _, placed = _storage_views(call, dtype, lambda elements: torch.randn(elements, generator=generator).to(dtype))
    return [view.clone() for view in placed]


def as_bshd(t: torch.Tensor, fmt: str, packed: layouts.Packing | None = None, side: str = "q") -> torch.Tensor:
    """A captured tensor in its call's format (`native_format`) as bshd (thd: scattered by `packed`)."""
    return t.transpose(1, 2) if fmt == "bhsd" else views.to_bshd(t, fmt, packed, side)


def with_heads(t: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """An output (or its gradient) in q's layout with its own head dim: TE returns heads flattened, [s, b, h*dv]."""
    return t.reshape(*q.shape[:-1], -1)


def captured_views(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str) -> QKV:
    """q, k, v (bshd values) as views with the call's exact shapes, strides and storage offsets into storages
    of the captured sizes, presented in `fmt` (SDPA's bhsd views are presented as their bshd transposes, so a
    path that takes bshd and transposes, as SDPA's do, hands the kernel the captured views; a packed call's
    views hold its tokens where the capture had them)."""
    call = load_call(case.replay)
    native = native_format(call)
    presented = "bshd" if native == "bhsd" else native
    if presented != fmt:
        raise Unsupported(f"the captured views are {native}; this path takes {fmt} (its other layouts have the "
                          "same values)")
    packed = captured_packing(case) if native == "thd" else None
    dtype = TORCH_DTYPES[case.dtype]
    storages, placed = _storage_views(call, dtype, lambda elements: torch.zeros(elements, dtype=dtype, device=q.device))
    for view, values, side in zip(placed, (q, k, v), ("q", "kv", "kv")):
        with torch.no_grad():
            view.copy_(values.permute(0, 2, 1, 3) if native == "bhsd" else views.to_format(values, native, packed,
                                                                                              side))
    leaves = {sid: buffer.requires_grad_() for sid, buffer in storages.items()}
    placed = [leaves[call.meta["tensors"][name]["storage"]["id"]].as_strided(
        view.shape, view.stride(), view.storage_offset()) for name, view in zip("qkv", placed)]
    if native == "bhsd":
        placed = [view.transpose(1, 2) for view in placed]
    return QKV(*placed, leaves=tuple(leaves.values()))


def captured_dout(case: Case, dout: torch.Tensor) -> torch.Tensor | None:
    """The output gradient (`dout`: bshd values) as a view with the geometry the call's backward got in the run
    (the captured dO's shape, strides and storage offset, into a storage of its captured size), presented in the
    format `captured_views` presents q, k, v in: the path's backward then reads it as the run's kernel did (a
    dO whose layout differs from out's is a known way to get wrong gradients). None when the capture has no dO
    geometry (no backward reached the call, or an older capture) or one that cannot hold these values (an
    expanded dO, whose elements share memory, holds one value per broadcast row), and for thd calls: their dO
    stands contiguous."""
    call = load_call(case.replay)
    meta = call.meta["tensors"].get("dout")
    native = native_format(call)
    dtype = TORCH_DTYPES[case.dtype]
    if meta is None or native == "thd" or meta["dtype"] != str(dtype).removeprefix("torch."):
        return None
    values = dout.permute(0, 2, 1, 3) if native == "bhsd" else views.to_format(dout, native)
    element = torch.empty((), dtype=dtype).element_size()
    storage = torch.zeros(meta["storage"]["nbytes"] // element, dtype=dtype, device=dout.device)
    try:
        view = storage.as_strided(meta["shape"], meta["stride"], meta["storage_offset"])
        if view.dim() == values.dim() - 1:  # TE's heads flattened, [b, s, h*d]: split as its backward does
            view = view.unflatten(-1, values.shape[-2:])
        if view.shape != values.shape:
            return None
        view.copy_(values)
    except RuntimeError:  # outside its storage, or elements sharing memory (the expanded gradient of a sum),
        return None  # which cannot hold these values
    return view.transpose(1, 2) if native == "bhsd" else view


def dout_unlike_out(case: Case) -> bool:
    """Whether the captured layout hands the call's backward a dO strided unlike its out (`captured_dout`): the
    condition of known defects (a kernel reading dO with O's strides). Dims of size 1 have no stride that counts;
    an expanded dO (a zero stride) stands contiguous in a replay, so it is not."""
    call = load_call(case.replay)
    dout, out = call.meta["tensors"].get("dout"), call.meta["tensors"].get("out")
    if dout is None or out is None or native_format(call) == "thd" or dout["shape"] != out["shape"]:
        return False
    counted = [(a, b) for size, a, b in zip(dout["shape"], dout["stride"], out["stride"]) if size > 1]
    return all(a != 0 for a, _ in counted) and any(a != b for a, b in counted)


def view_geometry(t: torch.Tensor) -> dict[str, Any]:
    """What replay promises to reproduce of a captured tensor (compare with its metadata)."""
    return {"shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
            "storage_nbytes": t.untyped_storage().nbytes()}


class CapturedSource:
    """The `Source` of replayed cases: each answer read from the capture the case names."""

    values = staticmethod(captured_inputs)
    allowed = staticmethod(captured_mask)
    bias = staticmethod(captured_bias)
    slots = staticmethod(captured_slots)
    views = staticmethod(captured_views)
    dout = staticmethod(captured_dout)


CAPTURED_SOURCE = CapturedSource()


def source_of(case: Case) -> Source:
    """Where a case's numbers come from: its capture when it replays a call, else its seed."""
    return SEEDED if case.replay is None else CAPTURED_SOURCE
