"""Two questions the first coverage run raised, answered on the H200 with TE directly (no attn-doctor code):

1. te.unfused with mask `causal` and fewer keys than queries: which diagonal does it use? Its output is
   compared with float64 attention under a top-left diagonal (TE's documented `causal`) and a bottom-right
   one (TE's `causal_bottom_right`); rows that see no key count as all-masked rows (uniform weights, since TE's
   unfused path masks with a finite -10000).
2. te.fused FP8 (delayed scaling): does the error depend on the number of warm-up steps, and on `causal`
   versus `padding_causal` (with full-length cu_seqlens: the same attention)? Relative errors against float64.

    python3 reports/h200/api/diagnose.py   (on the device, TE installed; import TE before torch uses cuDNN)
"""

import os

import transformer_engine.pytorch as te  # first: TE loads its own cuDNN
import torch
from transformer_engine.common import recipe
from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa


def force(path: str) -> None:
    for name, flag in (("flash", "NVTE_FLASH_ATTN"), ("fused", "NVTE_FUSED_ATTN"), ("unfused", "NVTE_UNFUSED_ATTN")):
        os.environ[flag] = "1" if name == path else "0"
    dpa._attention_backends["backend_selection_requires_update"] = True


def ran() -> str:
    state = dpa._attention_backends
    if state["use_fused_attention"]:
        return f"FusedAttention sub-backend {int(state['fused_attention_backend'])}"
    return "FlashAttention" if state["use_flash_attention"] else "Unfused"


def reference(q, k, v, allowed, uniform_when_empty=False):
    """float64 attention on sbhd tensors; `allowed` [sq, sk]."""
    s = torch.einsum("ibhd,jbhd->bhij", q.double(), k.double()) * q.shape[-1] ** -0.5
    if uniform_when_empty:
        s = s.masked_fill(~allowed, -10000.0)
    else:
        s = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bhij,jbhd->ibhd", p, v.double())


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


torch.manual_seed(0)
print("== 1. te.unfused, mask causal, seq_q > seq_kv")
for sq, sk in ((317, 2), (512, 256)):
    q = torch.randn(sq, 1, 2, 64, device="cuda")
    k, v = (torch.randn(sk, 1, 2, 64, device="cuda") for _ in range(2))
    i, j = torch.arange(sq, device="cuda")[:, None], torch.arange(sk, device="cuda")[None, :]
    top_left, bottom_right = j <= i, j <= i + sk - sq
    for mask in ("causal", "causal_bottom_right"):
        force("unfused")
        module = te.DotProductAttention(2, 64, attn_mask_type=mask, attention_type="cross", qkv_format="sbhd",
                                        attention_dropout=0.0)
        out = module(q, k, v).view(sq, 1, 2, 64)
        print(f"  sq {sq} sk {sk} mask {mask:20s} ran {ran():12s} rel. err vs top-left "
              f"{rel(out, reference(q, k, v, top_left)):.3g}, vs bottom-right (empty rows uniform) "
              f"{rel(out, reference(q, k, v, bottom_right, True)):.3g}, vs bottom-right (empty rows 0) "
              f"{rel(out, reference(q, k, v, bottom_right)):.3g}")

print("== 2. te.fused FP8 delayed scaling: warm-up steps, causal vs padding_causal")
s, b, h, d = 512, 4, 16, 128
q, k, v, dout = (torch.randn(s, b, h, d, device="cuda").to(torch.bfloat16) for _ in range(4))
i = torch.arange(s, device="cuda")
exact = reference(q, k, v, i[None, :] <= i[:, None])
cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device="cuda")
for mask in ("causal", "padding_causal"):
    for warm in (0, 1, 3):
        force("fused")
        module = te.DotProductAttention(h, d, attn_mask_type=mask, qkv_format="sbhd", attention_dropout=0.0)
        fp8 = recipe.DelayedScaling(fp8_dpa=True)
        extra = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s) if "padding" in mask else {}
        for step in range(warm + 1):
            leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            with te.autocast(enabled=True, recipe=fp8):
                out = module(*leaves, **extra)
            torch.autograd.grad(out, leaves, dout.view(out.shape))
        print(f"  {mask:15s} warm-up steps {warm}: ran {ran()}, out rel. err {rel(out.view(s, b, h, d), exact):.3g}")
