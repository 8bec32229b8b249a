"""A layer probe: a module path (TE's MultiheadAttention or TransformerLayer, `attn_doctor.backends.te_module`)
run forward and backward as a whole layer, measured against the same layer computed in float64 from the
module's own weights (`attn_doctor.numerics.layer`), so that a fault in attention shows as attention's and a
fault elsewhere in the layer is named as such (`attn_doctor.verdict.layer` judges and words it).

Steps, all on one seeded input:
1. The module is built for the case; seeded GPT-scale weights are copied into its own parameters and read back
   as it holds them: every replica below runs on exactly those values.
2. Hidden states x and an output gradient dy are seeded; the module runs forward (RoPE frequencies from TE's
   own RotaryPositionEmbedding) and backward from dy. Hooks on its core attention (its DotProductAttention
   submodule) keep the q, k, v it received, its output, and the gradients that reached each of them.
3. Measured against float64 (each with the same-dtype yardstick measured the same way beside it):
   - the core attention in the layer, on its own inputs (`out`, `dq`, `dk`, `dv`): the captured q, k, v and output
     gradient through the exact attention (`attention_reference`, with its term magnitudes, as a single call is
     measured), against Megatron's local core attention on the very same q, k, v and gradient (the baseline every
     verdict is relative to); with what taking D from the rounded output adds where a flash-style kernel ran
     (read back from TE; `attn_doctor.numerics.rounded_output`);
   - the layer's stages against its float64 replica (x and weights upcast, exact RoPE angles, exact attention):
     the q, k, v attention received (`layer_q`, `layer_k`, `layer_v`: the layer before attention), the
     gradient that reached attention's output (`layer_dcontext`: the backward after attention), the layer's
     output (`layer_out`) and dx (`layer_dx`); against the same layer in the module's dtype in plain torch ops
     with Megatron's local attention on the same weights (`attn_doctor.numerics.layer.local_attention`) and
     RoPE angles computed as TE computes them (fp32): both replicas compute the angles themselves, so a fault in
     the frequencies TE returned shows in layer_q and layer_k.

The yardsticks travel in the outcome's extra (`extra["layer"]["yardstick"]`) and the verdict reads them there:
a layer probe is judged against its own yardsticks, not against the baseline's single call on other inputs.
TE's code (building, forward, backward) is the kernel's; the hooks, copies and comparisons are attn-doctor's
(`own_code`): an error in them is never blamed on TE.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from attn_doctor.backends import Backend, Unsupported
from attn_doctor.core.coords import Coords
from attn_doctor.core.errors import InternalError, kernel_code, own_code
from attn_doctor.numerics import layer
from attn_doctor.numerics.inputs import make_semantics, synchronize
from attn_doctor.numerics.metrics import TensorMetrics, compare
from attn_doctor.numerics.reference import attention_reference
from attn_doctor.numerics.rounded_output import output_rounding_gradients
from attn_doctor.numerics.standalone import TORCH_DTYPES
from attn_doctor.probes.caches import Caches, Progress
from attn_doctor.probes.outcome import ProbeOutcome

ATTENTION_TENSORS = ("out", "dq", "dk", "dv")  # the core attention in the layer, on the q, k, v it received
STAGE_TENSORS = ("layer_q", "layer_k", "layer_v", "layer_dcontext", "layer_out", "layer_dx")


class CoreAttentionTap:
    """Forward and gradient hooks on the module's core attention: the q, k, v it received and its output (as
    given, in the layer's format), and the gradients that reached them in the backward."""

    def __init__(self, core: torch.nn.Module):
        self.inputs: list[torch.Tensor] = []
        self.output: torch.Tensor | None = None
        self.grads: dict[str, torch.Tensor] = {}
        self.calls = 0
        self._handle = core.register_forward_hook(self._forward, with_kwargs=True)

    def _forward(self, module, args, kwargs, output) -> None:
        with own_code():
            self.calls += 1
            names = ("query_layer", "key_layer", "value_layer")
            tensors = [args[i] if len(args) > i else kwargs.get(name) for i, name in enumerate(names)]
            if any(not isinstance(t, torch.Tensor) for t in tensors):
                raise RuntimeError("the module called its core attention without separate q, k, v tensors (a packed "
                                   "qkv_layer): attn-doctor's hook cannot see what attention received")
            out = output[0] if isinstance(output, (tuple, list)) else output
            self.inputs = [t.detach().clone() for t in tensors]
            self.output = out.detach().clone()
            for name, t in zip(("q", "k", "v", "context"), (*tensors, out)):
                if t.requires_grad:
                    t.register_hook(self._keeper(name))

    def _keeper(self, name: str):
        def keep(grad: torch.Tensor) -> None:
            with own_code():
                self.grads[name] = grad.detach().clone()
        return keep

    def remove(self) -> None:
        self._handle.remove()


