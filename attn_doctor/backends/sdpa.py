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

from attn_doctor.backends.base import Backend, BackendSpec, PathMemory, ShortCall, Unsupported, short_mask_code
from attn_doctor.core.case import DTYPE_BYTES, Case
from attn_doctor.numerics.masks import Semantics
from attn_doctor.numerics.reference import allowed_mask
from attn_doctor.numerics.standalone import sdpa_mask

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


REPRO_SOURCE = '''

FORMAT = "bshd"
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402


def kernel(q, k, v, case):
    """PyTorch SDPA with only the {kernel} kernel allowed, given the mask as attn-doctor gives it (sdpa_mask)."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    extra = {{"enable_gqa": True}} if case["kv_heads"] != case["heads"] else {{}}
    mask, is_causal = sdpa_mask(case, EXPLICIT, BIAS, q.dtype, DEVICE)
    with sdpa_kernel([SDPBackend.{enum}]):
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=is_causal, scale=case["scale"],
                                             **extra)
    return out.transpose(1, 2)
'''


class SdpaKernel(Backend):
    family = "sdpa"
    qkv_format = "bshd"
    cp_method = "explicit global causal mask (SDPA attn_mask)"
    # H100, from a cold start: seconds per probe the plan counts (those `static_skip` leaves), between te-coverage's
    # and te-tests' (reports/h100/issue51/lease5): sdpa.cudnn builds cuDNN graphs
    probe_seconds = {"sdpa.cudnn": 0.25, "sdpa.math": 0.065, "sdpa.efficient": 0.05, "sdpa.flash": 0.035}
    fixed_paths = tuple((f"sdpa.{kernel}", {"kernel": kernel}) for kernel in ("flash", "efficient", "cudnn", "math"))

    @classmethod
    def static_skip(cls, spec: BackendSpec, case: Case, device: str) -> str | None:
        kernel = spec.options["kernel"]
        if device == "cpu" and kernel not in CPU_KERNELS:
            return f"PyTorch has no CPU implementation of the {kernel} SDPA kernel"
        if case.softmax != "vanilla":
            return f"PyTorch SDPA has no softmax sink (softmax type {case.softmax})"
        if case.fp8 != "none":
            return "PyTorch SDPA has no FP8 attention"
        return None

    @classmethod
    def flash_style(cls, spec: BackendSpec) -> bool:
        """The fused kernels (FlashAttention, memory-efficient, cuDNN) take D from the output they returned; math
        differentiates its own softmax."""
        return spec.options["kernel"] != "math"

    @classmethod
    def memory(cls, spec: BackendSpec, case: Case) -> PathMemory:
        if spec.options["kernel"] != "math":
            return PathMemory()
        # The composite path: scores, softmax and its output in the input dtype, probabilities kept; measured on an
        # H100, 18 bytes a score in bf16 all told (seq 32768, one head: 18.2 GiB reserved).
        scores, item = case.score_elements, DTYPE_BYTES[case.dtype]
        return PathMemory(saved=2 * scores * item, transient=scores * (14 + item))

    @classmethod
    def repro_source(cls, spec: BackendSpec) -> str:
        kernel = spec.options["kernel"]
        return REPRO_SOURCE.format(kernel=kernel, enum=KERNELS[kernel].name)

    @classmethod
    def short_call(cls, spec: BackendSpec, case: Case) -> ShortCall:
        from attn_doctor.numerics.standalone import draw_side_inputs

        plain = case.plain()
        kernel = spec.options["kernel"]
        explicit, bias, _ = draw_side_inputs(plain, "cpu")
        mask, is_causal = sdpa_mask(plain, explicit, bias, torch.float32, "cpu")  # what attn-doctor gives SDPA
        visible = short_mask_code(plain)
        if is_causal:
            argument = "is_causal=True, "
        elif mask is None:
            argument = ""
        elif mask.dtype == torch.bool:
            argument = f"attn_mask={visible}, "
        else:  # the bias, -inf where a key is not visible
            argument = ("attn_mask=BIAS.to(DTYPE).masked_fill(~VISIBLE, -math.inf), " if visible == "VISIBLE"
                        else "attn_mask=BIAS.to(DTYPE), ")
        gqa = ", enable_gqa=True" if case.kv_heads != case.heads else ""
        return ShortCall("bshd", "import torch.nn.functional as F\n"
                                 "from torch.nn.attention import SDPBackend, sdpa_kernel\n", f'''

def kernel(q, k, v):
    """PyTorch SDPA with only its {kernel} kernel allowed, given the mask as attn-doctor gives it."""
    with sdpa_kernel([SDPBackend.{KERNELS[kernel].name}]):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), {argument}scale=SCALE{gqa})
    return out.transpose(1, 2)
''')

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        self.kernel = spec.options["kernel"]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                is_causal: bool, case: Case) -> torch.Tensor:
        """SDPA on bshd q, k, v with only this kernel allowed; SDPA's own reasons when it refuses."""
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # bshd -> bhsd views, no copy
        kwargs = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case,
                semantics: Semantics | None = None) -> torch.Tensor:
        """Plain causal self-attention as is_causal; every other mask as attn_mask (boolean, True = attend),
        a bias as a float attn_mask with -inf where masked."""
        semantics = semantics or Semantics(case)
        mask, is_causal = sdpa_mask(case.plain(), semantics.allowed, semantics.bias, q.dtype, q.device)
        return self._attend(q, k, v, mask, is_causal, case)

    def attend_at(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  case: Case) -> torch.Tensor:
        visible = allowed_mask(positions, torch.arange(k.shape[1], device=q.device), case.causal, case.window)
        return self._attend(q, k, v, visible, False, case)

    def ran(self, out: torch.Tensor) -> str:
        node = _attention_node(out)
        if node is None:
            return f"SDPA {self.kernel}: composite matmul + softmax" if self.kernel == "math" else f"SDPA {self.kernel}"
        return f"SDPA {self.kernel}: {node.removeprefix('ScaledDotProduct').removesuffix('Backward0')}"
