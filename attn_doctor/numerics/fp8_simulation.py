"""A correct FP8 attention, simulated: the yardstick an FP8 kernel is judged against.

An FP8 attention's distance from float64 is dominated by quantisation, not by the kernel, so comparing it
with the bf16 baseline's error would fail every FP8 kernel (see ../shared/reference/verdict-numerics.md,
"FP8"). The local baseline in an FP8 case therefore quantises what TE's FP8 attention quantises
(TE 2.20.2, cuDNN's FP8 fused attention with the default HYBRID format: forward tensors E4M3, backward
tensors E5M2), each with a per-tensor scale from its own amax, and computes the rest as usual:

    forward:  Q, K, V (E4M3), P = softmax(S) (E4M3), O (E4M3)
    backward: dO, dP (E5M2), dS (E5M2), dQ, dK, dV (E5M2)

The other FP8 modes of TE (`standalone.fp8_mode`): with `--fp8-backward f16` (NVTE_FP8_DPA_BWD=0) TE runs the
forward in FP8 and the backward as its F16/BF16 fused attention from the FP8 forward's output and statistics, so
the simulation rounds the forward as above and nothing in the backward; MXFP8 (`--fp8 mxfp8`, Blackwell only)
quantises Q, K, V in blocks of 32 values along the head dim, each block with a power-of-two scale (OCP MX), and the
rest as above. Neither was measured against a kernel on sm_90: the F16 backward there is a yardstick argued from
TE's code (TE 2.20.2 backends.py: the F16 backward saves the unquantised q, k, v and the dequantised O), MXFP8 is a
SKIP on sm_90 (TE's own `is_mxfp8_available`).

A per-tensor amax scale is what TE's delayed scaling converges to on repeated identical inputs (a delayed
case's probe runs one warm-up step with the same inputs and output gradient first; `attn_doctor.probes.call`),
so the simulation and the kernel quantise with the same scales up to the amax history's margin. Everything else in fp32, so the yardstick is the quantisation's
error, the part of an FP8 kernel's error any correct FP8 implementation shares.

The implementation is `attn_doctor.numerics.standalone.quantize`, shared with the standalone repro scripts;
the local baseline (`standalone.megatron_core_attention` with `fp8=standalone.fp8_mode(case)`) applies it where
listed above.
"""

from attn_doctor.numerics.standalone import quantize

__all__ = ["quantize"]