def attention_in_layer(arch: layer.Architecture, case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, dout: torch.Tensor, grads: dict[str, torch.Tensor], flash_style: bool,
                       device: torch.device) -> tuple[dict[str, TensorMetrics], dict[str, TensorMetrics],
                                                      dict[str, TensorMetrics]]:
    """The core attention's out, dq, dk, dv on the q, k, v and output gradient it received (layer format) against
    the exact attention on them: (candidate's metrics, the local baseline's on the same inputs, and for a
    flash-style kernel what taking D from the exact output rounded to the dtype makes in dq and dk)."""
    fmt = arch.fmt
    heads_shape = (*out.shape[:-1], arch.heads, arch.head_dim)
    q64, k64, v64 = (layer.to_bshd(t, fmt).to(torch.float64) for t in (q, k, v))
    dout64 = layer.to_bshd(dout.reshape(heads_shape), fmt).to(torch.float64)
    semantics = make_semantics(case, device)
    reference = attention_reference(q64, k64, v64, dout64, softmax_scale=arch.softmax_scale, semantics=semantics)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with torch.enable_grad():
        local = layer.local_attention(arch)(*leaves)
        local_grads = torch.autograd.grad(local, leaves, dout.reshape(local.shape))
    got = {"out": out.reshape(heads_shape), "dq": grads["q"], "dk": grads["k"], "dv": grads["v"]}
    yard = {"out": local.detach(), "dq": local_grads[0], "dk": local_grads[1], "dv": local_grads[2]}
    exact = reference.tensors()
    candidate = {name: compare(layer.to_bshd(t, fmt), exact[name], reference.terms(name)) for name, t in got.items()}
    yardstick = {name: compare(layer.to_bshd(t, fmt), exact[name], reference.terms(name)) for name, t in yard.items()}
    flash: dict[str, TensorMetrics] = {}
    if flash_style:
        moved = output_rounding_gradients(q64, k64, dout64, reference.out, reference.out.to(q.dtype),
                                          softmax_scale=arch.softmax_scale, semantics=semantics)
        for name in ("dq", "dk"):
            flash[name] = compare(exact[name] + moved[name], exact[name], reference.terms(name))
    return candidate, yardstick, flash


def stages(run: layer.Run) -> dict[str, torch.Tensor]:
    """A layer run's stage tensors by name (`STAGE_TENSORS`)."""
    t = run.trace
    return {"layer_q": t.q, "layer_k": t.k, "layer_v": t.v, "layer_dcontext": run.dcontext, "layer_out": t.out,
            "layer_dx": run.dx}


def run(backend: Backend, coords: Coords, caches: Caches, progress: Progress | None = None) -> ProbeOutcome:
    case, device = coords.case, caches.device
    dtype = TORCH_DTYPES[case.dtype]
    arch = layer.Architecture.of(case, backend.spec.options["module"])
    seconds = {"kernel": 0.0, "reference": 0.0, "compare": 0.0}
    with own_code():
        seeded = layer.seeded_weights(arch, case.seed, device, dtype)
        x, dy = layer.seeded_activations(arch, case, device, dtype)
    start = time.perf_counter()
    with kernel_code(passthrough=(Unsupported,)):
        module = backend.build_layer(arch, device, dtype)
        parameters = backend.layer_parameters(module)
        with own_code(), torch.no_grad():
            for role, tensor in seeded.items().items():
                parameters[role].copy_(tensor)
        weights = layer.Weights(**{role: p.detach().clone() for role, p in parameters.items()})
        freqs = backend.rotary_frequencies(arch, case.seq, device)
        tap = CoreAttentionTap(backend.core_attention(module))
        leaf = x.clone().requires_grad_()
        try:
            out = backend.call_layer(module, leaf, freqs)
            ran = backend.ran(out)
            (dx,) = torch.autograd.grad(out, leaf, dy)
        finally:
            tap.remove()
        synchronize(device)
    seconds["kernel"] = time.perf_counter() - start
    with own_code():
        if tap.calls != 1 or len(tap.grads) != 4:
            raise InternalError(RuntimeError(
                f"the core attention's hooks saw {tap.calls} forward(s) and gradients of {sorted(tap.grads)}: "
                "attn-doctor cannot tell what attention received"))
        out, dx = out.detach(), dx.detach()
        del module, parameters
        start = time.perf_counter()
        exact = layer.forward_backward(x.to(torch.float64), weights.to(torch.float64), arch,
                                       layer.rotary_frequencies(case.seq, arch.head_dim, device, torch.float64),
                                       layer.float64_attention(arch), dy.to(torch.float64))
        seconds["reference"] = time.perf_counter() - start
        start = time.perf_counter()
        plain = layer.forward_backward(x, weights, arch, layer.rotary_frequencies(case.seq, arch.head_dim, device),
                                       layer.local_attention(arch), dy)
        q, k, v = tap.inputs
        flash_style = bool(getattr(backend, "ran_flash_style", lambda: False)())
        metrics, yardstick, flash = attention_in_layer(arch, case, q, k, v, tap.output, tap.grads["context"],
                                                       {name: tap.grads[name] for name in ("q", "k", "v")},
                                                       flash_style, device)
        got = {"layer_q": q, "layer_k": k, "layer_v": v, "layer_dcontext": tap.grads["context"], "layer_out": out,
               "layer_dx": dx}
        expected, same_dtype = stages(exact), stages(plain)
        for name in STAGE_TENSORS:
            reference = layer.to_bshd(expected[name], arch.fmt)
            metrics[name] = compare(layer.to_bshd(got[name].reshape(expected[name].shape), arch.fmt), reference)
            yardstick[name] = compare(layer.to_bshd(same_dtype[name], arch.fmt), reference)
        seconds["compare"] = time.perf_counter() - start
    extra: dict[str, Any] = {"layer": {
        "module": arch.kind, "hidden": arch.hidden, "ffn": arch.ffn if arch.kind == "layer" else None,
        "flash_style": flash_style, "accumulation": arch.accumulation(case.seq),
        "yardstick": {name: m.to_dict() for name, m in yardstick.items()},
        "flash_style_part": {name: m.to_dict() for name, m in flash.items()},
    }, "reference": "computed"}
    return ProbeOutcome("ok", ran=ran, metrics=metrics, seconds=seconds, extra=extra)
