"""Benchmark the float64 attention reference: blockwise (attn_doctor.numerics.reference) against the naive formula.

Prints one JSON line per measurement and a markdown table at the end. Ceilings (float64 and bf16 matmul
rates) are measured in the same run. The float64 ceiling is measured on float64 operands (every mantissa
bit random, as in the reference's probabilities and gradients); the rate on float32-valued operands, the
yardstick of earlier measurements, is printed beside it (`bench_matmul_ceiling.py` shows the difference).
FLOPs count only what the mask leaves: 6 matmuls of 2*b*h*d per visible (query, key) pair (QK^T, PV
forward; dP, dV, dQ, dK backward).

    python benchmarks/bench_reference.py --device cuda --seqs 1024,4096,8192,16384,32768,65536,131072
    python benchmarks/bench_reference.py --device cpu --seqs 256,1024,2048 --heads 4
    python benchmarks/bench_reference.py --seqs 131072 --budgets-gib 1,4.5   # tile budgets side by side
    python benchmarks/bench_reference.py --seqs 8192,32768 --without-terms   # the term magnitudes' cost

FLOP/s count the six matmuls only, also for rows with the term magnitudes (issue 15), which add one matmul
and a few element-wise passes per tile: their cost shows as a lower rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attn_doctor.numerics import reference
from attn_doctor.numerics.reference import attention_reference, naive_reference


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def matmul_rate(device: str, dtype: torch.dtype, n: int, repeats: int = 5,
                values_of: torch.dtype | None = None) -> float:
    """FLOP/s of an n^3 matmul in `dtype`, median of `repeats` after a warm-up, on standard normal operands
    rounded to `values_of` (default: `dtype` itself). The float64 matmul of the H200 runs faster on operands
    with fewer significant bits, so the rounding matters."""
    source = torch.float64 if dtype == torch.float64 else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=source).to(values_of or dtype).to(dtype) for _ in range(2))
    return square_matmul_rate(a, b, device, repeats)


def square_matmul_rate(a: torch.Tensor, b: torch.Tensor, device: str, repeats: int) -> float:
    """FLOP/s of a @ b for n x n operands, median of `repeats` after a warm-up."""
    torch.matmul(a, b)  # warm-up
    return 2 * a.shape[0] ** 3 / statistics.median(timed(lambda: torch.matmul(a, b), device, repeats))


def visible_pairs(seq: int, causal: bool) -> int:
    return seq * (seq + 1) // 2 if causal else seq * seq


def tiled(budget_gib: float):
    """attention_reference with a tile budget of `budget_gib`."""
    return lambda *args, **kwargs: attention_reference(*args, **kwargs, block_bytes=int(budget_gib * 2**30))


def peak_gib(device: str) -> float | None:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seqs", default="1024,4096,8192")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--naive-max", type=int, default=16384, help="largest seq to try the naive formula at")
    parser.add_argument("--matmul-n", type=int, default=8192)
    parser.add_argument("--budgets-gib", default="", help="comma list of score-tile budgets to compare "
                        "(default: the reference's own)")
    parser.add_argument("--without-terms", action="store_true",
                        help="also time each reference without the term magnitudes (with_terms=False)")
    args = parser.parse_args()
    device = args.device
    fp64 = matmul_rate(device, torch.float64, args.matmul_n)
    fp64_f32_valued = matmul_rate(device, torch.float64, args.matmul_n, values_of=torch.float32)
    bf16 = matmul_rate(device, torch.bfloat16, args.matmul_n)
    print(json.dumps({"ceiling": "matmul", "n": args.matmul_n, "fp64_tflops": fp64 / 1e12,
                      "fp64_float32_valued_tflops": fp64_f32_valued / 1e12, "bf16_tflops": bf16 / 1e12}))
    rows = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        g = torch.Generator(device=device).manual_seed(0)
        shape = (args.batch, seq, args.heads, args.head_dim)
        q, k, v, dout = (torch.randn(shape, generator=g, device=device).to(torch.bfloat16) for _ in range(4))
        flops = 6 * 2 * args.batch * args.heads * args.head_dim * visible_pairs(seq, True)
        budgets = [float(b) for b in args.budgets_gib.split(",") if b] or [None]
        impls = []
        for budget in budgets:
            block_bytes = None if budget is None else int(budget * 2**30)
            plan = reference.plan_tiles(args.batch * args.heads, 1, seq, seq, torch.device(device), block_bytes)
            label = f"tiled {plan.rows}x{plan.cols}{' kept' if plan.keep else ''}"
            impls.append((label + (f" ({budget:g} GiB)" if budget is not None else ""),
                          attention_reference if budget is None else tiled(budget)))
            if args.without_terms:
                fn = impls[-1][1]
                impls.append((impls[-1][0] + " without terms", lambda *a, fn=fn, **kw: fn(*a, **kw, with_terms=False)))
        for name, fn in impls + [("naive", naive_reference)]:
            if name == "naive" and seq > args.naive_max:
                continue
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            call = lambda: fn(q, k, v, dout, causal=True, softmax_scale=args.head_dim**-0.5)  # noqa: E731
            try:
                call()  # warm-up (and the first memory peak)
                times = timed(call, device, args.repeats)
            except torch.OutOfMemoryError:
                record = {"impl": name, "seq": seq, "result": "out of memory"}
            else:
                median = statistics.median(times)
                record = {"impl": name, "seq": seq, "median_s": median, "runs": len(times),
                          "peak_gib": peak_gib(device), "tflops": flops / median / 1e12,
                          "fraction_of_fp64_matmul": flops / median / fp64,
                          "fraction_of_fp64_matmul_float32_valued": flops / median / fp64_f32_valued}
            print(json.dumps(record), flush=True)
            rows.append(record)
    print(f"\n{device}: float64 matmul {fp64 / 1e12:.1f} TFLOP/s (float32-valued operands "
          f"{fp64_f32_valued / 1e12:.1f}), bf16 {bf16 / 1e12:.0f} TFLOP/s (n={args.matmul_n}); "
          f"b={args.batch} h={args.heads} d={args.head_dim} causal, fwd+bwd\n")
    print("| impl | seq | median s | peak GiB | TFLOP/s | of fp64 matmul | of fp64 matmul, float32-valued |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "median_s" in r:
            peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
            print(f"| {r['impl']} | {r['seq']} | {r['median_s']:.4f} | {peak} | {r['tflops']:.2f} | "
                  f"{r['fraction_of_fp64_matmul']:.1%} | {r['fraction_of_fp64_matmul_float32_valued']:.1%} |")
        else:
            print(f"| {r['impl']} | {r['seq']} | {r['result']} | | | | |")


if __name__ == "__main__":
    main()
