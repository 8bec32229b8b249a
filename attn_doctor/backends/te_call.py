"""How attn-doctor calls Transformer Engine's DotProductAttention, from a case's plain values (`Case.plain()`):
the module's arguments, the forward's (lengths, masks, bias, custom ALiBi slopes, num_splits), the learnable sink,
the FP8 autocast and the FP8 backward's variable.

The TE backend (`attn_doctor.backends.te`) calls these, and the standalone repro script of a TE path holds
this module's source (`attn_doctor.bisect.repro`), so both call TE alike. Like
`attn_doctor.numerics.standalone` it imports torch and the standard library only.
"""

from __future__ import annotations

import contextlib
import importlib

import torch


def is_cross(case: dict) -> bool:
    """TE's attention_type "cross": query and key lengths differ (under "self" TE reads one padding mask for both
    and its flash path reuses cu_seqlens_q for the keys)."""
    return case["seq"] != case["seq_kv"] or list(case["lengths_q"]) != list(case["lengths_kv"])


def module_arguments(case: dict) -> dict:
    """DotProductAttention's constructor arguments for a case (no dropout), before any TP/CP ones."""
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
    if is_cross(case):
        arguments["attention_type"] = "cross"
    if case["softmax"] != "vanilla":
        arguments["softmax_type"] = case["softmax"]
    if case["return_max_logit"]:
        arguments["return_max_logit"] = True
    return arguments


def padding_mask(case: dict, cross: bool, device: torch.device | str):
    """TE's boolean padding mask (True = padding) of a padded sbhd/bshd batch: [batch, 1, 1, seq] for
    self-attention, a (queries', keys') pair for cross-attention."""
    def padding(seq: int, lengths: list[int]) -> torch.Tensor:
        positions = torch.arange(seq, device=device)[None, :]
        return (positions >= torch.tensor(lengths, device=device)[:, None]).view(len(lengths), 1, 1, seq)

    q_side = padding(case["seq"], case["lengths_q"])
    return (q_side, padding(case["seq_kv"], case["lengths_kv"])) if cross else q_side


def forward_arguments(case: dict, cu_seqlens: dict[str, list[int]], explicit: torch.Tensor | None,
                      bias: torch.Tensor | None, device: torch.device | str,
                      alibi_slopes: torch.Tensor | None = None) -> dict:
    """DotProductAttention.forward's keyword arguments for the case's lengths (`cu_seqlens`: TE's cu_seqlens_q,
    _kv and their _padded offsets, by name; with the case's `padding_mask`, TE's boolean padding mask too),
    explicit mask (True = visible; TE's is True = masked out), bias (post_scale_bias; ALiBi is TE's own, with
    the case's custom `alibi_slopes` where it has them) and num_splits."""
    arguments = {}
    if case["mask"].startswith("padding"):  # every format (seen on the H200 to work for sbhd on every TE path)
        taken = [name for name in cu_seqlens if case["pad_between_seqs"] or not name.endswith("_padded")]
        arguments.update({name: torch.tensor(cu_seqlens[name], dtype=torch.int32, device=device) for name in taken})
        arguments.update(max_seqlen_q=case["seq"], max_seqlen_kv=case["seq_kv"])
        if case["pad_between_seqs"]:
            arguments["pad_between_seqs"] = True
        if case["padding_mask"]:
            arguments["attention_mask"] = padding_mask(case, is_cross(case), device)
    if explicit is not None:
        arguments["attention_mask"] = ~explicit
    if case["bias"] == "alibi":
        arguments["core_attention_bias_type"] = "alibi"
        if case["alibi_slopes"] is not None and alibi_slopes is not None:
            arguments["alibi_slopes"] = alibi_slopes.to(device=device, dtype=torch.float32)
    elif bias is not None:
        arguments.update(core_attention_bias_type="post_scale_bias", core_attention_bias=bias)
    if case["num_splits"] != 1:
        arguments["num_splits"] = case["num_splits"]
    return arguments


# TE reads it at every forward of FP8 attention: 0 runs the backward in F16/BF16 from the FP8 forward.
FP8_BACKWARD_FLAG = "NVTE_FP8_DPA_BWD"


def fp8_backward_environment(case: dict) -> dict[str, str]:
    """The variable that chooses the backward of an FP8 case (TE's default, FP8, made explicit)."""
    return {FP8_BACKWARD_FLAG: "0" if case["fp8_backward"] == "f16" else "1"}


def split_outputs(result) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(out, max logit) of a DotProductAttention call: with return_max_logit TE returns both, else out alone."""
    if isinstance(result, (tuple, list)):
        return result[0], result[1]
    return result, None


def load_sink(module: torch.nn.Module, sink: torch.Tensor) -> torch.Tensor:
    """The learnable sink logits copied into TE's own `softmax_offset` parameter, which is what TE uses and
    differentiates (returned: the tensor whose gradient is dsink)."""
    with torch.no_grad():
        module.softmax_offset.copy_(sink.detach().to(module.softmax_offset.dtype))
    module.softmax_offset.grad = None
    return module.softmax_offset


def fp8_autocast(te_module, recipe_name: str):
    """TE's autocast with FP8 attention on (fp8_dpa) for `recipe_name` ("delayed", "current" or "mxfp8");
    nothing for "none"."""
    if recipe_name == "none":
        return contextlib.nullcontext()
    recipes = importlib.import_module("transformer_engine.common.recipe")
    recipe = {"delayed": recipes.DelayedScaling, "current": recipes.Float8CurrentScaling,
              "mxfp8": recipes.MXFP8BlockScaling}[recipe_name](fp8_dpa=True)
    if hasattr(te_module, "autocast"):
        return te_module.autocast(enabled=True, recipe=recipe)
    return te_module.fp8_autocast(enabled=True, fp8_recipe=recipe)
