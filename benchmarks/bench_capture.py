"""The cost of `attn_doctor.capture` on a training step: the same model and step with and without a capture
(metadata only, and with values of one layer), one capture over many steps as a user runs it, median of the
steps after each block's first, modes in turn twice so drift hits them alike; and the cost of one call on its
own. Goal (issue 17): metadata-only capture costs under 5% of the step time.

    python benchmarks/bench_capture.py [--layers 8] [--hidden 512] [--seq 512] [--batch 4] [--steps 10]
        [--attention sdpa|te] [--device cpu|cuda] [--dtype fp32|bf16]

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
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
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for block in range(2):  # each mode twice, in turn, so drift hits them alike
            for mode, options in modes.items():
                capture = (attn_doctor.capture(Path(tmp) / f"{mode}-{block}", **options) if options is not None
                           else contextlib.nullcontext())
                with capture:  # one capture over many steps, as a user runs it
                    for repeat in range(args.steps // 2 + 1):
                        start = time.perf_counter()
                        step(model, x)
                        if repeat:  # the first step of each block warms up (and writes the fingerprint)
                            times[mode].append(time.perf_counter() - start)
    machine = platform.processor() or platform.machine()
    if x.is_cuda:
        machine += f", {torch.cuda.get_device_name()}"
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {machine}, "
          f"{torch.get_num_threads()} threads; {args.attention} attention, {args.dtype}, {args.layers} layers, "
          f"hidden {args.hidden}, seq {args.seq}, batch {args.batch}; median of {args.steps} steps")
    # The cost of one call on its own: a tiny attention of the same kind, plain and captured.
    q = torch.randn(1, 4, 1, 8, device=args.device, dtype=dtype)  # bshd
    attend = Block(8, 1, args.attention).te_attention or (lambda q, k, v: F.scaled_dot_product_attention(q, k, v))

    def per_call(calls: int = 2000) -> float:
        start = time.perf_counter()
        for _ in range(calls):
            attend(q, q, q)
        if q.is_cuda:
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls

    plain_call = min(per_call() for _ in range(3))
    with tempfile.TemporaryDirectory() as tmp, attn_doctor.capture(tmp):
        captured_call = min(per_call() for _ in range(3))
    base = statistics.median(times["plain"])
    for mode, values in times.items():
        median = statistics.median(values)
        print(f"  {mode:18s} {median * 1e3:8.1f} ms/step  overhead {100 * (median - base) / base:+5.1f}%")
    print(f"  one call, metadata only: {(captured_call - plain_call) * 1e6:.0f} us on top of the call "
          f"({plain_call * 1e6:.1f} us for the tiny attention itself)")


if __name__ == "__main__":
    main()
