"""The reference at seq 131072 (batch 1, 16 heads, head dim 128, causal) with key tiles of 4096 and 8192 columns.

Run on the H200 as `PYTHONPATH=$PWD python3 benchmarks/bench_tile_cols.py` (output: h200/bench-tile-cols.txt).
The float64 matmul ceiling is measured first in the same process: median of 5 8192^3 matmuls, on float64
operands (float32-valued ones in the runs recorded in h200/bench-tile-cols*.txt). FLOPs count what the
causal mask leaves: 6 matmuls of 2*h*d per visible (query, key) pair. Timing and ceiling helpers are
bench_reference.py's.
"""

from __future__ import annotations

import json
import statistics

import torch
from bench_reference import matmul_rate, timed, visible_pairs

from attn_doctor.numerics import reference


def main(device: str = "cuda", seq: int = 131072, heads: int = 16, head_dim: int = 128, matmul_n: int = 8192,
         widths: tuple[int, ...] = (4096, 8192, 4096)) -> None:
    fp64 = matmul_rate(device, torch.float64, matmul_n)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq, heads, head_dim, generator=generator, device=device).to(torch.bfloat16)
                     for _ in range(4))
    flops = 6 * 2 * heads * head_dim * visible_pairs(seq, True)
    saved = reference.MAX_TILE_COLS
    try:
        for cols in widths:
            reference.MAX_TILE_COLS = cols
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()

            def call() -> None:
                reference.attention_reference(q, k, v, dout, causal=True, softmax_scale=head_dim**-0.5)

            call()  # warm-up
            median = statistics.median(timed(call, device, 2))
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
            print(json.dumps({"cols": cols, "s": round(median, 3), "frac": round(flops / median / fp64, 4),
                              "fp64_tflops": round(fp64 / 1e12, 1),
                              "peak_gib": round(peak, 2) if peak is not None else None}), flush=True)
    finally:
        reference.MAX_TILE_COLS = saved


if __name__ == "__main__":
    main()
