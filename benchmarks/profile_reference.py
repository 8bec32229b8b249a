"""Where the float64 reference's time goes: one call under torch.profiler, by operation and by kernel.

Prints the aten operations by input shapes, then the CUDA kernels by name and launch grid, each with its
total device time, its share and the number of launches. Batch 1, head dim 128, causal, bf16 inputs; one
chunk of heads at seq 131072 is `--seq 131072 --heads 4` (the tile plan is the same as with 16 heads).

    PYTHONPATH=$PWD python3 benchmarks/profile_reference.py --seq 131072 --heads 4 --trace $OUT/trace.json
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.profiler import ProfilerActivity, profile

from attn_doctor.numerics import reference


def device_time(event) -> float:
    """Self device time in microseconds (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def kernels_by_grid(trace_path: str) -> list[tuple[str, str, int, float]]:
    """(kernel name, grid, launches, total microseconds) from a chrome trace, largest first."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    totals: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.get("cat") == "kernel":
            key = (event["name"], str(event.get("args", {}).get("grid")))
            totals[key][0] += 1
            totals[key][1] += event.get("dur", 0.0)
    return sorted(((name, grid, int(n), t) for (name, grid), (n, t) in totals.items()), key=lambda r: -r[3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=131072)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace", default="reference-trace.json")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(1, args.seq, args.heads, args.head_dim, generator=generator,
                                 device="cuda").to(torch.bfloat16) for _ in range(4))
    plan = reference.plan_tiles(args.heads, 1, args.seq, args.seq, q.device, None)
    print(f"plan: {plan}")

    def call() -> None:
        reference.attention_reference(q, k, v, dout, causal=True, softmax_scale=args.head_dim**-0.5)
        torch.cuda.synchronize()

    call()  # warm-up
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        call()
    prof.export_chrome_trace(args.trace)
    # key_averages also lists the kernels themselves (and CUDA runtime events): keep the aten operations,
    # whose self device time is that of the kernels they launched.
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.key.startswith("aten::") and device_time(e) > 0]
    total = sum(device_time(e) for e in ops)
    print(f"\ndevice time {total / 1e6:.3f} s; by operation and input shapes:")
    for e in sorted(ops, key=lambda e: -device_time(e))[:args.top]:
        print(f"{device_time(e) / 1e6:8.3f} s {device_time(e) / total:6.1%} {e.count:6d}x  {e.key}  {e.input_shapes}")
    kernels = kernels_by_grid(args.trace)
    kernel_total = sum(t for *_, t in kernels)
    print(f"\nkernels {kernel_total / 1e6:.3f} s; by name and grid:")
    for name, grid, n, t in kernels[:args.top]:
        print(f"{t / 1e6:8.3f} s {t / kernel_total:6.1%} {n:6d}x  grid {grid}  {name[:110]}")


if __name__ == "__main__":
    main()
