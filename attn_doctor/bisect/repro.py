"""A standalone repro script for one failing kernel path: torch (and TE for TE paths) only.

The script rebuilds the minimal case's inputs with the same seed and the same views, sets the same TE
flags, runs the kernel, computes the float64 reference and the Megatron-local baseline, prints the
errors and exits 1 while the path is still wrong, 0 once it is fixed. It is what a user attaches to a
bug report, so it is written to be read: each part is short and commented.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from attn_doctor.core.coords import Coords
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.numerics.reference import SCORE_PRECISION
from attn_doctor.verdict.rule import BIAS_EPS, BIAS_Z, CANCELLED, EMPTY_ROW_EPS, EPS, MULTIPLE, NOISE_EPS

HEADER = '''#!/usr/bin/env python3
"""Repro: {title}

Made by attn-doctor {version} ({command}).
Environment it was made on:
{env}
Exit code: 1 while the kernel path is still wrong, 0 once it agrees with float64 as closely as
Megatron's local attention, by the same rule as attn-doctor: each tensor's error, measured against the
scale of the terms it is summed from, may be at most {multiple:g} x the baseline's (never less than
rounding noise), whole tensor and worst (batch, head) slice; a systematic error beyond rounding and
NaN/Inf fail too.
"""
import os
import sys

import torch
import torch.nn.functional as F

CASE = {case}
LAYOUT = {layout!r}
TP = {tp}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = {{"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}}[CASE["dtype"]]
EPS = {eps!r}
MULTIPLE, NOISE = {multiple!r}, {noise!r} * EPS  # the yardstick is never below NOISE (rounding noise)
BIAS_Z, BIAS_FLOOR = {bias_z!r}, {bias_eps!r} * EPS  # a systematic error FAILs beyond these
CANCELLED = {cancelled!r}  # the exact tensor cancels where its norm is below this share of its terms'
SCORE_PRECISION = {score_precision!r}  # fp32 scores' roundoff over the inputs'
EMPTY_ROW_LIMIT = {empty_row_eps!r} * EPS  # rows that see no key: largest value that passes, over a row's size
EXPLICIT = BIAS = SINK = None  # the case's explicit mask, bias and sink logits (side_inputs, set in main)
SINK_LEAF = None  # a kernel whose library keeps its own sink parameter (TE) points this at it
'''

INPUTS = '''

def inputs():
    \"\"\"Seeded q, k, v, dout in bshd, exactly as attn-doctor draws them: in fp32 from one generator, in this
    order, then rounded to the dtype. q, k, v follow the case's distribution; dout is standard normal.\"\"\"
    g = torch.Generator(device=DEVICE).manual_seed(CASE["seed"])
    b, s, skv, h, hkv, d = (CASE[k] for k in ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim"))
    dv = CASE.get("head_dim_v") or d
    randn = lambda *shape: torch.randn(shape, generator=g, device=DEVICE, dtype=torch.float32)
    kind = CASE.get("inputs", "normal")
    if kind == "uniform":  # U(-sqrt 3, sqrt 3): unit variance, no tails
        uniform = lambda *shape: torch.rand(shape, generator=g, device=DEVICE, dtype=torch.float32).mul_(2.0).sub_(
            1.0).mul_(3 ** 0.5).to(DTYPE)
        q, k, v = uniform(b, s, h, d), uniform(b, skv, hkv, d), uniform(b, skv, hkv, dv)
    elif kind == "structured":  # rank-4 q, k, v; every key of a head shares a mean vector (keys nearly equal)
        rank = min(4, d)

        def low_rank(n, heads, width=d):  # per token `rank` coefficients of a per-head basis
            coefficients, basis = randn(b, n, heads, rank), randn(heads, rank, width)
            x = coefficients[..., 0, None] * basis[:, 0]
            for i in range(1, rank):
                x.addcmul_(coefficients[..., i, None], basis[:, i])
            return x.div_(rank ** 0.5)

        q = low_rank(s, h).to(DTYPE)
        k = low_rank(skv, hkv)
        k = k.add_(randn(hkv, d).mul_(4.0)).to(DTYPE)
        v = low_rank(skv, hkv, dv).to(DTYPE)
    else:  # normal; outliers: a few head-dim channels x20 in q, k, v; large-logits: q and k x4 (scores' std ~16)
        q_scale = k_scale = v_scale = None
        if kind == "outliers":
            def channels(width):
                c = torch.ones(width, device=DEVICE, dtype=torch.float32)
                picked = torch.randperm(width, generator=torch.Generator().manual_seed(CASE["seed"]))[:max(1, width // 32)]
                c[sorted(picked.tolist())] = 20.0
                return c
            q_scale = k_scale = v_scale = channels(d)
            if dv != d:
                v_scale = channels(dv)
        elif kind == "large-logits":
            q_scale = k_scale = 4.0

        def draw(scale, *shape):
            x = randn(*shape)
            return (x if scale is None else x.mul_(scale)).to(DTYPE)

        q, k, v = draw(q_scale, b, s, h, d), draw(k_scale, b, skv, hkv, d), draw(v_scale, b, skv, hkv, dv)
    return q, k, v, randn(b, s, h, dv).to(DTYPE)


def lengths(side):
    \"\"\"Each sequence's length (TE's cu_seqlens): its own, or the padded length.\"\"\"
    b = CASE["batch"]
    if side == "q":
        return list(CASE.get("seqlens") or [CASE["seq"]] * b)
    if CASE.get("seqlens_kv"):
        return list(CASE["seqlens_kv"])
    return list(CASE["seqlens"]) if CASE.get("seqlens") and CASE["seq_kv"] == CASE["seq"] else [CASE["seq_kv"]] * b


def side_inputs():
    \"\"\"The explicit mask (True = visible), the bias and the sink logits, drawn as attn-doctor draws them: from
    their own generator (seed + 1000003), in this order.\"\"\"
    b, s, skv, h = (CASE[k] for k in ("batch", "seq", "seq_kv", "heads"))
    mask, bias, sink = CASE["mask"], CASE.get("bias", "no_bias"), CASE.get("softmax", "vanilla")
    explicit = tensor = logits = None
    if mask == "arbitrary" or bias != "no_bias" or sink != "vanilla":
        g = torch.Generator(device=DEVICE).manual_seed(CASE["seed"] + 1000003)
        if mask == "arbitrary":
            fraction = float((CASE["mask_source"].split(":") + ["0.25"])[1] or 0.25)
            explicit = torch.rand(b, 1, s, skv, generator=g, device=DEVICE) >= fraction
        if bias.startswith("post_scale_bias:"):
            shape = bias.split(":")[1]
            sizes = {"1": 1, "b": b, "h": h}
            dims = (sizes[shape[0]], sizes[shape[1]], s if shape[2] == "s" else 1, skv)
            tensor = torch.randn(dims, generator=g, device=DEVICE).to(DTYPE)
        if sink == "off-by-one":
            logits = torch.zeros(h, device=DEVICE)
        elif sink == "learnable":
            logits = torch.randn(h, generator=g, device=DEVICE)
    return explicit, tensor, logits


def diagonal(b):
    \"\"\"TE's diagonal: 0 (top-left) for causal / padding_causal; len_kv - len_q (bottom-right) for the
    *_bottom_right masks and, with a sliding window (and for ALiBi), for no_mask / padding / arbitrary.\"\"\"
    if CASE["mask"] in ("causal", "padding_causal"):
        return 0
    return lengths("kv")[b] - lengths("q")[b]


def allowed():
    \"\"\"[batch, 1, seq, seq_kv] True where query i sees key j (TE's get_full_mask): padding, causal diagonal,
    sliding window, explicit mask.\"\"\"
    b, s, skv = CASE["batch"], CASE["seq"], CASE["seq_kv"]
    left, right = CASE["window"] if CASE["window"] is not None else (-1, -1)
    if "causal" in CASE["mask"]:
        right = 0
    masks = []
    for n in range(b):
        aligned = CASE["mask"].endswith("bottom_right") or CASE["window"] is not None
        diag = diagonal(n) if aligned else 0
        i = torch.arange(s, device=DEVICE)[:, None] + diag
        j = torch.arange(skv, device=DEVICE)[None, :]
        m = (torch.arange(s, device=DEVICE)[:, None] < lengths("q")[n]) & (j < lengths("kv")[n])
        if right >= 0:
            m = m & (j <= i + right)
        if left >= 0:
            m = m & (j >= i - left)
        masks.append(m)
    mask = torch.stack(masks)[:, None]
    return mask & EXPLICIT if EXPLICIT is not None else mask


def alibi_slopes(h):
    n = 2 ** (h.bit_length() - 1)
    return [2 ** (-8 * k / n) for k in range(1, n + 1)] + [2 ** (-4 * k / n) for k in range(1, 2 * (h - n), 2)]


def dense_bias():
    \"\"\"The bias added to the scaled scores, broadcastable to [batch, heads, seq, seq_kv] (ALiBi: TE's
    -slope_h |i + diag - j| with its default slopes), float64; None without.\"\"\"
    if CASE.get("bias", "no_bias") != "alibi":
        return None if BIAS is None else BIAS.double()
    slopes = torch.tensor(alibi_slopes(CASE["heads"]), dtype=torch.float64, device=DEVICE)[None, :, None, None]
    rows = []
    for n in range(CASE["batch"]):
        i = torch.arange(CASE["seq"], device=DEVICE)[:, None] + diagonal(n)
        rows.append(-(i - torch.arange(CASE["seq_kv"], device=DEVICE)[None, :]).abs().double())
    return torch.stack(rows)[:, None] * slopes


def to_format(t, fmt, side="q"):
    \"\"\"A bshd tensor in `fmt`; thd: the sequences' tokens one after the other, each in its slot.\"\"\"
    if fmt == "thd":
        return t.reshape(-1, *t.shape[2:])[token_index(side, t.shape[1])]
    return t if fmt == "bshd" else t.transpose(0, 1)


def slots(side):
    n, longest = lengths(side), CASE["seq"] if side == "q" else CASE["seq_kv"]
    return [min(longest, (x // 8 + 1) * 8) for x in n] if CASE.get("pad_between_seqs") else n


def token_index(side, seq):
    return torch.cat([torch.arange(n, device=DEVICE) + b * seq for b, n in enumerate(slots(side))])


def to_bshd(t, fmt, side="q"):
    if fmt == "thd":
        seq = CASE["seq"] if side == "q" else CASE["seq_kv"]
        flat = torch.zeros(CASE["batch"] * seq, *t.shape[1:], dtype=t.dtype, device=t.device)
        flat.index_copy_(0, token_index(side, seq), t)
        return flat.view(CASE["batch"], seq, *t.shape[1:])
    return t if fmt == "bshd" else t.transpose(0, 1)


def lay_out(q, k, v, fmt, layout):
    \"\"\"q, k, v as the views of `layout`, in format fmt, requiring grad.\"\"\"
    leaf = lambda t: t.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
    sides = ((q, "q"), (k, "kv"), (v, "kv"))
    if layout == "contiguous":
        return [leaf(to_format(t, fmt, side)) for t, side in sides]
    if layout == "transposed":  # the other storage order, seen through a transpose
        other = "sbhd" if fmt == "bshd" else "bshd"
        return [leaf(to_format(t, other)).transpose(0, 1) for t in (q, k, v)]
    if layout == "head_slice":  # the second half of a tensor with twice the heads
        g = torch.Generator(device=DEVICE).manual_seed(7)
        out = []
        for t, side in sides:
            other = torch.randn(t.shape, generator=g, device=DEVICE, dtype=torch.float32).to(t.dtype)
            wide = leaf(to_format(torch.cat([other, t], dim=2), fmt, side))
            out.append(wide[..., t.shape[2]:, :])
        return out
    if layout in ("qkv_3hd", "qkv_h3d", "kv_2hd", "kv_h2d"):  # TE's packed layouts: slices of one buffer
        dim = -2 if layout.endswith(("h3d", "h2d")) else -3
        tensors = [to_format(t, fmt, side) for t, side in sides]
        if layout.startswith("kv"):
            buffer = leaf(torch.stack(tensors[1:], dim=dim))
            return [leaf(tensors[0]), buffer.select(dim, 0), buffer.select(dim, 1)]
        buffer = leaf(torch.stack(tensors, dim=dim))
        return [buffer.select(dim, i) for i in range(3)]
    if layout == "sb3hd_packed":  # one [s, b, 3, h, d] buffer
        buffer = leaf(torch.stack([t.transpose(0, 1) for t in (q, k, v)], dim=2))
        views = [buffer[:, :, i] for i in range(3)]
    elif layout == "sbh3d_packed":  # Megatron's mixed [s, b, kv_heads, (group + 2) d]
        b, s, h, d = q.shape
        hkv = k.shape[2]
        mixed = torch.cat([q.transpose(0, 1).reshape(s, b, hkv, (h // hkv) * d),
                           k.transpose(0, 1).reshape(s, b, hkv, d), v.transpose(0, 1).reshape(s, b, hkv, d)], -1)
        buffer = leaf(mixed)
        qp, kv_k, kv_v = torch.split(buffer, [(h // hkv) * d, d, d], dim=-1)
        views = [qp.reshape(s, b, h, d), kv_k, kv_v]
    else:
        raise SystemExit(f"unknown layout {layout}")
    return [x.transpose(0, 1) for x in views] if fmt == "bshd" else views


def reference(q, k, v, dout):
    \"\"\"Float64 out, dq, dk, dv (bshd) and the learnable sink's gradient by the plain formula, each with the
    squared size of the terms its rows are summed from ([b, s, h]): out_i = sum_j P_ij v_j,
    dV_j = sum_i P_ij dO_i, dQ_i = c sum_j dS_ij k_j, dK_j = c sum_i dS_ij q_i, with dS_ij = P_ij (dP_ij - D_i)
    sized P_ij (|dO_i * v_j| + |dO_i * out_i|); d sink_h = -sum_i P_sink,i D_i.\"\"\"
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    sink64 = SINK.detach().double().requires_grad_() if SINK is not None else None
    group = q.shape[2] // k.shape[2]
    c = CASE["scale"]
    qh = q64.transpose(1, 2)
    kh, vh = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (k64, v64))
    scores = (qh @ kh.transpose(-1, -2)) * c
    bias = dense_bias()
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed(), float("-inf"))
    seq_kv = scores.shape[-1]
    if sink64 is not None:
        scores = torch.cat([scores, sink64[None, :, None, None].expand(*scores.shape[:-1], 1)], -1)
    probs_all = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    probs = probs_all[..., :seq_kv]
    out = (probs @ vh).transpose(1, 2)
    leaves = (q64, k64, v64) + ((sink64,) if sink64 is not None else ())
    grads = torch.autograd.grad(out, leaves, dout.double(), allow_unused=True)
    with torch.no_grad():
        do_h = dout.double().transpose(1, 2)
        a = (do_h.square() @ vh.square().transpose(-1, -2)).sqrt()  # |dO_i * v_j|
        b = (do_h * out.transpose(1, 2)).square().sum(-1, keepdim=True).sqrt()  # |dO_i * out_i|
        sizes = (probs * (a + b)) ** 2
        # scores and log-sum-exp are fp32 in kernels: P's error grows with |lse| (g^2 per row)
        lse = torch.logsumexp(scores, dim=-1)
        g2 = (1 + 2 * SCORE_PRECISION * torch.where(torch.isfinite(lse), lse, 0.0).abs()) ** 2
        sq = lambda t: t.square().sum(-1)
        per_kv = lambda t: t.view(t.shape[0], k.shape[2], group, *t.shape[2:]).sum(2).transpose(1, 2)
        mv = lambda m, w: (m @ w[..., None]).squeeze(-1)
        both = lambda rows: torch.stack([rows, rows * g2], -1)  # as they are, and the noise's scale
        summed = lambda m, w: torch.stack([mv(m, w), mv(m, w * g2)], -1)
        terms = [both(mv(probs.square(), sq(vh))).transpose(1, 2),
                 both(mv(sizes, sq(kh))).transpose(1, 2) * c * c,
                 per_kv(summed(sizes.transpose(-1, -2), sq(qh))) * c * c,
                 per_kv(summed(probs.square().transpose(-1, -2), sq(do_h)))]
        found = [(t.detach(), terms[i]) for i, t in enumerate((out, *grads[:3]))]
        if CASE.get("softmax") == "learnable":
            sink_terms = both((probs_all[..., seq_kv] * b[..., 0]).square()).sum(dim=(0, 2))
            found.append((grads[3].view(1, 1, -1, 1), sink_terms.view(1, 1, -1, 2)))
    return found


def quantize(x, forward_format, backward_format):
    \"\"\"FP8 cases: x rounded to an FP8 format with a per-tensor amax scale, its gradient rounded too (the
    baseline simulates a correct FP8 attention: the yardstick of an FP8 kernel).\"\"\"
    formats = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

    def rounded(t, fmt):
        if fmt is None or not torch.isfinite(t.abs().amax()) or t.abs().amax() == 0:
            return t
        scale = torch.finfo(formats[fmt]).max / t.detach().abs().amax().float()
        return ((t.float() * scale).to(formats[fmt]).float() / scale).to(t.dtype)

    class Quantize(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return rounded(t, forward_format)

        @staticmethod
        def backward(ctx, grad):
            return rounded(grad, backward_format)

    return Quantize.apply(x)


def megatron_local(q, k, v, sink=None):
    \"\"\"The baseline: Megatron-LM's local core attention (sbhd in/out; bf16 matmuls, fp32 softmax), with the
    case's mask, bias and sink; rows that see no key output 0.\"\"\"
    fp8 = CASE.get("fp8", "none") != "none"
    if fp8:
        q, k, v = (quantize(t, "e4m3", "e5m2") for t in (q, k, v))
    sq, b, h, d = q.shape
    sk, hkv, dv = k.shape[0], k.shape[2], v.shape[-1]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    scores = torch.baddbmm(torch.empty(b * h, sq, sk, dtype=q.dtype, device=q.device),
                           q.reshape(sq, b * h, d).transpose(0, 1), k.reshape(sk, b * h, d).transpose(0, 1).transpose(1, 2),
                           beta=0.0, alpha=CASE["scale"]).view(b, h, sq, sk)
    x = scores.float() if q.dtype != torch.float32 else scores
    if fp8:
        x = quantize(x, None, "e5m2")
    bias = dense_bias()
    if bias is not None:
        x = x + bias.to(x.dtype)
    visible = allowed()
    x = x.masked_fill(~visible, -10000.0)
    if sink is not None:
        x = torch.cat([x, sink.to(x.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)], -1)
    probs = torch.softmax(x, dim=-1)[..., :sk] * visible.any(-1, keepdim=True)
    if fp8:
        probs = quantize(probs, "e4m3", "e5m2")
    probs = probs.to(q.dtype)
    context = torch.bmm(probs.reshape(b * h, sq, sk), v.reshape(sk, b * h, dv).transpose(0, 1))
    out = context.view(b, h, sq, dv).permute(2, 0, 1, 3)
    return quantize(out, "e4m3", "e5m2") if fp8 else out
'''

MAIN = '''

def shards(q, k, v, case):
    """TP shards of the heads (views, or copies when LAYOUT is contiguous), joined along heads."""
    if TP == 1:
        return kernel(q, k, v, case)
    hq, hkv = case["heads"] // TP, case["kv_heads"] // TP
    shard_case = dict(case, heads=hq, kv_heads=hkv)
    outs = []
    for i in range(TP):
        parts = [q[:, :, i * hq:(i + 1) * hq], k[:, :, i * hkv:(i + 1) * hkv], v[:, :, i * hkv:(i + 1) * hkv]]
        if LAYOUT == "contiguous":  # TP shards as contiguous copies; head_slice: as views
            parts = [p.contiguous() for p in parts]
        outs.append(kernel(*parts, shard_case))
    return torch.cat(outs, dim=2)


def over(a, b):
    """a / b, where b == 0 means: 0 if a is 0 too, else infinitely large."""
    return a / b if b > 0 else (0.0 if a == 0 else float("inf"))


def errors(x, ref, terms, rows=None, empty=None):
    """A tensor measured as attn-doctor measures it (finite entries of the compared rows only): relative error;
    error over the terms' scale (sqrt(|ref|^2 + terms)), whole and worst (batch, head) slice; how much the
    exact tensor cancels; its systematic part (the error's projection on ref) with its z-score, whole and for
    the most significant slice; NaN/Inf count; on `empty` rows (queries that see no key) the largest value
    over a compared row's RMS size, and NaN/Inf there. `rows`/`empty`: [b, s] booleans (None: all / none)."""
    x = x.double()
    empty_max = empty_nonfinite = 0
    if empty is not None and bool(empty.any()):
        on_empty = x[empty]
        empty_nonfinite = int((~torch.isfinite(on_empty)).sum())
        empty_max = float(torch.nan_to_num(on_empty, nan=0.0, posinf=0.0, neginf=0.0).abs().max())
    if rows is not None:
        keep = rows[:, :, None, None]
        x, ref, terms = torch.where(keep, x, 0.0), torch.where(keep, ref, 0.0), torch.where(keep, terms, 0.0)
    finite = torch.isfinite(x) & torch.isfinite(ref)
    nonfinite = int((~torch.isfinite(x)).sum())
    diff = torch.where(finite, x - ref, 0.0)
    r = torch.where(finite, ref, 0.0)
    head_diff, head_ref = diff.square().sum((1, 3)), r.square().sum((1, 3))
    head_scale, head_noise = head_ref + terms[..., 0].sum(1), head_ref + terms[..., 1].sum(1)
    err, ref_norm, scale = float(head_diff.sum()) ** 0.5, float(head_ref.sum()) ** 0.5, float(head_scale.sum()) ** 0.5
    worst = max((over(float(e), float(s)) for e, s in zip(head_diff.flatten(), head_scale.flatten())), default=0.0)
    proj = (diff * r).sum(3)  # one projection per row: rows' rounding errors are independent
    head_proj, head_proj_sq = proj.sum(1), proj.square().sum(1)

    def bias(p, p_sq, r_sq):
        return (p / r_sq, p / p_sq ** 0.5) if r_sq > 0 and p_sq > 0 else (0.0, 0.0)

    whole = bias(float(head_proj.sum()), float(head_proj_sq.sum()), float(head_ref.sum()))
    heads = [bias(float(p), float(p2), float(r2)) for p, p2, r2 in
             zip(head_proj.flatten(), head_proj_sq.flatten(), head_ref.flatten())]
    head = max(heads, key=lambda bz: abs(bz[1]), default=(0.0, 0.0))
    noise = over(float(head_noise.sum()), float(head_scale.sum())) ** 0.5 if scale > 0 else 1.0
    head_noise = max((float(n / s) if s > 0 else 1.0 for n, s in zip(head_noise.flatten(), head_scale.flatten())),
                     default=1.0) ** 0.5
    counted = (int(rows.sum()) if rows is not None else x.shape[0] * x.shape[1]) * x.shape[2]
    row_size = (float(head_ref.sum()) / counted) ** 0.5 if counted else 0.0
    return {"rel": over(err, ref_norm), "scaled": over(err, scale), "worst": worst ** 0.5,
            "noise": noise, "head_noise": head_noise,
            "cancellation": ref_norm / scale if scale > 0 else 1.0, "bias": whole, "head_bias": head,
            "nonfinite": nonfinite, "empty_max": over(empty_max, row_size), "empty_nonfinite": empty_nonfinite}


def judge(m, base):
    """attn-doctor's rule: (failed, shown error, ratio to the yardstick, why)."""
    yardstick, head_yardstick = max(base["scaled"], NOISE * m["noise"]), max(base["worst"], NOISE * m["head_noise"])
    ratio = over(m["scaled"], yardstick)
    cancelled = m["cancellation"] < CANCELLED
    shown = m["scaled"] if cancelled else m["rel"]
    if m["nonfinite"]:
        return True, shown, ratio, "NaN/Inf"
    if m["empty_nonfinite"] or m["empty_max"] > EMPTY_ROW_LIMIT:
        return True, shown, ratio, "non-zero output or gradient on rows that see no key (TE's convention: 0)"
    if ratio > MULTIPLE:
        return True, shown, ratio, "error above the yardstick"
    if over(m["worst"], head_yardstick) > MULTIPLE:
        return True, shown, ratio, "worst head's error above the yardstick"
    if not cancelled:
        limit_whole = max(BIAS_FLOOR, MULTIPLE * abs(base["bias"][0]))
        limit_head = max(BIAS_FLOOR, MULTIPLE * max(abs(base["bias"][0]), abs(base["head_bias"][0])))
        for (b, z), limit in ((m["bias"], limit_whole), (m["head_bias"], limit_head)):
            if abs(z) >= BIAS_Z and abs(b) >= limit:
                return True, shown, ratio, f"systematic error: {1 + b:.4f}x the exact values (z = {z:.0f})"
    return False, shown, ratio, ""


def run(backend, fmt, layout, q, k, v, dout):
    """out, dq, dk, dv (bshd) of `backend` on the layout's views, and the sink's gradient (learnable sinks)."""
    global SINK_LEAF, WARMUP_DOUT
    qkv = lay_out(q, k, v, fmt, layout)
    WARMUP_DOUT = to_format(dout, fmt).contiguous()  # FP8 delayed scaling's warm-up step uses it
    sink = SINK.detach().clone().requires_grad_() if CASE.get("softmax") == "learnable" else SINK
    SINK_LEAF = None
    out = backend(*qkv, dict(CASE, sink=sink))
    target = (SINK_LEAF if SINK_LEAF is not None else sink) if CASE.get("softmax") == "learnable" else None
    leaves = list(qkv) + ([target] if target is not None else [])
    grads = torch.autograd.grad(out, leaves, to_format(dout, fmt).contiguous(), allow_unused=True)
    found = [to_bshd(t.detach(), fmt, side) for t, side in zip((out, *grads[:3]), ("q", "q", "kv", "kv"))]
    if target is not None:
        found.append((grads[3] if grads[3] is not None else torch.zeros_like(target)).detach().view(1, 1, -1, 1))
    return found


def rows_compared():
    """Per tensor: the rows compared (valid tokens that see a key; valid keys) and the rows that see no key."""
    visible = allowed()[:, 0]
    valid_q = torch.arange(CASE["seq"], device=DEVICE)[None, :] < torch.tensor(lengths("q"), device=DEVICE)[:, None]
    valid_kv = torch.arange(CASE["seq_kv"], device=DEVICE)[None, :] < torch.tensor(lengths("kv"), device=DEVICE)[:, None]
    seeing = visible.any(-1)
    q_side = (valid_q & seeing, valid_q & ~seeing)
    return [q_side, q_side, (valid_kv, None), (valid_kv, None), (None, None)]


def main():
    global EXPLICIT, BIAS, SINK
    q, k, v, dout = inputs()
    EXPLICIT, BIAS, SINK = side_inputs()
    ref = reference(q, k, v, dout)
    got = run(shards, FORMAT, LAYOUT if TP == 1 else "contiguous", q, k, v, dout)
    base = run(lambda q, k, v, case: megatron_local(q, k, v, case["sink"]), "sbhd", "contiguous", q, k, v, dout)
    wrong = []
    print(f"{'tensor':6} {'err':>10}  {'ratio':>10}  (err: relative to float64; * against the terms' scale,"
          " where the exact tensor cancels; ratio: to the local baseline's error, or to rounding noise)")
    names = ("out", "dq", "dk", "dv", "dsink")
    for name, x, b, (r, terms), (rows, empty) in zip(names, got, base, ref, rows_compared()):
        measured = errors(x, r, terms, rows, empty)
        failed, shown, ratio, why = judge(measured, errors(b, r, terms, rows, empty))
        star = "*" if measured["cancellation"] < CANCELLED else " "
        print(f"{name:6} {shown:10.3e}{star} {ratio:9.2f}x" + (f"  WRONG: {why}" if failed else ""))
        if failed:
            wrong.append(name)
    print("STILL WRONG: " + ", ".join(wrong) if wrong else "FIXED: every tensor agrees with float64", flush=True)
    sys.stderr.flush()
    # The exit status is the verdict; os._exit keeps CUDA/TE teardown at interpreter exit from changing it.
    os._exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
'''


def _env_lines(env: EnvReport | None) -> str:
    if env is None:
        return "  (not recorded)"
    from attn_doctor.machine.env_rows import env_rows

    return "\n".join(f"  {label}: {value}" for label, value in env_rows(env) if label != "env vars")


def short_id(coords: Coords) -> str:
    from attn_doctor.bisect.knobs import knob_dict

    return hashlib.sha1(json.dumps([coords.backend.name, knob_dict(coords)], sort_keys=True).encode()).hexdigest()[:8]


def repro_name(coords: Coords) -> str:
    """repro_<backend>_<short-id>.py: the file name of a probe's repro."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in coords.backend.name)
    return f"repro_{safe}_{short_id(coords)}.py"


def repro_text(coords: Coords, env: EnvReport | None, version: str, command: str) -> str:
    """The standalone repro script of a failing probe, one call or TP shards (ValueError for a depth stack
    or ranks: those are reproduced by attn-doctor itself)."""
    from attn_doctor.backends import repro_source
    from attn_doctor.core.coords import ProbeKind

    if coords.layers or coords.kind is ProbeKind.DISTRIBUTED:
        raise ValueError("a depth or multi-rank failure is reproduced by attn-doctor; the standalone repro covers "
                         "one call")
    if coords.case.replay is not None:
        return _replay_repro_text(coords, version, command)
    backend = coords.backend.name
    case = {**coords.case.to_dict(), "scale": coords.case.softmax_scale}  # resolved once for every reader
    dtype = coords.case.dtype
    text = HEADER.format(title=f"{backend} on {coords.describe()}", version=version, command=command.replace('"', "'"),
                         env=_env_lines(env), multiple=max(MULTIPLE.values()), case=repr(case),
                         layout=coords.layout, tp=coords.tp, eps=EPS[dtype], noise=NOISE_EPS[dtype],
                         bias_z=BIAS_Z, bias_eps=BIAS_EPS[dtype], cancelled=CANCELLED,
                         score_precision=SCORE_PRECISION[dtype], empty_row_eps=EMPTY_ROW_EPS)
    return text + INPUTS + repro_source(coords.backend) + MAIN


def write_repro(directory: Path, coords: Coords, env: EnvReport | None, version: str, command: str) -> Path:
    """Write repro_<backend>_<short-id>.py for the (minimal) failing probe, one call or TP shards."""
    text = repro_text(coords, env, version, command)
    path = Path(directory) / repro_name(coords)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


REPLAY_REPRO = '''"""attn-doctor {version}: {title}.

This fault needs the values and views of a captured call, so this repro re-runs attn-doctor on the capture
rather than drawing inputs of its own: it needs attn-doctor installed and the capture folder
{capture} (attach it to a bug report along with this file). Exit 1 while the path is wrong, 0 once fixed.

Found by: {command}
"""

import subprocess
import sys

sys.exit(subprocess.call([sys.executable, "-m", "attn_doctor", *{arguments!r}]))
'''


def _replay_repro_text(coords: Coords, version: str, command: str) -> str:
    """The repro of a failing probe that still needs its captured call: `attn-doctor run --replay ...`."""
    import shlex

    from attn_doctor.backends import selector

    arguments = shlex.split(coords.repro_command(selector(coords.backend)))[1:]
    return REPLAY_REPRO.format(version=version, title=f"{coords.backend.name} on {coords.describe()}",
                               capture=coords.case.replay.rpartition("@")[0], command=command.replace('"', "'"),
                               arguments=arguments)
