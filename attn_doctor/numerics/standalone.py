"""The torch-only numerics that attn-doctor and its standalone repro scripts share: one implementation.

`attn-doctor bisect` writes a script that reproduces a failing call without attn-doctor installed
(`attn_doctor.bisect.repro`); the script holds this module's source, verbatim. So this module imports nothing
but torch and math, and its functions take plain values: tensors, numbers, and a case as a dict of plain
values (`Case.plain()`: every field of `attn_doctor.core.case.Case`, resolved). attn-doctor calls the same
functions (`attn_doctor.numerics.inputs`, `.masks`, `.metrics`, `.reference`, `attn_doctor.core.layouts`,
`attn_doctor.backends.local`, `attn_doctor.verdict.rule`), and those modules say why each piece is as it is.

Tensors are bshd ([batch, seq, heads, dim]) unless said otherwise.
"""

from __future__ import annotations

import math

import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# --- the seeded inputs --------------------------------------------------------------------------------------

OUTLIER_SCALE = 20.0  # outliers: the outlier channels' factor
OUTLIER_EVERY = 32  # outliers: one outlier channel per this many head-dim channels (at least one)
LOGIT_SCALE = 4.0  # large-logits: q and k's factor (scores' std = 4 * 4 = 16)
RANK = 4  # structured: the rank of q, k, v (at most the head dim)
KEY_MEAN_SCALE = 4.0  # structured: the std of the entries of each head's shared key mean vector
SHARED_DIRECTION = 2.0  # deep-layer: a head's keys' (and values') shared direction, in units of sqrt(head_dim)
# The side inputs (explicit mask, bias, sink logits) come from a generator of their own, seeded from the
# case's seed plus this, so that q, k, v and dout are drawn exactly as in a case without them.
SIDE_SEED_OFFSET = 1_000_003


