#!/usr/bin/env python3
"""Repro: te.flash on b1 s1 h1 d8 fp16 causal layout=contiguous

Made by attn-doctor 0.1.0 (attn-doctor bisect --backend te.flash --batch 2 --seq 128 --heads 4 --head-dim 64 --mask causal --layout contiguous --out /tmp/verdicts-5/bisect-te-flash --json /tmp/verdicts-5/bisect-te-flash/bisect.json).
Environment it was made on:
  Python: 3.12.3 (CPython)
  platform: Linux-6.18.44-fc-v973-gpu-x86_64-with-glibc2.39
  OS: Ubuntu 24.04.3 LTS
  CPU: Intel(R) Xeon(R) Processor, 16 logical cores
  NVIDIA driver: 580.159.04
  GPU 0: NVIDIA H200, sm_90, 143771 MiB
  torch: 2.11.0+cu130
  torch CUDA: 13.0
  torch cuDNN: 9.19.0 (91900)
  CUDA available: yes
  Transformer Engine: 2.20.2
  TE core: transformer-engine-cu13 2.20.2
  TE torch: 2.20.2
  TE cuDNN: 9.14.0 (91400) (differs from torch's cuDNN 9.19.0: two cuDNN libraries are loaded in one process)
  flash-attn v2: n/a (not installed)
  flash-attn v3: n/a (not installed)
  flash-attn v4: 4.0.0b36
Exit code: 1 while the kernel path is still wrong, 0 once it agrees with float64 as closely as
Megatron's local attention, by the same rule as attn-doctor: each tensor's error, measured against the
scale of the terms it is summed from, may be at most 3 x the baseline's (never less than
rounding noise), whole tensor and worst (batch, head) slice; a systematic error beyond rounding and
NaN/Inf fail too.
"""
import os
import sys

import torch
import torch.nn.functional as F

CASE = {'batch': 1, 'seq': 1, 'heads': 1, 'head_dim': 8, 'kv_heads': 1, 'seq_kv': 1, 'dtype': 'fp16', 'mask': 'causal', 'window': None, 'seed': 1234}
LAYOUT = 'contiguous'
TP = 1
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[CASE["dtype"]]
EPS = 0.0009765625
MULTIPLE, NOISE = 3.0, 0.25 * EPS  # the yardstick is never below NOISE (rounding noise)
BIAS_Z, BIAS_FLOOR = 8.0, 1.0 * EPS  # a systematic error FAILs beyond these
CANCELLED = 0.0625  # the exact tensor cancels where its norm is below this share of its terms'
SCORE_PRECISION = 0.0001220703125  # fp32 scores' roundoff over the inputs'


