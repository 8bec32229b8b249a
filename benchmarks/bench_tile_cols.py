"""The reference at seq 131072 (batch 1, 16 heads, head dim 128, causal) with key tiles of 4096 and 8192 columns.

Run on the H200 as `PYTHONPATH=$PWD python3 benchmarks/bench_tile_cols.py` (output: h200/bench-tile-cols.txt).
The float64 matmul ceiling is measured first in the same process: median of 5 8192^3 matmuls. FLOPs count
what the causal mask leaves: 6 matmuls of 2*h*d per visible (query, key) pair.
"""
import time, statistics, json, torch
from attn_doctor import reference as m
a = torch.randn(8192, 8192, device="cuda", dtype=torch.float64); torch.matmul(a, a)
ts = []
for _ in range(5):
    torch.cuda.synchronize(); t = time.perf_counter(); torch.matmul(a, a); torch.cuda.synchronize(); ts.append(time.perf_counter() - t)
fp64 = 2 * 8192**3 / statistics.median(ts); del a
seq = 131072
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, do = (torch.randn(1, seq, 16, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
for cols in (4096, 8192, 4096):
    m.MAX_TILE_COLS = cols
    torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    m.attention_reference(q, k, v, do, causal=True, softmax_scale=128**-0.5)
    times = []
    for _ in range(2):
        torch.cuda.synchronize(); t = time.perf_counter()
        m.attention_reference(q, k, v, do, causal=True, softmax_scale=128**-0.5)
        torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    med = statistics.median(times); flops = 12 * 16 * 128 * seq * (seq + 1) // 2
    print(json.dumps({"cols": cols, "s": round(med, 3), "frac": round(flops / med / fp64, 4), "fp64_tflops": round(fp64 / 1e12, 1),
                      "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}), flush=True)