def outlier_channels(head_dim: int, seed: int) -> list[int]:
    """The head-dim channels `outliers` scales: 1 in 32 (at least one), drawn from the seed on the CPU, so
    they are the same on every device."""
    count = max(1, head_dim // OUTLIER_EVERY)
    return sorted(torch.randperm(head_dim, generator=torch.Generator().manual_seed(seed))[:count].tolist())


def draw_inputs(case: dict, device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Seeded q, k, v of the case's distribution and a standard-normal output gradient, drawn in fp32 on
    `device` from one generator, in this order, and rounded to the case's dtype."""
    generator = torch.Generator(device=device).manual_seed(case["seed"])
    dtype = TORCH_DTYPES[case["dtype"]]
    b, s, skv, h, hkv = case["batch"], case["seq"], case["seq_kv"], case["heads"], case["kv_heads"]
    d, dv = case["head_dim"], case["head_dim_v"]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=torch.float32)

    if case["inputs"] == "uniform":  # U(-sqrt 3, sqrt 3): unit variance, no tails
        def uniform(*shape: int) -> torch.Tensor:
            u = torch.rand(shape, generator=generator, device=device, dtype=torch.float32)
            return u.mul_(2.0).sub_(1.0).mul_(3 ** 0.5).to(dtype)

        q, k, v = uniform(b, s, h, d), uniform(b, skv, hkv, d), uniform(b, skv, hkv, dv)
    elif case["inputs"] == "structured":
        rank = min(RANK, d)

        def low_rank(n: int, heads: int, width: int = d) -> torch.Tensor:
            """Per token `rank` coefficients of a per-head basis, summed elementwise (a matmul could take
            TF32 in one process and not in another)."""
            coefficients, basis = randn(b, n, heads, rank), randn(heads, rank, width)
            x = coefficients[..., 0, None] * basis[:, 0]
            for i in range(1, rank):
                x.addcmul_(coefficients[..., i, None], basis[:, i])
            return x.div_(rank ** 0.5)

        q = low_rank(s, h).to(dtype)
        k = low_rank(skv, hkv)
        k = k.add_(randn(hkv, d).mul_(KEY_MEAN_SCALE)).to(dtype)  # every key of a head shares its mean vector
        v = low_rank(skv, hkv, dv).to(dtype)
    elif case["inputs"] == "deep-layer":
        def shared(heads: int, width: int) -> torch.Tensor:
            direction = randn(heads, width)
            return direction.mul_(SHARED_DIRECTION * width ** 0.5 / direction.norm(dim=-1, keepdim=True))

        q = randn(b, s, h, d).to(dtype)
        k = randn(b, skv, hkv, d).add_(shared(hkv, d)).to(dtype)
        v = randn(b, skv, hkv, dv).add_(shared(hkv, dv)).to(dtype)
    else:  # normal, outliers, large-logits: standard normal, then scaled
        q_scale = k_scale = v_scale = None  # a factor, or one per head-dim channel
        if case["inputs"] == "outliers":
            def channels(width: int) -> torch.Tensor:
                scale = torch.ones(width, device=device, dtype=torch.float32)
                scale[outlier_channels(width, case["seed"])] = OUTLIER_SCALE
                return scale

            q_scale = k_scale = v_scale = channels(d)
            if dv != d:
                v_scale = channels(dv)
        elif case["inputs"] == "large-logits":
            q_scale = k_scale = LOGIT_SCALE

        def draw(scale: torch.Tensor | float | None, *shape: int) -> torch.Tensor:
            x = randn(*shape)
            return (x if scale is None else x.mul_(scale)).to(dtype)

        q, k, v = draw(q_scale, b, s, h, d), draw(k_scale, b, skv, hkv, d), draw(v_scale, b, skv, hkv, dv)
    return q, k, v, randn(b, s, h, dv).to(dtype)


def side_generator(case: dict, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(case["seed"] + SIDE_SEED_OFFSET)


def draw_explicit_mask(generator: torch.Generator, case: dict, device: torch.device | str) -> torch.Tensor:
    """Mask "arbitrary": [batch, 1, seq, seq_kv], True = visible, each pair hidden with the masked fraction."""
    draws = torch.rand(case["batch"], 1, case["seq"], case["seq_kv"], generator=generator, device=device)
    return draws >= case["masked_fraction"]


def draw_bias(generator: torch.Generator, case: dict, device: torch.device | str) -> torch.Tensor:
    """post_scale_bias: standard normal of the bias's shape, in the inputs' dtype (as TE takes it)."""
    return torch.randn(case["bias_shape"], generator=generator, device=device).to(TORCH_DTYPES[case["dtype"]])


def sink_logits(generator: torch.Generator, case: dict, device: torch.device | str) -> torch.Tensor | None:
    """The softmax's sink logit per head: 0 (off-by-one), standard normal float32 (learnable), or None."""
    if case["softmax"] == "off-by-one":
        return torch.zeros(case["heads"], device=device)
    if case["softmax"] == "learnable":
        return torch.randn(case["heads"], generator=generator, device=device)
    return None


def draw_side_inputs(case: dict, device: torch.device | str) -> tuple[torch.Tensor | None, ...]:
    """The explicit mask, the bias and the sink logits (each None where the case has none), drawn from the
    side generator in this order."""
    generator = side_generator(case, device)
    explicit = draw_explicit_mask(generator, case, device) if case["mask"] == "arbitrary" else None
    bias = draw_bias(generator, case, device) if case["bias"].startswith("post_scale_bias") else None
    return explicit, bias, sink_logits(generator, case, device)


# --- which keys each query sees, and the bias ---------------------------------------------------------------

TOP_LEFT_MASKS = ("causal", "padding_causal")
BOTTOM_RIGHT_MASKS = ("causal_bottom_right", "padding_causal_bottom_right")


def visibility(mask: str, window: tuple[int, int] | None, len_q: int, len_kv: int) -> tuple[int, int, int]:
    """(left, right, diag) of a sequence, as TE has it: query i sees keys i + diag - left .. i + diag + right
    (-1: unbounded); diag is bottom-right for *_bottom_right masks and, with a window, all but top-left ones."""
    left, right = window if window is not None else (-1, -1)
    if "causal" in mask:
        right = 0
    bottom_right = mask in BOTTOM_RIGHT_MASKS or (mask not in TOP_LEFT_MASKS and window is not None)
    return left, right, len_kv - len_q if bottom_right else 0


def visible_pairs(left: int, right: int, diag: int, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor | None:
    """Boolean [len(rows), len(cols)]: which (query, key) pairs the visibility lets through; None when all."""
    mask = None
    shifted = rows[:, None] + diag
    if right >= 0:
        mask = cols[None, :] <= shifted + right
    if left >= 0:
        lower = cols[None, :] >= shifted - left
        mask = lower if mask is None else mask & lower
    return mask


def sees_a_key(left: int, right: int, diag: int, rows: torch.Tensor, seq_kv: int) -> torch.Tensor:
    """Boolean like `rows` (query positions): which of them see at least one of keys [0, seq_kv)."""
    shifted = rows + diag
    first = (shifted - left).clamp(min=0) if left >= 0 else torch.zeros_like(shifted)
    stop = (shifted + right + 1).clamp(max=seq_kv) if right >= 0 else torch.full_like(shifted, seq_kv)
    return stop > first


def dense_allowed(case: dict, explicit: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """Boolean [batch or 1, 1, seq, seq_kv], True where query i sees key j (mask type, window, lengths and
    explicit mask; padding sees and is seen by nothing); None when all."""
    rows, cols = torch.arange(case["seq"], device=device), torch.arange(case["seq_kv"], device=device)
    if not case["mask"].startswith("padding") and explicit is None:
        mask = visible_pairs(*visibility(case["mask"], case["window"], case["seq"], case["seq_kv"]), rows, cols)
        return None if mask is None else mask[None, None]
    masks = []
    for b, (len_q, len_kv) in enumerate(zip(case["lengths_q"], case["lengths_kv"])):
        mask = visible_pairs(*visibility(case["mask"], case["window"], len_q, len_kv), rows, cols)
        mask = torch.ones(len(rows), len(cols), dtype=torch.bool, device=device) if mask is None else mask
        mask &= (rows < len_q)[:, None] & (cols < len_kv)[None, :]
        if explicit is not None:
            mask &= explicit[b, 0].to(device)
        masks.append(mask)
    return torch.stack(masks)[:, None]


def rows_seeing_keys(case: dict, explicit: torch.Tensor | None, device: torch.device | str) -> torch.Tensor:
    """Boolean [batch, seq]: the valid queries that see a key (without an explicit mask, from the visibility's
    edges: no seq x seq_kv mask)."""
    if explicit is not None:
        return dense_allowed(case, explicit, device)[:, 0].any(dim=-1)
    rows = torch.arange(case["seq"], device=device)
    return torch.stack([sees_a_key(*visibility(case["mask"], case["window"], len_q, len_kv), rows, len_kv)
                        & (rows < len_q) for len_q, len_kv in zip(case["lengths_q"], case["lengths_kv"])])


def valid_tokens(case: dict, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [batch, seq] and [batch, seq_kv]: the tokens that exist (not padding)."""
    return tuple(torch.arange(case[seq], device=device)[None, :] < torch.tensor(case[lengths], device=device)[:, None]
                 for seq, lengths in (("seq", "lengths_q"), ("seq_kv", "lengths_kv")))


def compared_rows(case: dict, explicit: torch.Tensor | None, device: torch.device | str
                  ) -> dict[str, dict[str, torch.Tensor | None]]:
    """Per tensor, `rows` compared (valid queries that see a key; valid keys) and `empty_rows` judged on their
    own (valid queries that see no key); {} when every row is compared."""
    seeing = rows_seeing_keys(case, explicit, device)
    valid_q, valid_kv = valid_tokens(case, device)
    if bool(seeing.all()) and bool(valid_kv.all()):
        return {}
    q_side = {"rows": valid_q & seeing, "empty_rows": valid_q & ~seeing}
    kv_side = {"rows": valid_kv, "empty_rows": None}
    return {"out": q_side, "dq": q_side, "dk": kv_side, "dv": kv_side}


def alibi_slopes(heads: int) -> torch.Tensor:
    """TE's default ALiBi slopes: 2^(-8 k / n), k = 1..n for the largest power of two n <= heads, then
    2^(-4 k / n), k = 1, 3, 5, ... for the remaining heads. float64 [heads]."""
    n = 2 ** math.floor(math.log2(heads))
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * k / n) for k in range(1, 2 * (heads - n), 2)]
    return torch.tensor(slopes, dtype=torch.float64)


# The seed offset of custom ALiBi slopes' own generator (on the CPU, so every device draws the same slopes).
SLOPES_SEED_OFFSET = 0x5107E5


def case_alibi_slopes(case: dict) -> torch.Tensor:
    """The ALiBi slopes of a case with bias "alibi", float64 on the CPU: TE's defaults ([heads]); "random" |N(0, 1)|
    per head and "random-batch" per sequence and head ([batch, heads]), as TE's custom-slopes tests draw them, in
    float32 (what TE takes) and then widened; or the user's own."""
    given = case.get("alibi_slopes")
    if given is None:
        return alibi_slopes(case["heads"])
    if not isinstance(given, str):
        return torch.tensor([float(s) for s in given], dtype=torch.float32).to(torch.float64)
    generator = torch.Generator().manual_seed(case["seed"] + SLOPES_SEED_OFFSET)
    shape = (case["heads"],) if given == "random" else (case["batch"], case["heads"])
    return torch.randn(shape, generator=generator, dtype=torch.float32).abs().to(torch.float64)


def alibi_bias(slopes: torch.Tensor, mask: str, len_q: int, len_kv: int, rows: int, cols: int,
               device: torch.device | str) -> torch.Tensor:
    """-slope_h |i + diag - j|, float64 [heads, rows, cols], for a sequence of len_q, len_kv; diag is
    bottom-right unless the mask is top-left causal (TE's get_alibi)."""
    diag = 0 if mask in TOP_LEFT_MASKS else len_kv - len_q
    distance = (torch.arange(rows, device=device)[:, None] + diag
                - torch.arange(cols, device=device)[None, :]).abs().to(torch.float64)
    return -slopes.to(device)[:, None, None] * distance


def dense_bias(case: dict, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str
               ) -> torch.Tensor | None:
    """The bias added to the scaled scores, broadcastable to [batch, heads, seq, seq_kv] in `dtype` (ALiBi
    materialised per sequence); None without one."""
    if case["bias"] != "alibi":
        return None if bias is None else bias.to(device=device, dtype=dtype)
    slopes = case_alibi_slopes(case)
    return torch.stack([alibi_bias(slopes[b] if slopes.dim() == 2 else slopes, case["mask"], len_q, len_kv,
                                   case["seq"], case["seq_kv"], device)
                        for b, (len_q, len_kv) in enumerate(zip(case["lengths_q"], case["lengths_kv"]))]).to(dtype)


# --- the memory layouts ---------------------------------------------------------------------------------------

HEAD_SLICE_SEED = 7  # head_slice: the seed of the other half of the heads


def token_index(slot_offsets: list[int], seq: int, device: torch.device | str) -> torch.Tensor:
    """Flat positions (b * seq + p) in a padded tensor of a thd tensor's tokens; sequence b fills
    slot_offsets[b] to slot_offsets[b + 1] (TE's cu_seqlens_*_padded)."""
    parts = [torch.arange(stop - start, device=device) + b * seq
             for b, (start, stop) in enumerate(zip(slot_offsets, slot_offsets[1:]))]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def to_format(t: torch.Tensor, fmt: str, index: torch.Tensor | None = None) -> torch.Tensor:
    """A bshd tensor seen in `fmt` (a view; for thd, its tokens gathered by `index`, a copy)."""
    if fmt == "thd":
        return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).index_select(0, index)
    return t if fmt == "bshd" else t.transpose(0, 1)


def to_bshd(t: torch.Tensor, fmt: str, index: torch.Tensor | None = None, padded: tuple[int, int] = (0, 0)
            ) -> torch.Tensor:
    """A tensor in `fmt` seen as bshd (a view; for thd, its tokens scattered by `index` into a zero tensor of
    `padded` (batch, seq) positions)."""
    if fmt == "thd":
        flat = torch.zeros(padded[0] * padded[1], *t.shape[1:], dtype=t.dtype, device=t.device)
        flat.index_copy_(0, index, t)
        return flat.view(*padded, *t.shape[1:])
    return t if fmt == "bshd" else t.transpose(0, 1)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone(memory_format=torch.contiguous_format).requires_grad_()


def lay_out(layout: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str,
            index_q: torch.Tensor | None = None, index_kv: torch.Tensor | None = None
            ) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
    """q, k, v (bshd values) as the views of `layout` in format fmt (thd: gathered by the token indices), and
    the storage tensors they are views of, which require grad."""
    sides = ((q, index_q), (k, index_kv), (v, index_kv))
    if layout == "contiguous":
        leaves = tuple(leaf(to_format(t, fmt, index)) for t, index in sides)
        return list(leaves), leaves
    if layout == "transposed":  # the other storage order, seen through a transpose
        other = "sbhd" if fmt == "bshd" else "bshd"
        leaves = tuple(leaf(to_format(t, other)) for t in (q, k, v))
        return [t.transpose(0, 1) for t in leaves], leaves
    if layout == "head_slice":  # the second half of a tensor with twice the heads
        generator = torch.Generator(device=q.device).manual_seed(HEAD_SLICE_SEED)
        views, leaves = [], []
        for t, index in sides:
            other = torch.randn(t.shape, generator=generator, device=t.device, dtype=torch.float32).to(t.dtype)
            wide = leaf(to_format(torch.cat([other, t], dim=2), fmt, index))
            views.append(wide[..., t.shape[2]:, :])
            leaves.append(wide)
        return views, tuple(leaves)
    if layout in ("qkv_3hd", "qkv_h3d", "kv_2hd", "kv_h2d"):  # TE's packed layouts: slices of one buffer
        dim = -2 if layout.endswith(("h3d", "h2d")) else -3
        tensors = [to_format(t, fmt, index) for t, index in sides]
        if layout.startswith("kv_"):
            q_leaf, buffer = leaf(tensors[0]), leaf(torch.stack(tensors[1:], dim=dim))
            return [q_leaf, buffer.select(dim, 0), buffer.select(dim, 1)], (q_leaf, buffer)
        buffer = leaf(torch.stack(tensors, dim=dim))
        return [buffer.select(dim, i) for i in range(3)], (buffer,)
    if layout == "sb3hd_packed":  # one [s, b, 3, h, d] buffer (a fused qkv GEMM's output)
        buffer = leaf(torch.stack([t.transpose(0, 1) for t in (q, k, v)], dim=2))
        views = [buffer[:, :, i] for i in range(3)]
    elif layout == "sbh3d_packed":  # Megatron's mixed [s, b, kv_heads, (group + 2) d]
        b, s, h, d = q.shape
        kv_heads = k.shape[2]
        group = h // kv_heads
        buffer = leaf(torch.cat([q.transpose(0, 1).reshape(s, b, kv_heads, group * d),
                                 k.transpose(0, 1).reshape(s, b, kv_heads, d),
                                 v.transpose(0, 1).reshape(s, b, kv_heads, d)], dim=-1))
        q_part, k_view, v_view = torch.split(buffer, [group * d, d, d], dim=-1)
        views = [q_part.reshape(s, b, h, d), k_view, v_view]  # q: a copy under GQA, exactly as Megatron's
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return ([x.transpose(0, 1) for x in views] if fmt == "bshd" else views), (buffer,)


# --- the local baseline: Megatron-LM's core attention, and a correct FP8 attention simulated -----------------

FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
MEGATRON_MASK_FILL = -10000.0


MX_BLOCK = 32  # MXFP8: values per scale, along the last dim


def fp8_round(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """x rounded to `fmt` with a per-tensor scale (amax to the format's largest value), back in x's dtype;
    "mx-e4m3": MXFP8, blocks of MX_BLOCK values along the last dim, each with a power-of-two scale (E8M0) that
    puts its amax's exponent at the format's largest (OCP MX: 2^(floor(log2 amax) - 8) for E4M3)."""
    if fmt is None:
        return x
    if fmt.startswith("mx-"):
        return _mx_round(x, fmt[3:])
    dtype = FP8_FORMATS[fmt]
    amax = x.detach().abs().amax().float()
    if not torch.isfinite(amax) or amax == 0:
        return x
    scale = torch.finfo(dtype).max / amax
    return ((x.float() * scale).to(dtype).float() / scale).to(x.dtype)


def _mx_round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    dtype = FP8_FORMATS[fmt]
    last = x.shape[-1]
    pad = (-last) % MX_BLOCK
    blocks = torch.nn.functional.pad(x.float(), (0, pad)).unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.detach().abs().amax(-1, keepdim=True)
    largest_exponent = math.floor(math.log2(torch.finfo(dtype).max))
    exponent = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)))) - largest_exponent
    scale = torch.exp2(exponent)
    rounded = (blocks / scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype).float() * scale
    return rounded.flatten(-2)[..., :last].to(x.dtype)


class Quantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_format, backward_format):
        ctx.backward_format = backward_format
        return fp8_round(x, forward_format)

    @staticmethod
    def backward(ctx, grad):
        return fp8_round(grad, ctx.backward_format), None, None


