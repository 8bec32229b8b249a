#!/usr/bin/env python3
"""te.fused@te-2.18.0@cudnn-9.14.0 on b1 s2 h1 d8 bf16 no_mask bias:111s layout=contiguous

Made by attn-doctor 0.1.0 on NVIDIA H100 80GB HBM3 (TE 2.20.2, torch 2.11.0+cu130).
Run on the build it failed on: D=/usr/lib/x86_64-linux-gnu; env CUDNN_HOME="$D" CUDNN_PATH="$D" LD_LIBRARY_PATH="$D" LD_PRELOAD="$D/libcudnn.so.9:$D/libcudnn_adv.so.9:$D/libcudnn_cnn.so.9:$D/libcudnn_engines_precompiled.so.9:$D/libcudnn_engines_runtime_compiled.so.9:$D/libcudnn_graph.so.9:$D/libcudnn_heuristic.so.9:$D/libcudnn_ops.so.9" python3 THIS_FILE
Exits 1 while a tensor is wrong by attn-doctor's rule (`judge`), 0 once every one is right.
"""
import math
import os
import torch
os.environ.update({'NVTE_FLASH_ATTN': '0', 'NVTE_FUSED_ATTN': '1', 'NVTE_UNFUSED_ATTN': '0'})  # TE's fused path alone
os.environ.pop("NVTE_FUSED_ATTN_BACKEND", None)
import transformer_engine.pytorch as te
import transformer_engine_torch as tex
from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, S, SKV, H, HKV, D, DV, SEED = 1, 2, 2, 1, 1, 8, 8, 1234
DTYPE, SCALE = torch.bfloat16, 0.35355339059327373  # the inputs' dtype, softmax scale
EPS, FLOOR, MULTIPLE, CANCELLED, BIAS_Z, BIAS_MIN, SCORE_U = 2**-7, 0.25 * 2**-7, 3.0, 2**-4, 8.0, 1.0 * 2**-7, 2**-16
def inputs():  # q, k, v, dout (bshd), as attn-doctor draws them
    g = torch.Generator(DEVICE).manual_seed(SEED)
    return [torch.randn(shape, generator=g, device=DEVICE).to(DTYPE)
            for shape in ((B, S, H, D), (B, SKV, HKV, D), (B, SKV, HKV, DV), (B, S, H, DV))]
side = torch.Generator(DEVICE).manual_seed(SEED + 1000003)  # the mask's and the bias's own generator
BIAS_IN = torch.randn((1, 1, 1, 2), generator=side, device=DEVICE).to(DTYPE)  # as TE takes it
BIAS = BIAS_IN.double()  # added to the scaled scores
to_fmt = to_bshd = lambda t, side: t.transpose(0, 1)  # sbhd views of bshd tensors
leaf = lambda t: t.detach().clone(memory_format=torch.contiguous_format).requires_grad_()
views = lambda q, k, v: [leaf(to_fmt(t, side)) for t, side in zip((q, k, v), ("q", "kv", "kv"))]
def kernel(q, k, v):  # TE's DotProductAttention, as attn-doctor builds and calls it
    module = te.DotProductAttention(num_attention_heads=1, kv_channels=8, num_gqa_groups=1, attention_dropout=0.0,
                                    qkv_format='sbhd', attn_mask_type='no_mask', window_size=None, softmax_scale=SCALE)
    out = module(q, k, v, core_attention_bias_type='post_scale_bias', core_attention_bias=BIAS_IN)
    print("TE ran:", {n: dpa._attention_backends[n] for n in ("use_fused_attention", "fused_attention_backend")},
          "on cuDNN", tex.get_cudnn_version())
    return out.view(*q.shape[:-2], H, DV)

def reference(q, k, v, do):
    # float64, and the squared sizes of the terms each row sums (as they are, and x g^2)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    s = qh @ kh.mT * SCALE + BIAS
    lse = s.logsumexp(-1, keepdim=True)
    p = (s - lse).exp().nan_to_num(0.0)
    out = (p @ vh).transpose(1, 2)
    grads = torch.autograd.grad(out, (q, k, v), do.double())
    p, dh, oh, vh = p.detach(), do.double().transpose(1, 2), out.detach().transpose(1, 2), vh.detach()
    g2 = (1 + 2 * SCORE_U * lse.detach().nan_to_num(0.0, 0.0, 0.0).abs()).square()
    ds = (SCALE * p * ((dh.square() @ vh.square().mT).sqrt() + (dh * oh).square().sum(-1, True).sqrt())).square()
    sq = lambda t: t.detach().square().sum(-1, True)  # squared norms
    by_q = lambda w, x: torch.cat([w @ x, w @ x * g2], -1).transpose(1, 2)
    by_kv = lambda w, x: torch.cat([w.mT @ x, w.mT @ (x * g2)], -1).transpose(1, 2)
    terms = by_q(p.square(), sq(vh)), by_q(ds, sq(kh)), by_kv(ds, sq(qh)), by_kv(p.square(), sq(dh))
    return dict(zip(("out", "dq", "dk", "dv"), zip((out.detach(), *grads), terms)))
