"""Agreement of attention_reference with the naive float64 formula on CUDA: five shapes (GQA, cross-attention,
a window, forced small tiles). Run on the H200 as `PYTHONPATH=$PWD python3 benchmarks/check_reference_cuda.py`
(output: h200/check-reference-cuda.txt). Prints OK when every tensor agrees to 1e-12 relative.
"""

from __future__ import annotations

import torch

from attn_doctor.numerics.reference import attention_reference, naive_reference

# batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, window, block_bytes (None: the default budget)
SHAPES = [
    (2, 300, 300, 8, 2, 64, True, None, 1 << 16),
    (1, 513, 700, 4, 4, 128, False, None, 1 << 18),
    (2, 256, 256, 4, 1, 32, False, (40, 7), None),
    (1, 1024, 1024, 16, 16, 128, True, None, None),
    (1, 2048, 2048, 4, 2, 128, True, None, 1 << 20),
]


def main(device: str = "cuda", shapes=SHAPES) -> None:
    torch.manual_seed(0)
    for shape in shapes:
        batch, seq_q, seq_kv, heads, kv_heads, head_dim, causal, window, block_bytes = shape

        def draw(seq: int, n_heads: int) -> torch.Tensor:
            return torch.randn(batch, seq, n_heads, head_dim, device=device).to(torch.bfloat16)

        q, k, v, dout = draw(seq_q, heads), draw(seq_kv, kv_heads), draw(seq_kv, kv_heads), draw(seq_q, heads)
        options = {"causal": causal, "softmax_scale": head_dim**-0.5, "window": window}
        got = attention_reference(q, k, v, dout, **options, block_bytes=block_bytes)
        want = naive_reference(q, k, v, dout, **options)
        errors = {name: float((getattr(got, name) - getattr(want, name)).norm() / getattr(want, name).norm())
                  for name in ("out", "dq", "dk", "dv")}
        print(shape, {name: f"{e:.1e}" for name, e in errors.items()},
              "OK" if max(errors.values()) < 1e-12 else "MISMATCH")


if __name__ == "__main__":
    main()
