"""The cost of `attn_doctor.capture` on a training step: the same model and step with and without a capture
(metadata only, and with values of one layer). Goal (issue 17): metadata-only capture costs under 5% of the
step time.

Several measures, because a shared machine's step time drifts by more than the capture costs (10-20% between
runs on the H200's host):
- the step time, paired: each captured mode against plain in short blocks, in turn, for many rounds (the order
  reversed every other round), each block one capture over several steps as a user runs it (its first step,
  which writes the fingerprint, not timed). A block's time is the median of its steps; the overhead is the
  median over rounds of the block against the plain block of the same round, with the middle half of the
  rounds' figures. Each captured mode has its own rounds: a values block writes files, whose flushing slows
  whatever block runs next.
- the process's CPU time per step (all its threads: the forward's, and the autograd engine's that runs a GPU
  backward), paired the same way: the step's cost without the time the process waited for a CPU. On the H200's
  host it agreed with the step time within half a percent in every run: the drift there is in the CPU's own
  work (hosts whose plain step differs by a third), not in waiting for a CPU.
- the capture's own time (`Recorder.seconds`, the time spent in its code at each call, not in the call), per
  step and per call: free of the drift, but not all of the cost. Where the GPU bounds the step it hides behind
  the kernels; where the CPU launching kernels bounds it, it shows in full, and the code after each captured
  call runs slower too, on caches the capture's code displaced (on a 1 ms CPU step of this development machine
  the forward grew by about twice the own time).
- with `--paired-steps N`, the metadata-only capture's step time paired step by step (`steps_paired`): N pairs
  of steps in one open capture, the attention function swapped between the capture's wrapper and the original.
  The sharpest of the measures (blocks scatter by ±5% between rounds on the H200's host), though it leaves out
  a capture's start and its model-level hooks. `--rounds 0` runs it alone.

    python benchmarks/bench_capture.py [--layers 8] [--hidden 512] [--seq 512] [--batch 4] [--rounds 10]
        [--steps 5] [--attention sdpa|te|te-layer] [--device cpu|cuda] [--dtype fp32|bf16]
        [--modes metadata,values] [--paired-steps N] [--optimizer none|adamw]

On a GPU each step ends with a synchronisation, so a step's time is the GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
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


def make_layer(hidden: int, heads: int, attention: str) -> torch.nn.Module:
    if attention != "te-layer":
        return Block(hidden, heads, attention)
    import transformer_engine.pytorch as te

    return te.TransformerLayer(hidden, 4 * hidden, heads, self_attn_mask_type="causal", attention_dropout=0.0,
                               hidden_dropout=0.0, attn_input_format="bshd")


def step(model, x, optimizer: torch.optim.Optimizer | None = None) -> None:
    model.zero_grad(set_to_none=True)
    model(x).float().square().mean().backward()
    if optimizer is not None:
        optimizer.step()
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
    parser.add_argument("--rounds", type=int, default=10, help="rounds of blocks; 0: no blocks (with --paired-steps)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per block")
    parser.add_argument("--attention", choices=("sdpa", "te", "te-layer"), default="sdpa",
                        help="te: TE's DotProductAttention in this bench's block, called with q, k, v alone; "
                             "te-layer: a stack of te.TransformerLayer (its attention called with TE's own "
                             "arguments, twenty of them)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--modes", default="metadata,values",
                        help="the captured modes to measure, comma-separated: metadata (metadata only), values "
                             "(and the values of layer 0)")
    parser.add_argument("--optimizer", choices=("none", "adamw"), default="none",
                        help="adamw: each step also takes an AdamW step (torch's default implementation), as a "
                             "training step does; none: forward and backward only, where the capture's share of "
                             "the step is largest")
    parser.add_argument("--paired-steps", type=int, default=0, metavar="N",
                        help="also measure the metadata-only capture step by step: N pairs of steps in one open "
                             "capture, the attention function swapped between the capture's wrapper and the "
                             "original before each step (`steps_paired`)")
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    model = torch.nn.Sequential(*[make_layer(args.hidden, args.heads, args.attention) for _ in range(args.layers)])
    model = model.to(args.device, dtype)
    x = torch.randn(args.batch, args.seq, args.hidden, device=args.device, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6) if args.optimizer == "adamw" else None
    modes = {"metadata": ("metadata only", {}), "values": ("values, one layer", {"values": True, "layers": [0]})}
    chosen = args.modes.split(",")
    if not chosen or not set(chosen) <= set(modes):
        parser.error(f"--modes: a comma-separated list of {', '.join(modes)}")
    captured = dict(modes[mode] for mode in chosen)
    with tempfile.TemporaryDirectory() as tmp:
        step(model, x, optimizer)  # the first step of all: kernels chosen and compiled
        results = {mode: paired_blocks(model, x, optimizer, Path(tmp) / str(i), options, args.rounds, args.steps)
                   for i, (mode, options) in enumerate(captured.items()) if args.rounds > 0}
        by_step = steps_paired(model, x, optimizer, Path(tmp) / "steps", args.attention, args.paired_steps)
    machine = platform.processor() or platform.machine()
    if x.is_cuda:
        machine += f", {torch.cuda.get_device_name()}"
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {machine}, "
          f"{torch.get_num_threads()} threads; {args.attention} attention, {args.dtype}, {args.layers} layers, "
          f"hidden {args.hidden}, seq {args.seq}, batch {args.batch}, optimizer {args.optimizer}; "
          f"{args.rounds} rounds of {args.steps} steps")
    for mode, blocks in results.items():
        plain = statistics.median(block.plain for block in blocks)
        ours = statistics.median(block.captured for block in blocks)
        low, middle, high = quartiles([block.captured / block.plain - 1 for block in blocks])
        cpu_low, cpu_middle, cpu_high = quartiles([block.captured_cpu / block.plain_cpu - 1 for block in blocks])
        own = statistics.median(block.own for block in blocks)
        calls = blocks[0].calls
        print(f"  {mode}: plain {plain * 1e3:.1f} ms/step, captured {ours * 1e3:.1f} ms/step, step time "
              f"{100 * middle:+.1f}% (middle half of the rounds: {100 * low:+.1f}% to {100 * high:+.1f}%)")
        print(f"    CPU time per step {100 * cpu_middle:+.1f}% (middle half of the rounds: {100 * cpu_low:+.1f}% to "
              f"{100 * cpu_high:+.1f}%)")
        print(f"    capture's own time {own * 1e3:.2f} ms/step = {100 * own / plain:.1f}% of the plain step; "
              f"{own / calls * 1e6:.0f} us per call ({calls} calls per step)")
    if by_step:
        relative = [captured / alone - 1 for alone, captured in by_step]
        random.seed(0)
        medians = sorted(statistics.median(random.choices(relative, k=len(relative))) for _ in range(2000))
        plain = statistics.median(alone for alone, _ in by_step)
        print(f"  metadata only, {len(by_step)} steps paired: plain {plain * 1e3:.1f} ms/step, step time "
              f"{100 * statistics.median(relative):+.1f}% (95% interval of the median {100 * medians[50]:+.1f}% to "
              f"{100 * medians[-51]:+.1f}%)")


@dataclass
class Round:
    plain: float  # median step time of the plain block, s
    captured: float  # the same, captured
    plain_cpu: float  # median CPU time per step of the plain block (the process's, all threads), s
    captured_cpu: float  # the same, captured
    own: float  # the capture's own time per step, s
    calls: int  # calls recorded per step


def steps_paired(model, x, optimizer, root: Path, attention: str, pairs: int) -> list[tuple[float, float]]:
    """(plain, captured) step times of `pairs` pairs of steps in one metadata-only capture: before each step the
    attention function is the capture's wrapper or the original, in random order within the pair. Host drift,
    which makes blocks of steps differ by 5-10% on the H200's host, cancels within a pair (a 95% interval of
    about ±1% from 300 pairs there). What it leaves out: a capture's start and first step, and the model-level
    hooks the capture sets, which stay for both (microseconds per step)."""
    if not pairs:
        return []
    if attention == "sdpa":
        owner, name = F, "scaled_dot_product_attention"
    else:
        import transformer_engine.pytorch as te

        owner, name = te.DotProductAttention, "forward"
    rng = random.Random(0)
    measured = []
    with attn_doctor.capture(root):
        wrapped = getattr(owner, name)
        try:
            for _ in range(3):  # the fingerprint, the model's names, every signature
                step(model, x, optimizer)
            for _ in range(pairs):
                times = {}
                for captured in rng.sample((False, True), 2):
                    setattr(owner, name, wrapped if captured else wrapped._attn_doctor_original)
                    start = time.perf_counter()
                    step(model, x, optimizer)
                    times[captured] = time.perf_counter() - start
                measured.append((times[False], times[True]))
        finally:
            setattr(owner, name, wrapped)  # the capture's stop puts the original back
    return measured


def paired_blocks(model, x, optimizer, root: Path, options: dict, rounds: int, steps: int) -> list[Round]:
    """`rounds` pairs of blocks of `steps` timed steps, plain and captured, in turn."""
    measured = []
    for round_ in range(rounds):
        blocks = {captured: timed_block(model, x, optimizer, root / str(round_) if captured else None, options,
                                        steps)
                  for captured in ((False, True) if round_ % 2 == 0 else (True, False))}
        (plain, plain_cpu, _, _), (captured, captured_cpu, own, calls) = blocks[False], blocks[True]
        measured.append(Round(plain, captured, plain_cpu, captured_cpu, own, calls))
    return measured


def timed_block(model, x, optimizer, root: Path | None, options: dict,
                steps: int) -> tuple[float, float, float, int]:
    """The median step time and CPU time of `steps` steps, plain (`root` None) or in one capture into `root`,
    and the capture's own time and calls per step (0 when plain)."""
    with attn_doctor.capture(root, **options) if root is not None else contextlib.nullcontext() as recorder:
        step(model, x, optimizer)  # not timed: a capture's first call writes the fingerprint
        own, calls = (recorder.seconds, recorder.calls) if recorder is not None else (0.0, 0)
        times, cpu = [], []
        for _ in range(steps):
            start, start_cpu = time.perf_counter(), time.process_time()
            step(model, x, optimizer)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        if recorder is not None:
            own, calls = (recorder.seconds - own) / steps, (recorder.calls - calls) // steps
    return statistics.median(times), statistics.median(cpu), own, calls


if __name__ == "__main__":
    main()