def inputs():
    """Seeded q, k, v, dout in bshd, exactly as attn-doctor draws them: in fp32 from one generator, in this
    order, then rounded to the dtype. q, k, v follow the case's distribution; dout is standard normal."""
    g = torch.Generator(device=DEVICE).manual_seed(CASE["seed"])
    b, s, skv, h, hkv, d = (CASE[k] for k in ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim"))
    randn = lambda *shape: torch.randn(shape, generator=g, device=DEVICE, dtype=torch.float32)
    kind = CASE.get("inputs", "normal")
    if kind == "uniform":  # U(-sqrt 3, sqrt 3): unit variance, no tails
        uniform = lambda *shape: torch.rand(shape, generator=g, device=DEVICE, dtype=torch.float32).mul_(2.0).sub_(
            1.0).mul_(3 ** 0.5).to(DTYPE)
        q, k, v = uniform(b, s, h, d), uniform(b, skv, hkv, d), uniform(b, skv, hkv, d)
    elif kind == "structured":  # rank-4 q, k, v; every key of a head shares a mean vector (keys nearly equal)
        rank = min(4, d)

        def low_rank(n, heads):  # per token `rank` coefficients of a per-head basis
            coefficients, basis = randn(b, n, heads, rank), randn(heads, rank, d)
            x = coefficients[..., 0, None] * basis[:, 0]
            for i in range(1, rank):
                x.addcmul_(coefficients[..., i, None], basis[:, i])
            return x.div_(rank ** 0.5)

        q = low_rank(s, h).to(DTYPE)
        k = low_rank(skv, hkv)
        k = k.add_(randn(hkv, d).mul_(4.0)).to(DTYPE)
        v = low_rank(skv, hkv).to(DTYPE)
    else:  # normal; outliers: a few head-dim channels x20 in q, k, v; large-logits: q and k x4 (scores' std ~16)
        q_scale = k_scale = v_scale = None
        if kind == "outliers":
            channels = torch.ones(d, device=DEVICE, dtype=torch.float32)
            picked = torch.randperm(d, generator=torch.Generator().manual_seed(CASE["seed"]))[:max(1, d // 32)]
            channels[sorted(picked.tolist())] = 20.0
            q_scale = k_scale = v_scale = channels
        elif kind == "large-logits":
            q_scale = k_scale = 4.0

        def draw(scale, *shape):
            x = randn(*shape)
            return (x if scale is None else x.mul_(scale)).to(DTYPE)

        q, k, v = draw(q_scale, b, s, h, d), draw(k_scale, b, skv, hkv, d), draw(v_scale, b, skv, hkv, d)
    return q, k, v, randn(b, s, h, d).to(DTYPE)


def to_format(t, fmt):
    return t if fmt == "bshd" else t.transpose(0, 1)


def lay_out(q, k, v, fmt, layout):
    """q, k, v as the views of `layout`, in format fmt, requiring grad."""
    leaf = lambda t: t.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
    if layout == "contiguous":
        return [leaf(to_format(t, fmt)) for t in (q, k, v)]
    if layout == "transposed":  # the other storage order, seen through a transpose
        other = "sbhd" if fmt == "bshd" else "bshd"
        return [leaf(to_format(t, other)).transpose(0, 1) for t in (q, k, v)]
    if layout == "head_slice":  # the second half of a tensor with twice the heads
        g = torch.Generator(device=DEVICE).manual_seed(7)
        out = []
        for t in (q, k, v):
            other = torch.randn(t.shape, generator=g, device=DEVICE, dtype=torch.float32).to(t.dtype)
            wide = leaf(to_format(torch.cat([other, t], dim=2), fmt))
            out.append(wide[:, :, t.shape[2]:])
        return out
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


def allowed(sq, sk):
    left, right = CASE["window"] if CASE["window"] is not None else (-1, -1)
    if CASE["mask"] == "causal":
        right = 0 if right < 0 else min(right, 0)
    i, j = torch.arange(sq, device=DEVICE)[:, None], torch.arange(sk, device=DEVICE)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=DEVICE)
    if right >= 0:
        mask &= j <= i + right
    if left >= 0:
        mask &= j >= i - left
    return mask


def reference(q, k, v, dout):
    """Float64 out, dq, dk, dv (bshd) by the plain formula, each with the squared size of the terms its rows
    are summed from ([b, s, h]): out_i = sum_j P_ij v_j, dV_j = sum_i P_ij dO_i, dQ_i = c sum_j dS_ij k_j,
    dK_j = c sum_i dS_ij q_i, with dS_ij = P_ij (dP_ij - D_i) sized P_ij (|dO_i * v_j| + |dO_i * out_i|)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    c = CASE["head_dim"] ** -0.5
    qh = q64.transpose(1, 2)
    kh, vh = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (k64, v64))
    scores = (qh @ kh.transpose(-1, -2)) * c
    scores = scores.masked_fill(~allowed(q.shape[1], k.shape[1]), float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = (probs @ vh).transpose(1, 2)
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
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
    return [(t.detach(), terms[i]) for i, t in enumerate((out, *grads))]


def megatron_local(q, k, v):
    """The baseline: Megatron-LM's local core attention (sbhd in/out; bf16 matmuls, fp32 softmax)."""
    sq, b, h, d = q.shape
    sk, hkv = k.shape[0], k.shape[2]
    k, v = (t.repeat_interleave(h // hkv, dim=2) for t in (k, v))
    scores = torch.baddbmm(torch.empty(b * h, sq, sk, dtype=q.dtype, device=q.device),
                           q.reshape(sq, b * h, d).transpose(0, 1), k.reshape(sk, b * h, d).transpose(0, 1).transpose(1, 2),
                           beta=0.0, alpha=d ** -0.5).view(b, h, sq, sk)
    x = scores.float() if q.dtype != torch.float32 else scores
    probs = torch.softmax(x.masked_fill(~allowed(sq, sk), -10000.0), dim=-1).to(q.dtype)
    context = torch.bmm(probs.view(b * h, sq, sk), v.reshape(sk, b * h, d).transpose(0, 1))
    return context.view(b, h, sq, d).permute(2, 0, 1, 3)


FORMAT = "sbhd"
# Force TE's flash backend the way TE's own tests do: only its flag on, selection cache invalidated.
os.environ.update({'NVTE_FLASH_ATTN': '1', 'NVTE_FUSED_ATTN': '0', 'NVTE_UNFUSED_ATTN': '0'})
os.environ.pop("NVTE_FUSED_ATTN_BACKEND", None)
import transformer_engine.pytorch as te  # noqa: E402  (after the flags: TE reads NVTE_* at import and per call)
from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa  # noqa: E402


def kernel(q, k, v, case):
    dpa._attention_backends["backend_selection_requires_update"] = True
    module = te.DotProductAttention(case["heads"], case["head_dim"], num_gqa_groups=case["kv_heads"],
                                    attention_dropout=0.0, qkv_format="sbhd",
                                    attn_mask_type="causal" if case["mask"] == "causal" else "no_mask",
                                    window_size=tuple(case["window"]) if case["window"] else None)
    out = module(q, k, v)
    state = dpa._attention_backends
    print("TE ran:", "FusedAttention sub-backend %s" % int(state["fused_attention_backend"])
          if state["use_fused_attention"] else "FlashAttention" if state["use_flash_attention"] else "Unfused",
          "| deterministic: DotProductAttention %s, backend selection %s" % (
              getattr(module, "deterministic", "?"), getattr(state["attention_params"], "deterministic", "?")))
    return out.view(q.shape[0], q.shape[1], case["heads"], case["head_dim"])


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


def errors(x, ref, terms):
    """A tensor measured as attn-doctor measures it (finite entries only): relative error; error over the
    terms' scale (sqrt(|ref|^2 + terms)), whole and worst (batch, head) slice; how much the exact tensor
    cancels; its systematic part (the error's projection on ref) with its z-score, whole and for the most
    significant slice; NaN/Inf count."""
    x = x.double()
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
    return {"rel": over(err, ref_norm), "scaled": over(err, scale), "worst": worst ** 0.5,
            "noise": noise, "head_noise": head_noise,
            "cancellation": ref_norm / scale if scale > 0 else 1.0, "bias": whole, "head_bias": head,
            "nonfinite": nonfinite}


def judge(m, base):
    """attn-doctor's rule: (failed, shown error, ratio to the yardstick, why)."""
    yardstick, head_yardstick = max(base["scaled"], NOISE * m["noise"]), max(base["worst"], NOISE * m["head_noise"])
    ratio = over(m["scaled"], yardstick)
    cancelled = m["cancellation"] < CANCELLED
    shown = m["scaled"] if cancelled else m["rel"]
    if m["nonfinite"]:
        return True, shown, ratio, "NaN/Inf"
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
    qkv = lay_out(q, k, v, fmt, layout)
    out = backend(*qkv, CASE)
    grads = torch.autograd.grad(out, qkv, to_format(dout, fmt).contiguous())
    return [to_format(t.detach(), fmt) for t in (out, *grads)]


def main():
    q, k, v, dout = inputs()
    ref = reference(q, k, v, dout)
    got = run(shards, FORMAT, LAYOUT if TP == 1 else "contiguous", q, k, v, dout)
    base = run(lambda q, k, v, case: megatron_local(q, k, v), "sbhd", "contiguous", q, k, v, dout)
    wrong = []
    print(f"{'tensor':6} {'err':>10}  {'ratio':>10}  (err: relative to float64; * against the terms' scale,"
          " where the exact tensor cancels; ratio: to the local baseline's error, or to rounding noise)")
    for name, x, b, (r, terms) in zip(("out", "dq", "dk", "dv"), got, base, ref):
        measured = errors(x, r, terms)
        failed, shown, ratio, why = judge(measured, errors(b, r, terms))
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