def quantize(x: torch.Tensor, forward_format: str | None, backward_format: str | None) -> torch.Tensor:
    """x rounded to `forward_format` in the forward, and the gradient reaching it rounded to
    `backward_format` in the backward (None: unchanged)."""
    return Quantize.apply(x, forward_format, backward_format)


# How TE's FP8 attention rounds, as (Q, K, V's forward format, P and O's, the backward's or None): per-tensor
# E4M3 forward and E5M2 backward (TE's HYBRID format); MXFP8 takes Q, K, V in blocks of 32 along the head dim; with
# the F16 backward (NVTE_FP8_DPA_BWD=0) nothing in the backward is rounded.
FP8_DEFAULT = ("e4m3", "e4m3", "e5m2")


def fp8_mode(case: dict) -> tuple[str, str, str | None] | None:
    """How a case's FP8 attention rounds (see FP8_DEFAULT), or None without FP8."""
    if case["fp8"] == "none":
        return None
    return ("mx-e4m3" if case["fp8"] == "mxfp8" else "e4m3", "e4m3",
            None if case["fp8_backward"] == "f16" else "e5m2")


def megatron_core_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float, visible: torch.Tensor | None,
    bias: torch.Tensor | None = None, sink: torch.Tensor | None = None,
    fp8: tuple[str, str, str | None] | None = None,
) -> torch.Tensor:
    """Megatron's core attention on sbhd tensors (baddbmm in the input dtype, fp32 softmax after
    masked_fill(-10000), probabilities in the input dtype, bmm with v) with the boolean mask `visible` (None:
    all visible), a `bias` added to the scores and `sink` logits [heads]; rows that see no key output 0.
    `fp8` (a `fp8_mode`): Q, K, V, P, O rounded to E4M3 and their gradients and dS to E5M2, as TE's FP8 attention
    does; with the F16 backward the backward unrounded; MXFP8: Q, K, V in MXFP8 blocks."""
    seq_q, batch, heads, head_dim = q.shape
    seq_kv, _, kv_heads, _ = k.shape
    head_dim_v = v.shape[-1]
    if fp8 is not None:
        q, k, v = (quantize(t, fp8[0], fp8[2]) for t in (q, k, v))
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=2)
        v = v.repeat_interleave(heads // kv_heads, dim=2)
    q2 = q.reshape(seq_q, batch * heads, head_dim)
    k2 = k.reshape(seq_kv, batch * heads, head_dim)
    buffer = torch.empty(batch * heads, seq_q, seq_kv, dtype=q.dtype, device=q.device)
    scores = torch.baddbmm(
        buffer, q2.transpose(0, 1), k2.transpose(0, 1).transpose(1, 2), beta=0.0, alpha=softmax_scale
    ).view(batch, heads, seq_q, seq_kv)

    in_float16 = q.dtype in (torch.float16, torch.bfloat16)
    x = scores.float() if in_float16 else scores
    if fp8 is not None:
        x = quantize(x, None, fp8[2])  # dS is quantised in the backward
    if bias is not None:
        x = x + bias.to(x.dtype)
    if visible is not None:
        x = x.masked_fill(~visible, MEGATRON_MASK_FILL)
    if sink is not None:
        column = sink.to(x.dtype).view(1, heads, 1, 1).expand(batch, heads, seq_q, 1)
        probs = torch.softmax(torch.cat([x, column], dim=-1), dim=-1)[..., :seq_kv]
    else:
        probs = torch.softmax(x, dim=-1)
    if visible is not None:
        probs = probs * visible.any(dim=-1, keepdim=True)  # rows that see no key: 0 (TE's convention)
    if fp8 is not None:
        probs = quantize(probs, fp8[1], fp8[2])
    if in_float16:
        probs = probs.to(q.dtype)

    v2 = v.reshape(seq_kv, batch * heads, head_dim_v)
    context = torch.bmm(probs.reshape(batch * heads, seq_q, seq_kv), v2.transpose(0, 1))
    out = context.view(batch, heads, seq_q, head_dim_v).permute(2, 0, 1, 3)
    return quantize(out, fp8[1], fp8[2]) if fp8 is not None else out


def dense_max_logit(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, allowed: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 max logit per head by the plain formula, every score materialised (bshd q, k; `allowed` and `bias`
    as in `dense_reference`), [1, 1, heads, 1], with the winning score's squared term size twice, [1, 1, heads, 2]:
    the standalone repro's, and the second implementation `reference.max_logit_reference` is held equal to."""
    heads, kv_heads = q.shape[2], k.shape[2]
    qh = q.to(torch.float64).transpose(1, 2) * softmax_scale
    kh = k.to(torch.float64).transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    products = qh[:, :, :, None, :] * kh[:, :, None, :, :]  # [b, h, sq, skv, d]
    scores = products.sum(-1)
    sizes = products.square().sum(-1)
    if bias is not None:
        full = bias.to(torch.float64).expand_as(scores)
        scores, sizes = scores + full, sizes + full.square()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    flat = scores.transpose(0, 1).reshape(heads, -1)
    top, where = flat.max(dim=1)
    terms = sizes.transpose(0, 1).reshape(heads, -1).gather(1, where[:, None]).view(1, 1, heads, 1)
    return top.view(1, 1, heads, 1), terms.expand(1, 1, heads, 2).clone()


def megatron_max_logit(q: torch.Tensor, k: torch.Tensor, softmax_scale: float, visible: torch.Tensor | None,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each head's largest score [heads] as Megatron's core attention computes its scores (baddbmm in the input
    dtype, then fp32 with the bias), over the visible pairs only (TE's return_max_logit: max of the masked
    scaled scores plus bias), on sbhd tensors; -inf for a head that sees nothing."""
    seq_q, batch, heads, head_dim = q.shape
    seq_kv, _, kv_heads, _ = k.shape
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, dim=2)
    with torch.no_grad():
        scores = torch.baddbmm(
            torch.empty(batch * heads, seq_q, seq_kv, dtype=q.dtype, device=q.device),
            q.reshape(seq_q, batch * heads, head_dim).transpose(0, 1),
            k.reshape(seq_kv, batch * heads, head_dim).transpose(0, 1).transpose(1, 2), beta=0.0, alpha=softmax_scale,
        ).view(batch, heads, seq_q, seq_kv).float()
        if bias is not None:
            scores = scores + bias.float()
        if visible is not None:
            scores = scores.masked_fill(~visible, float("-inf"))
        return scores.amax(dim=(0, 2, 3))


# --- the float64 reference, with the size of the terms each entry is summed from ----------------------------

def score_precision(dtype: torch.dtype) -> float:
    """The unit roundoff of a kernel's scores (fp32, or the inputs' own if finer) over the inputs'."""
    inputs = torch.finfo(dtype).eps if dtype.is_floating_point else torch.finfo(torch.float32).eps
    scores = min(torch.finfo(torch.float32).eps, inputs)
    return scores / inputs


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, softmax_scale: float,
                    allowed: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                    sink: torch.Tensor | None = None) -> dict[str, torch.Tensor | None]:
    """Float64 out, dq, dk, dv (dsink [1, 1, heads, 1] with `sink`) by the plain formula through autograd, lse,
    and each row's squared term sizes ([..., 2]: as they are, and times the fp32 scores' g^2):
    out_i = sum_j P_ij v_j, dV_j = sum_i P_ij dO_i, dQ_i = c sum_j dS_ij k_j, dK_j = c sum_i dS_ij q_i, with
    dS_ij = P_ij (dP_ij - D_i) sized P_ij (|dO_i * v_j| + |dO_i * out_i|); d sink_h = -sum_i P_sink,i D_i.
    `allowed` (True = visible), `bias` and `sink` as in `megatron_core_attention`."""
    heads, kv_heads = q.shape[2], k.shape[2]
    q64, k64, v64 = (t.detach().to(torch.float64).requires_grad_() for t in (q, k, v))
    sink64 = None if sink is None else sink.detach().to(torch.float64).requires_grad_()
    qh = q64.transpose(1, 2)
    kh = k64.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    vh = v64.transpose(1, 2).repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * softmax_scale
    seq_kv = scores.shape[-1]
    if bias is not None:
        scores = scores + bias.to(torch.float64)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    if sink64 is not None:
        scores = torch.cat([scores, sink64[None, :, None, None].expand(*scores.shape[:-1], 1)], -1)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.nan_to_num(torch.exp(scores - lse[..., None]), nan=0.0)
    sink_probs = probs[..., seq_kv] if sink64 is not None else None
    probs = probs[..., :seq_kv]
    out = torch.matmul(probs, vh).transpose(1, 2)
    do64 = dout.to(torch.float64)
    leaves = (q64, k64, v64) + ((sink64,) if sink64 is not None else ())
    grads = torch.autograd.grad(out, leaves, do64, allow_unused=True)
    probs = probs.detach()
    do_h = do64.transpose(1, 2)
    a_term = torch.matmul(do_h.square(), vh.detach().square().transpose(-1, -2)).sqrt()  # |dO_i * v_j|
    b_term = (do_h * out.detach().transpose(1, 2)).square().sum(-1, keepdim=True).sqrt()  # |dO_i * out_i|
    sizes = (probs * (a_term + b_term)).square()
    # scores and log-sum-exp are fp32 in kernels: P's error grows with |lse| (g^2 per row)
    amplified = (1 + 2 * score_precision(q.dtype) * torch.where(torch.isfinite(lse), lse, 0.0).abs().detach()).square()
    k_sq, v_sq = kh.detach().square().sum(-1), vh.detach().square().sum(-1)
    q_sq, do_sq = qh.detach().square().sum(-1), do_h.square().sum(-1)

    def both(rows: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """[..., 2]: as they are, and with each query row's g^2 (on the rows, or on `weights` summed over)."""
        if weights is None:
            return torch.stack([rows, rows * amplified], -1)
        return torch.stack([rows @ weights[..., None], rows @ (weights * amplified)[..., None]], -1).squeeze(-2)

    def per_kv(t: torch.Tensor) -> torch.Tensor:  # [b, h, s_kv, 2] -> [b, s_kv, kv_heads, 2], summed over groups
        return t.view(t.shape[0], kv_heads, heads // kv_heads, *t.shape[2:]).sum(2).transpose(1, 2)

    found = {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2], "lse": lse.detach(),
             "out_terms": both((probs.square() @ v_sq[..., None]).squeeze(-1)).transpose(1, 2),
             "dq_terms": both((sizes @ k_sq[..., None]).squeeze(-1)).transpose(1, 2) * softmax_scale**2,
             "dk_terms": per_kv(both(sizes.transpose(-1, -2), q_sq)) * softmax_scale**2,
             "dv_terms": per_kv(both(probs.square().transpose(-1, -2), do_sq)), "dsink": None, "dsink_terms": None}
    if sink64 is not None:
        sink_terms = both((sink_probs.detach() * b_term[..., 0]).square()).sum(dim=(0, 2))  # [heads, 2]
        found.update(dsink=grads[3].view(1, 1, heads, 1), dsink_terms=sink_terms.view(1, 1, heads, 2))
    return found


# --- how far a tensor is from the reference -------------------------------------------------------------------

def safe_ratio(err: float, scale: float) -> float:
    """err / scale, where a zero scale (nothing to compute: the exact result and all its terms are 0)
    makes any error infinitely large and no error 0."""
    if scale > 0:
        return err / scale
    return 0.0 if err == 0 else math.inf


def squared_ratios(sq_err: torch.Tensor, sq_scale: torch.Tensor) -> torch.Tensor:
    """Elementwise squared `safe_ratio`."""
    out = torch.where(sq_scale > 0, sq_err / sq_scale.clamp_min(1e-300), sq_err * math.inf)
    return torch.nan_to_num(out, nan=0.0, posinf=math.inf)


def projection_bias(projection: float, projection_sq: float, ref_sq: float) -> tuple[float, float]:
    """(bias, bias_z) from sum_rows <e, r>, sum_rows <e, r>^2 and ||r||^2; (0, 0) where r is 0."""
    if ref_sq <= 0 or projection_sq <= 0:
        return 0.0, 0.0
    return projection / ref_sq, projection / math.sqrt(projection_sq)


def error_sums(x: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor | None = None,
               rows: torch.Tensor | None = None, empty_rows: torch.Tensor | None = None,
               into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The float64 sums behind `error_figures` of x against ref, or of a stretch of the sequence added `into`
    the sums of the stretches before. `terms`: the reference's squared term sizes per row ([b, s, h, 2], or
    [b, s, h] for both); `rows`, `empty_rows`: boolean [b, s] or [b, s, h] (`compared_rows`)."""
    f64 = torch.float64
    x, device = x.to(device=ref.device, dtype=f64), ref.device
    batch, seq, heads = x.shape[:3]
    zero = torch.zeros((), dtype=f64, device=device)
    part = {"empty_rows": zero.clone(), "empty_max": zero.clone(), "empty_nonfinite": zero.clone()}

    def row_mask(mask: torch.Tensor | None) -> torch.Tensor | None:  # [b, s, 1 or h, 1]
        return None if mask is None else (mask[..., None] if mask.dim() == 2 else mask).to(device)[..., None]

    empty, counted = row_mask(empty_rows), row_mask(rows)
    if empty is not None and x.numel():  # no `empty.any()` first: on a GPU each such test waits for it (see on_host)
        on_empty = torch.where(empty, x, 0.0)
        part.update(empty_rows=empty.expand(batch, seq, heads, 1).sum(),
                    empty_nonfinite=(~torch.isfinite(on_empty)).sum(),
                    empty_max=torch.nan_to_num(on_empty, nan=0.0, posinf=0.0, neginf=0.0).abs().max())
    if counted is not None:
        x, ref = torch.where(counted, x, 0.0), torch.where(counted, ref, 0.0)
    finite = torch.isfinite(x) & torch.isfinite(ref)
    part.update(nan=torch.isnan(x).sum(), inf=torch.isinf(x).sum(), ref_nonfinite=(~torch.isfinite(ref)).sum())
    x, ref = torch.where(finite, x, 0.0), torch.where(finite, ref, 0.0)
    diff = x - ref
    row_projection = (diff * ref).sum(dim=3)  # one per row: rows' rounding errors are independent
    if terms is None:
        head_terms = torch.zeros(batch, heads, 2, dtype=f64, device=device)
    else:
        terms = (terms[..., None].expand(*terms.shape, 2) if terms.dim() == 3 else terms).to(device=device, dtype=f64)
        head_terms = (terms if counted is None else torch.where(counted, terms, 0.0)).sum(dim=1)
    # A row's error over its own terms' scale: the worst row says what a fault does to a row it touches, however
    # many rows it touches (rows with no scale, such as keys nobody attends, have no such figure).
    row_scale_sq = ref.square().sum(dim=3) + (terms[..., 0] if terms is not None else 0.0)
    row_err_sq = torch.where(row_scale_sq > 0, diff.square().sum(dim=3) / row_scale_sq.clamp_min(1e-300), 0.0)
    part["worst_row_sq"] = row_err_sq.max() if row_err_sq.numel() else zero.clone()
    part.update(sq_diff=diff.square().sum(), sq_ref=ref.square().sum(), sq_cand=x.square().sum(),
                dot=(x * ref).sum(), max_abs=diff.abs().max() if diff.numel() else zero.clone(),
                head_sq_diff=diff.square().sum(dim=(1, 3)), head_sq_ref=ref.square().sum(dim=(1, 3)),
                head_terms=head_terms, head_projection=row_projection.sum(dim=1),
                head_projection_sq=row_projection.square().sum(dim=1),
                rows=counted.expand(batch, seq, heads, 1).sum() if counted is not None else zero + batch * seq * heads)
    if into is None:
        return part
    for name, value in part.items():
        into[name] = (torch.maximum(into[name], value) if name in ("max_abs", "empty_max", "worst_row_sq")
                      else into[name] + value)
    return into


def on_host(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`sums` as float64 CPU tensors of the same shapes, through one copy of one buffer. Every value read from
    a GPU tensor waits for that GPU; where a dozen processes share it, time-sliced, each wait is the process's
    next turn, and reading the figures value by value was about 110 waits a compared row (te-tests on the H100:
    30-60 ms a row, whatever its size). Counts stay exact: they are below 2^53."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in sums.values()]).cpu()
    host, at = {}, 0
    for name, t in sums.items():
        host[name] = flat[at : at + t.numel()].reshape(t.shape)
        at += t.numel()
    return host


def error_figures(sums: dict[str, torch.Tensor]) -> dict[str, float | int]:
    """A tensor's error: relative (`rel`; `worst_rel`: worst (batch, head) slice) and over the terms' scale
    sqrt(||ref||^2 + terms), which does not vanish where the exact tensor cancels (`scaled`, `worst`; `worst_row`,
    the worst (batch, position, head) row over its own terms' scale; `cancellation` = ||ref|| / scale); the
    noise's scale over it (`noise`, `head_noise`); the systematic part bias = <e, r> / <r, r> and its
    significance bias_z (whole, and the slice of largest |z|); NaN/Inf; the largest value on rows that see no key,
    over a compared row's RMS size. Computed on the host from the sums (`on_host`)."""
    sums = on_host(sums)
    ref_norm, cand_norm, diff_norm = (math.sqrt(float(sums[name])) for name in ("sq_ref", "sq_cand", "sq_diff"))
    rel = safe_ratio(diff_norm, ref_norm)
    head_rel = squared_ratios(sums["head_sq_diff"], sums["head_sq_ref"])
    head_scale_sq = sums["head_sq_ref"] + sums["head_terms"][..., 0]
    head_noise_sq = sums["head_sq_ref"] + sums["head_terms"][..., 1]
    scale = math.sqrt(float(head_scale_sq.sum()))
    head_noise = torch.where(head_scale_sq > 0, head_noise_sq / head_scale_sq.clamp_min(1e-300), 1.0)
    head_scaled = squared_ratios(sums["head_sq_diff"], head_scale_sq)
    projection, projection_sq = sums["head_projection"], sums["head_projection_sq"]
    bias, bias_z = projection_bias(float(projection.sum()), float(projection_sq.sum()), float(sums["sq_ref"]))
    head_bias = head_bias_z = 0.0
    if projection.numel():
        head_z = torch.where(projection_sq > 0, projection / projection_sq.clamp_min(1e-300).sqrt(), 0.0)
        at = int(head_z.abs().argmax())
        head_bias, head_bias_z = projection_bias(*(float(t.flatten()[at]) for t in (
            projection, projection_sq, sums["head_sq_ref"])))
    counted = float(sums["rows"])
    row_size = math.sqrt(float(sums["sq_ref"]) / counted) if counted else 0.0
    return {
        "rel": rel, "max_abs": float(sums["max_abs"]),
        "cosine": (float(sums["dot"]) / (ref_norm * cand_norm) if ref_norm > 0 and cand_norm > 0
                   else (1.0 if rel == 0 else 0.0)),
        "worst_rel": math.sqrt(float(head_rel.max())) if head_rel.numel() else 0.0,
        "nan": int(sums["nan"]), "inf": int(sums["inf"]), "ref_nonfinite": int(sums["ref_nonfinite"]),
        "scaled": safe_ratio(diff_norm, scale),
        "worst": math.sqrt(float(head_scaled.max())) if head_scaled.numel() else 0.0,
        "worst_row": math.sqrt(float(sums["worst_row_sq"])),
        "cancellation": ref_norm / scale if scale > 0 else 1.0,
        "noise": math.sqrt(safe_ratio(float(head_noise_sq.sum()), float(head_scale_sq.sum()))) if scale > 0 else 1.0,
        "head_noise": math.sqrt(float(head_noise.max())) if head_noise.numel() else 1.0,
        "bias": bias, "bias_z": bias_z, "head_bias": head_bias, "head_bias_z": head_bias_z,
        "empty_rows": int(sums["empty_rows"]), "empty_max": safe_ratio(float(sums["empty_max"]), row_size),
        "empty_nonfinite": int(sums["empty_nonfinite"]),
    }


# --- what a correct flash-style backward gets ----------------------------------------------------------------

def output_rounding_moves(q: torch.Tensor, dout: torch.Tensor, exact_out: torch.Tensor, returned_out: torch.Tensor,
                          softmax_scale: float, attend_keys) -> dict[str, torch.Tensor]:
    """How far a backward taking D_i = dO_i . O_i from `returned_out` (rounded) moves dQ and dK from the exact
    ones, float64 bshd. `attend_keys(g)`: the case's exact attention with the keys as values and output gradient
    g, as (out, dv): P K and P^T g."""
    f64 = torch.float64
    moved = (dout.to(f64) * (returned_out.to(f64) - exact_out.to(f64))).sum(-1, keepdim=True)  # dD
    through_keys, back = attend_keys(moved * q.to(f64))
    return {"dq": -softmax_scale * moved * through_keys, "dk": -softmax_scale * back}


# --- the verdict ----------------------------------------------------------------------------------------------

EPS = {"bf16": 2.0**-7, "fp16": 2.0**-10, "fp32": 2.0**-23}
MULTIPLE = {"out": 3.0, "dq": 3.0, "dk": 3.0, "dv": 3.0, "dsink": 3.0, "max_logit": 3.0}  # at most this x the yardstick


def tensor_kind(name: str) -> str:
    """The tensor a figure is judged as: "dq_first" (a depth probe's dQ at layer 1) as dq; a MULTIPLE key as itself."""
    return name if name in MULTIPLE else name.split("_")[0]
NOISE_EPS = {"bf16": 0.25, "fp16": 0.25, "fp32": 1.0}  # the yardstick is never below this many eps (x noise)
BIAS_Z = 8.0  # a systematic error FAILs from this significance
BIAS_EPS = {"bf16": 1.0, "fp16": 1.0, "fp32": 8.0}  # and from this many eps (or MULTIPLE x the baseline's)
CANCELLED = 1 / 16  # ||exact|| below this share of the terms' scale: the tensor cancels
EMPTY_ROW_EPS = 1.0  # rows that see no key: values up to this many eps of a compared row's size pass
FLOAT64_U = 2.0**-53  # float64's unit roundoff
REFERENCE_HEADROOM = 10.0  # float64's worst-case rounding must stay this far below the largest error that passes


def flash_style_figures(base: dict, flash: dict | None) -> dict:
    """A correct flash-style backward's error figures: the baseline's and `flash` (what taking D from the rounded
    output adds) in quadrature, their biases' larger; the baseline's where `flash` is None or not finite."""
    own = {"scaled": base["scaled"], "worst": base["worst"], "bias": abs(base["bias"]),
           "head_bias": max(abs(base["bias"]), abs(base["head_bias"]))}
    if flash is None or not all(math.isfinite(flash[name]) for name in ("scaled", "worst", "bias", "head_bias")):
        return own
    return {"scaled": math.hypot(own["scaled"], flash["scaled"]), "worst": math.hypot(own["worst"], flash["worst"]),
            "bias": max(own["bias"], abs(flash["bias"])),
            "head_bias": max(own["head_bias"], abs(flash["bias"]), abs(flash["head_bias"]))}


def judge_figures(m: dict, base: dict, dtype: str, multiple: float, accumulation: int = 0,
                  flash: dict | None = None) -> dict:
    """The rule on a tensor's `error_figures` and the baseline's: `failed`, the check that fails ("nonfinite",
    "empty rows", "error", "worst head", "bias", "head bias"; "" for none), the yardsticks (the baseline's
    error, never below rounding noise; with `flash`, a flash-style backward's: `flash_style_figures`, as
    `correct`), the ratios to them, and `margin` (the deciding quantity over its limit).
    `inconclusive` names why no verdict can be given ("" when one can): "reference" (float64 has NaN/Inf, or an
    error cannot be measured against its terms' scale), "float64" (float64's own rounding over `accumulation`
    terms per sum approaches the limit), "baseline" (the baseline itself has NaN/Inf where float64 has none, so
    its error is no yardstick; a verdict on the candidate's own NaN/Inf or empty rows needs none)."""
    floor = NOISE_EPS[dtype] * EPS[dtype]
    noise, head_noise = floor * m["noise"], floor * m["head_noise"]
    correct = flash_style_figures(base, flash)
    yardstick, head_yardstick = max(correct["scaled"], noise), max(correct["worst"], head_noise)
    ratio, head_ratio = safe_ratio(m["scaled"], yardstick), safe_ratio(m["worst"], head_yardstick)
    found = {"failed": "", "noise": noise, "head_noise": head_noise, "yardstick": yardstick,
             "head_yardstick": head_yardstick, "ratio": ratio, "head_ratio": head_ratio,
             "margin": max(ratio, head_ratio) / multiple, "correct": correct}
    if m["nan"] + m["inf"] and not base["ref_nonfinite"]:
        found.update(failed="nonfinite", margin=math.inf)
    elif m["empty_rows"] and (m["empty_nonfinite"] or m["empty_max"] > EMPTY_ROW_EPS * EPS[dtype]):
        found.update(failed="empty rows", margin=math.inf)
    elif ratio > multiple:
        found["failed"] = "error"
    elif head_ratio > multiple:
        found["failed"] = "worst head"
    elif m["cancellation"] >= CANCELLED:  # a bias relative to a vanishing exact tensor means nothing
        for check, bias, z, base_bias in (
            ("bias", m["bias"], m["bias_z"], correct["bias"]),
            ("head bias", m["head_bias"], m["head_bias_z"], correct["head_bias"]),
        ):
            limit = max(BIAS_EPS[dtype] * EPS[dtype], multiple * base_bias)
            if abs(z) >= BIAS_Z and abs(bias) >= limit:
                found.update(failed=check, margin=abs(bias) / limit, bias=bias, bias_z=z, bias_limit=limit)
                break
    found["inconclusive"] = ""
    # The baseline shares the reference: an error of its that cannot be sized (a scale of NaN or 0 under a
    # nonzero error) means the yardstick is broken; a candidate's infinite error over an exact zero is a fault.
    measurable = all(math.isfinite(base[name]) and not math.isnan(m[name]) for name in ("scaled", "worst"))
    if m["ref_nonfinite"] or base["ref_nonfinite"] or not measurable:
        found["inconclusive"] = "reference"
    elif accumulation * FLOAT64_U * REFERENCE_HEADROOM >= multiple * min(yardstick, head_yardstick):
        found["inconclusive"] = "float64"
    elif base["nan"] + base["inf"] and found["failed"] not in ("nonfinite", "empty rows"):
        found["inconclusive"] = "baseline"
    return found


# --- how the paths that are not TE are called -------------------------------------------------------------------

def sdpa_mask(case: dict, explicit: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype,
              device: torch.device | str) -> tuple[torch.Tensor | None, bool]:
    """PyTorch SDPA's attn_mask and is_causal for the case: plain causal self-attention as is_causal, every
    other mask as a boolean attn_mask (True = attend), a bias as a float attn_mask with -inf where masked."""
    dense = not case["mask"].startswith("padding") and explicit is None and case["bias"] == "no_bias"
    if dense and "causal" in case["mask"] and case["window"] is None and case["seq"] == case["seq_kv"]:
        return None, True
    mask, added = dense_allowed(case, explicit, device), dense_bias(case, bias, dtype, device)
    if added is not None:
        mask = added if mask is None else added.masked_fill(~mask, float("-inf"))
    return mask, False


def needs_mask(case: dict) -> bool:
    """Whether `causal` alone cannot describe the case's mask (a --kernel then needs the `allowed` keyword)."""
    return (case["mask"].startswith("padding") or case["mask"] == "arbitrary" or case["window"] is not None
            or case["mask"].endswith("bottom_right") and case["seq"] != case["seq_kv"])


def kernel_keywords(case: dict, explicit: torch.Tensor | None, bias: torch.Tensor | None,
                    sink: torch.Tensor | None, dtype: torch.dtype, device: torch.device | str) -> dict:
    """Every keyword a --kernel function may take beyond causal and softmax_scale, for the case."""
    padded = case["mask"].startswith("padding")

    def lengths(side: str) -> torch.Tensor | None:
        return torch.tensor(case[f"lengths_{side}"], dtype=torch.int32, device=device) if padded else None

    return {"allowed": dense_allowed(case, explicit, device) if needs_mask(case) else None,
            "bias": dense_bias(case, bias, dtype, device), "softmax_offset": sink, "seqlens_q": lengths("q"),
            "seqlens_kv": lengths("kv"), "mask_type": case["mask"], "window": case["window"]}
