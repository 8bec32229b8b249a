"""How attn-doctor calls Transformer Engine's DotProductAttention, from a case's plain values (`Case.plain()`):
the module's arguments, the forward's, the learnable sink and the FP8 autocast.

The TE backend (`attn_doctor.backends.te`) calls these, and the standalone repro script of a TE path holds
this module's source (`attn_doctor.bisect.repro`), so both call TE alike. Like
`attn_doctor.numerics.standalone` it imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import importlib

import torch


def module_arguments(case: dict) -> dict:
    """DotProductAttention's constructor arguments for a case (no dropout), before any TP/CP ones. attention_type
    is "cross" whenever query and key lengths differ: under "self" TE reads one padding mask for both and its
    flash path reuses cu_seqlens_q for the keys."""
    head_dim, head_dim_v = case["head_dim"], case["head_dim_v"]
    arguments = dict(
        num_attention_heads=case["heads"],
        kv_channels=(head_dim, head_dim_v) if head_dim_v != head_dim else head_dim,
        num_gqa_groups=case["kv_heads"],
        attention_dropout=0.0,
        qkv_format=case["qkv_format"],
        attn_mask_type=case["mask"],
        window_size=None if case["window"] is None else tuple(case["window"]),
        softmax_scale=case["scale"],
    )
    if case["seq"] != case["seq_kv"] or list(case["lengths_q"]) != list(case["lengths_kv"]):
        arguments["attention_type"] = "cross"
    if case["softmax"] != "vanilla":
        arguments["softmax_type"] = case["softmax"]
    return arguments


def forward_arguments(case: dict, cu_seqlens: dict[str, list[int]], explicit: torch.Tensor | None,
                      bias: torch.Tensor | None, device: torch.device | str) -> dict:
    """DotProductAttention.forward's keyword arguments for the case's lengths (`cu_seqlens`: TE's cu_seqlens_q,
    _kv and their _padded offsets, by name), explicit mask (True = visible; TE's is True = masked out) and
    bias (post_scale_bias; ALiBi is TE's own)."""
    arguments = {}
    if case["mask"].startswith("padding"):  # every format (seen on the H200 to work for sbhd on every TE path)
        taken = [name for name in cu_seqlens if case["pad_between_seqs"] or not name.endswith("_padded")]
        arguments.update({name: torch.tensor(cu_seqlens[name], dtype=torch.int32, device=device) for name in taken})
        arguments.update(max_seqlen_q=case["seq"], max_seqlen_kv=case["seq_kv"])
        if case["pad_between_seqs"]:
            arguments["pad_between_seqs"] = True
    if explicit is not None:
        arguments["attention_mask"] = ~explicit
    if case["bias"] == "alibi":
        arguments["core_attention_bias_type"] = "alibi"
    elif bias is not None:
        arguments.update(core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    return arguments


def load_sink(module: torch.nn.Module, sink: torch.Tensor) -> torch.Tensor:
    """The learnable sink logits copied into TE's own `softmax_offset` parameter, which is what TE uses and
    differentiates (returned: the tensor whose gradient is dsink)."""
    with torch.no_grad():
        module.softmax_offset.copy_(sink.detach().to(module.softmax_offset.dtype))
    module.softmax_offset.grad = None
    return module.softmax_offset


def fp8_autocast(te_module, recipe_name: str):
    """TE's autocast with FP8 attention on (fp8_dpa) for `recipe_name` ("delayed" or "current"); nothing for
    "none"."""
    if recipe_name == "none":
        return contextlib.nullcontext()
    recipes = importlib.import_module("transformer_engine.common.recipe")
    recipe = (recipes.DelayedScaling(fp8_dpa=True) if recipe_name == "delayed"
              else recipes.Float8CurrentScaling(fp8_dpa=True))
    if hasattr(te_module, "autocast"):
        return te_module.autocast(enabled=True, recipe=recipe)
    return te_module.fp8_autocast(enabled=True, fp8_recipe=recipe)
