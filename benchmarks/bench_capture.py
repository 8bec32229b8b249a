"""The cost of `attn_doctor.capture` on a training step: the same model and step with and without a capture
(metadata only, and with values of one layer), and the cost of one call on its own. Goal (issue 17):
metadata-only capture costs under 5% of the step time.

A shared machine's step time drifts by more than the capture costs (10% between runs on the H200's host), so
the modes run in short blocks, in turn, for many rounds (the order reversed every other round), each block one
capture over several steps as a user runs it (its first step, which writes the fingerprint, not timed). A
block's time is the median of its steps; a mode's overhead is the median over rounds of its block against the
plain block of the same round, given with the middle half of the rounds' figures. The cost of one call: a tiny
attention called many times, plain and captured in turn, the fastest of each.

    python benchmarks/bench_capture.py [--layers 8] [--hidden 512] [--seq 512] [--batch 4] [--rounds 10]
        [--steps 5] [--attention sdpa|te] [--device cpu|cuda] [--dtype fp32|bf16]

On a GPU each step ends with a synchronisation, so a step's time is the GPU's and the capture's Python work
counts only where it delays the kernels' launches.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attn_doctor  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, hidden: int, heads: int, attention: str):
        super().__init__()
        self.heads = heads
        self.te_attention = None
        if attention == "te":
            import transformer_engine.pytorch as te

            self.te_attention = te.DotProductAttention(heads, hidden // heads, qkv_format="bshd",
                                                       attn_mask_type="causal", attention_dropout=0.0)
        self.norm = torch.nn.LayerNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))

    def forward(self, x):
        b, s, h = x.shape
        qkv = self.qkv(self.norm(x)).view(b, s, 3, self.heads, h // self.heads)
        if self.te_attention is not None:  # Megatron's way: head-sliced views of the fused projection, bshd
            attended = self.te_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])
        else:
            q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        x = x + self.proj(attended)
        return x + self.mlp(x)


def step(model, x) -> None:
    model.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()
    if x.is_cuda:
        torch.cuda.synchronize()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    low, middle, high = statistics.quantiles(values, n=4) if len(values) > 1 else values * 3
    return low, middle, high


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--attention", choices=("sdpa", "te"), default="sdpa")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = torch.nn.Sequential(*[Block(args.hidden, args.heads, args.attention) for _ in range(args.layers)])
    model = model.to(args.device, dtype)
    x = torch.randn(args.batch, args.seq, args.hidden, device=args.device, dtype=dtype)
    modes = {"plain": None, "metadata": {}, "values, one layer": {"values": True, "layers": [0]}}
    blocks: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        step(model, x)  # the first step of all: kernels chosen and compiled
        for round_ in range(args.rounds):
            for mode in list(modes) if round_ % 2 == 0 else list(modes)[::-1]:
                options = modes[mode]
                capture = (attn_doctor.capture(Path(tmp) / f"{mode}-{round_}", **options) if options is not None
                           else contextlib.nullcontext())
                with capture:
                    step(model, x)  # not timed: a capture's first call writes the fingerprint
                    times = []
                    for _ in range(args.steps):
                        start = time.perf_counter()
                        step(model, x)
                        times.append(time.perf_counter() - start)
                blocks[mode].append(statistics.median(times))
    machine = platform.processor() or platform.machine()
    if x.is_cuda:
        machine += f", {torch.cuda.get_device_name()}"
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {machine}, "
          f"{torch.get_num_threads()} threads; {args.attention} attention, {args.dtype}, {args.layers} layers, "
          f"hidden {args.hidden}, seq {args.seq}, batch {args.batch}; {args.rounds} rounds of {args.steps} steps")
    # The cost of one call on its own: a tiny attention of the same kind, plain and captured in turn.
    q = torch.randn(1, 4, 1, 8, device=args.device, dtype=dtype)  # bshd
    attend = Block(8, 1, args.attention).te_attention or (lambda q, k, v: F.scaled_dot_product_attention(q, k, v))

    def per_call(calls: int = 1000) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            attend(q, q, q)
        if q.is_cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls

    plain_calls, captured_calls = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(7):
            plain_calls.append(per_call())
            with attn_doctor.capture(Path(tmp) / str(round_)):
                attend(q, q, q)  # the fingerprint
                captured_calls.append(per_call())
    base = statistics.median(blocks["plain"])
    print(f"  {'plain':18s} {base * 1e3:8.1f} ms/step")
    for mode in list(modes)[1:]:
        low, middle, high = quartiles([ours / plain - 1 for ours, plain in zip(blocks[mode], blocks["plain"])])
        print(f"  {mode:18s} {statistics.median(blocks[mode]) * 1e3:8.1f} ms/step  overhead {100 * middle:+5.1f}%"
              f"  (middle half of the rounds: {100 * low:+.1f}% to {100 * high:+.1f}%)")
    print(f"  one call, metadata only: {(min(captured_calls) - min(plain_calls)) * 1e6:.0f} us on top of the call "
          f"({min(plain_calls) * 1e6:.1f} us for the tiny attention itself)")


if __name__ == "__main__":
    main()
