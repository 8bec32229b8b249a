#!/usr/bin/env python3
"""Repro: te.fused on b2 s2 h1 d8 fp16 none layout=transposed

Made by attn-doctor 0.1.0 (attn-doctor bisect --from /tmp/o/runs/run-default/results.json --json /tmp/o/runs/bisect/bisect.json --out /tmp/o/runs/bisect).
Environment it was made on:
  Python: 3.12.3 (CPython)
  platform: Linux-6.18.44-fc-v973-gpu-x86_64-with-glibc2.39
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
  flash-attn v4: n/a (not installed)
Exit code: 1 while the kernel path is still wrong, 0 once it agrees with float64 as closely as
Megatron's local attention (the same rule as attn-doctor: error <= 3 x baseline + floor, whole tensor
and worst head; NaN/Inf fails).
"""
import os
import sys

import torch
import torch.nn.functional as F

CASE = {'batch': 2, 'seq': 2, 'heads': 1, 'head_dim': 8, 'kv_heads': 1, 'seq_kv': 2, 'dtype': 'fp16', 'mask': 'none', 'window': None, 'seed': 1234}
LAYOUT = 'transposed'
TP = 1
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[CASE["dtype"]]
MULTIPLE, FLOOR = 3.0, 9.765625e-05


def draw(generator, *shape):
    return torch.randn(shape, generator=generator, device=DEVICE, dtype=torch.float32).to(DTYPE)


def inputs():
    """Seeded q, k, v, dout in bshd, exactly as attn-doctor draws them."""
    g = torch.Generator(device=DEVICE).manual_seed(CASE["seed"])
    b, s, skv, h, hkv, d = (CASE[k] for k in ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim"))
    q, k, v = draw(g, b, s, h, d), draw(g, b, skv, hkv, d), draw(g, b, skv, hkv, d)
    return q, k, v, draw(g, b, s, h, d)


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
    """Float64 out, dq, dk, dv (bshd) by the plain formula."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[2] // k.shape[2]
    qh = q64.transpose(1, 2)
    kh, vh = (t.transpose(1, 2).repeat_interleave(group, dim=1) for t in (k64, v64))
    scores = (qh @ kh.transpose(-1, -2)) * CASE["head_dim"] ** -0.5
    scores = scores.masked_fill(~allowed(q.shape[1], k.shape[1]), float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)
    out = (probs @ vh).transpose(1, 2)
    return (out.detach(), *torch.autograd.grad(out, (q64, k64, v64), dout.double()))


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
# Force TE's fused backend the way TE's own tests do: only its flag on, selection cache invalidated.
os.environ.update({'NVTE_FLASH_ATTN': '0', 'NVTE_FUSED_ATTN': '1', 'NVTE_UNFUSED_ATTN': '0'})
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
          if state["use_fused_attention"] else "FlashAttention" if state["use_flash_attention"] else "Unfused")
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


def errors(x, ref):
    """Relative L2 error (finite entries), its worst (batch, head) slice, and NaN/Inf count."""
    x = x.double()
    finite = torch.isfinite(x) & torch.isfinite(ref)
    nonfinite = int((~torch.isfinite(x)).sum())
    diff = torch.where(finite, x - ref, 0.0)
    r = torch.where(finite, ref, 0.0)
    rel = float(diff.norm() / r.norm())
    worst = float((diff.square().sum((1, 3)) / r.square().sum((1, 3)).clamp_min(1e-300)).max().sqrt())
    return rel, worst, nonfinite


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
    print(f"{'tensor':6} {'rel err':>10} {'baseline':>10} {'ratio':>7} {'worst head':>11} {'NaN/Inf':>8}")
    for name, x, b, r in zip(("out", "dq", "dk", "dv"), got, base, ref):
        rel, worst, bad = errors(x, r)
        base_rel, base_worst, _ = errors(b, r)
        failed = bad > 0 or rel > MULTIPLE * base_rel + FLOOR or worst > MULTIPLE * base_worst + FLOOR
        print(f"{name:6} {rel:10.3e} {base_rel:10.3e} {rel / base_rel:7.2f} {worst:11.3e} {bad:8d}"
              f"{'  WRONG' if failed else ''}")
        if failed:
            wrong.append(name)
    print("STILL WRONG: " + ", ".join(wrong) if wrong else "FIXED: every tensor agrees with float64", flush=True)
    sys.stderr.flush()
    # The exit status is the verdict; os._exit keeps CUDA/TE teardown at interpreter exit from changing it.
    os._exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
