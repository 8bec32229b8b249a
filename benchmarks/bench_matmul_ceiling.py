"""The float64 matmul ceiling by what its operands hold: the H200's rate depends on their significant bits.

Measures the 8192^3 float64 matmul (median of 5 after a warm-up, as `bench_reference.py` does) on standard
normal operands that are float64 (every mantissa bit random), float32-valued, bf16-valued, and one float64
times one bf16-valued (the reference's products of probabilities or gradients with k or v). The kinds
alternate, for `--rounds` rounds, so that a drift of the clocks shows as a drift and not as a difference.

    PYTHONPATH=$PWD python3 benchmarks/bench_matmul_ceiling.py
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_reference import square_matmul_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(args.n, args.n, device="cuda", dtype=torch.float64, generator=generator) for _ in range(2))

    def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype).to(torch.float64)

    kinds = {
        "float64": (a, b),
        "float32-valued": (rounded(a, torch.float32), rounded(b, torch.float32)),
        "bf16-valued": (rounded(a, torch.bfloat16), rounded(b, torch.bfloat16)),
        "float64 x bf16-valued": (a, rounded(b, torch.bfloat16)),
    }
    rows: dict[str, list[float]] = {name: [] for name in kinds}
    for round_ in range(args.rounds):
        for name, (x, y) in kinds.items():
            tflops = square_matmul_rate(x, y, "cuda", args.repeats) / 1e12
            rows[name].append(tflops)
            print(json.dumps({"round": round_, "operands": name, "tflops": round(tflops, 2)}), flush=True)
    print(f"\nfloat64 {args.n}^3 matmul, TFLOP/s by operands (rounds in order)\n")
    print("| operands | " + " | ".join(f"round {i}" for i in range(args.rounds)) + " |")
    print("| --- |" + " --- |" * args.rounds)
    for name, values in rows.items():
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + " |")


if __name__ == "__main__":
    main()