def local(q, k, v):  # the baseline: Megatron's local core attention (sbhd)
    s, b = q.shape[:2]
    x = torch.baddbmm(q.new_empty(b * H, s, SKV), q.reshape(s, b * H, D).transpose(0, 1),
                      k.reshape(SKV, b * H, D).transpose(0, 1).transpose(1, 2), beta=0.0, alpha=SCALE)
    probs = (x.view(b, H, s, SKV).float() + BIAS.float()).softmax(-1)
    return torch.bmm(probs.to(q.dtype).reshape(b * H, s, SKV), v.reshape(SKV, b * H, DV).transpose(0, 1)).view(
        b, H, s, DV).permute(2, 0, 1, 3)

ratio = lambda err, scale: err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
def figures(x, r, t):  # x's error against float64 r, as attn-doctor measures it
    x = x.double()
    f = {"nonfinite": int((~x.isfinite()).sum()), "ref_nonfinite": int((~r.isfinite()).sum())}
    ok = x.isfinite() & r.isfinite()
    e, r = (x - r).where(ok, 0.0), r.where(ok, 0.0)
    ee, rr, proj = e.square().sum((1, 3)), r.square().sum((1, 3)), (e * r).sum(3)  # per (batch, head); per row
    scale, noisy, p, p2 = rr + t[..., 0].sum(1), rr + t[..., 1].sum(1), proj.sum(1), proj.square().sum(1)
    total, err, norm = float(scale.sum()), float(ee.sum()) ** 0.5, float(rr.sum()) ** 0.5
    bias_of = lambda p, p2, rr: (0.0, 0.0) if rr <= 0 or p2 <= 0 else (float(p / rr), float(p / p2**0.5))
    f.update(rel=ratio(err, norm), scaled=ratio(err, total**0.5), bias=bias_of(p.sum(), p2.sum(), rr.sum()),
             share=norm / total**0.5 if total > 0 else 1.0,
             noise=(float(noisy.sum()) / total) ** 0.5 if total > 0 else 1.0)
    return f
def judge(m, b, flash=None):
    # attn-doctor's rule: why x (figures m) fails, or "cannot tell: ...", and its error / the yardstick
    own = lambda n: math.hypot(b[n], flash[n]) if flash else b[n]
    bias_limit = max(abs(b["bias"][0]), abs(flash["bias"][0]) if flash else 0.0)
    whole = ratio(m["scaled"], max(own("scaled"), FLOOR * m["noise"]))
    why = ("NaN/Inf" if m["nonfinite"] else f"error {whole:.3g}x the yardstick" if whole > MULTIPLE else "")
    for where, (bias, z), limit in (("", m["bias"], bias_limit),):
        if not why and m["share"] >= CANCELLED and abs(z) >= BIAS_Z and abs(bias) >= max(BIAS_MIN, MULTIPLE * limit):
            why = f"systematic error{where}: {1 + bias:.4f}x the exact values (z = {z:.0f})"
    return ("cannot tell: the baseline has NaN/Inf here" if b["nonfinite"] and why != "NaN/Inf" else why), whole
def flash_moves(q, k, do, out):  # a correct flash-style backward's own error (D from O rounded)
    moved = (do.double() * (out.to(DTYPE).double() - out)).sum(-1, keepdim=True)
    keys = reference(q, k, k, moved * q.double())
    return {"dq": -SCALE * moved * keys["out"][0], "dk": -SCALE * keys["dv"][0]}
def attend(call, views, to_fmt, to_bshd, do):  # out, dq, dk, dv, bshd
    out = call(*views)
    grads = torch.autograd.grad(out, views, to_fmt(do, "q").contiguous())
    return [to_bshd(t.detach(), side) for t, side in zip((out, *grads), ("q", "q", "kv", "kv"))]

if __name__ == "__main__":
    q, k, v, do = inputs()
    ref = reference(q, k, v, do)
    got = attend(kernel, views(q, k, v), to_fmt, to_bshd, do)
    base = attend(local, [leaf(to_fmt(t, "q")) for t in (q, k, v)], to_fmt, to_bshd, do)  # contiguous sbhd
    moves = flash_moves(q, k, do, ref["out"][0])
    flash = {name: figures(ref[name][0] + moves[name], *ref[name]) for name in moves}
    wrong, undecided = [], []
    for name, x, b in zip(ref, got, base):
        m = figures(x, *ref[name])
        why, whole = judge(m, figures(b, *ref[name]), flash.get(name))
        (undecided if why.startswith("cannot") else wrong if why else []).append(name)
        print(f"{name:4} relative {m['rel']:9.3e}, scaled {m['scaled']:9.3e}, {whole:.3g}x the yardstick",
              "WRONG:" * (name in wrong), why)
    print("STILL WRONG: " + ", ".join(wrong) if wrong else "CANNOT TELL: " + ", ".join(undecided) if undecided
          else "FIXED", flush=True)
    os._exit(1 if wrong or undecided else 0)  # the verdict; teardown cannot change it
