"""PyTorch's own scaled_dot_product_attention kernels, each forced alone with `sdpa_kernel`.

Forcing one kernel makes SDPA raise instead of silently falling back, so a row that ran did run that
kernel; `ran` confirms it from the autograd node the call left behind (the op that will run backward).
On a GPU these rows cross-check TE: cuDNN wrong in both TE and PyTorch points at cuDNN, wrong only in
TE points at TE's code around it.
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attn_doctor.backends.base import Backend, Unsupported
from attn_doctor.core.case import Case
from attn_doctor.numerics.reference import allowed_mask

KERNELS = {
    "math": SDPBackend.MATH,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
}
CPU_KERNELS = ("math", "flash")  # the others exist only for CUDA
_TRIGGERED = re.compile(r"\s*\(Triggered internally at [^)]*\)\.?")


def _skip_reasons(caught: list[warnings.WarningMessage]) -> list[str]:
    """SDPA's own explanations, without source locations and the bare 'X kernel not used because:' lines."""
    reasons = []
    for w in caught:
        text = _TRIGGERED.sub("", str(w.message)).strip()
        if text and not text.endswith("because:"):
            reasons.append(text)
    return list(dict.fromkeys(reasons))


def _attention_node(out: torch.Tensor) -> str | None:
    """Name of the first autograd node of an attention op below `out` (e.g. ScaledDotProductFlash...)."""
    frontier, seen = [out.grad_fn], set()
    while frontier:
        node = frontier.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if "Attention" in name:
            return name
        frontier.extend(fn for fn, _ in node.next_functions)
    return None


class SdpaKernel(Backend):
    qkv_format = "bshd"

    def __init__(self, spec):
        super().__init__(spec)
        self.kernel = spec.options["kernel"]

    def unsupported(self, case: Case, device: torch.device) -> str | None:
        if device.type == "cpu" and self.kernel not in CPU_KERNELS:
            return f"PyTorch has no CPU implementation of the {self.kernel} SDPA kernel"
        return None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case) -> torch.Tensor:
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # bshd -> bhsd views, no copy
        mask = None
        is_causal = case.causal and case.window is None and case.seq == case.seq_k
        if case.window is not None or (case.causal and not is_causal):
            mask = allowed_mask(
                torch.arange(case.seq, device=q.device), torch.arange(case.seq_k, device=q.device), case.causal,
                case.window,
            )
        kwargs = {"enable_gqa": True} if case.num_kv_heads != case.heads else {}
        with warnings.catch_warnings(record=True) as caught, sdpa_kernel([KERNELS[self.kernel]]):
            warnings.simplefilter("always")
            try:
                out = F.scaled_dot_product_attention(
                    qh, kh, vh, attn_mask=mask, is_causal=is_causal, scale=case.softmax_scale, **kwargs
                )
            except RuntimeError as exc:
                if "No available kernel" not in str(exc):
                    raise
                reasons = _skip_reasons(caught)
                raise Unsupported("; ".join(reasons) or str(exc).splitlines()[0]) from None
        return out.transpose(1, 2)

    def ran(self, out: torch.Tensor) -> str:
        node = _attention_node(out)
        if node is None:
            return f"SDPA {self.kernel}: composite matmul + softmax" if self.kernel == "math" else f"SDPA {self.kernel}"
        return f"SDPA {self.kernel}: {node.removeprefix('ScaledDotProduct').removesuffix('Backward0')}"
