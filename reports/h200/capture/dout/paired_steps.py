"""The capture's cost on a training step, paired step by step (issue 17): one metadata-only capture stays open;
before each step the attention function is set to the capture's wrapper or to the original (SDPA's function,
or TE's DotProductAttention.forward), in random order within each pair, for N pairs. The model-level hooks the
capture set stay in place for both (a few microseconds per step). Host drift, which makes blocks of steps differ
by 5-10% on the H200's host, cancels within a pair; the figure is the median over pairs of
captured / plain - 1, with a bootstrap 95% interval of that median.

    python3 reports/h200/capture/dout/paired_steps.py N sdpa|te|te-layer   (from the project root)
"""

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path.cwd()), str(Path.cwd() / "benchmarks")]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attn_doctor  # noqa: E402
from bench_capture import make_layer, step  # noqa: E402

pairs, attention = int(sys.argv[1]), sys.argv[2]
torch.manual_seed(0)
random.seed(0)
model = torch.nn.Sequential(*[make_layer(512, 8, attention) for _ in range(8)]).to("cuda", torch.bfloat16)
x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16)
if attention == "sdpa":
    owner, name = F, "scaled_dot_product_attention"
else:
    import transformer_engine.pytorch as te
    owner, name = te.DotProductAttention, "forward"
step(model, x)
relative, plain, own, calls = [], [], [], []
with tempfile.TemporaryDirectory() as tmp, attn_doctor.capture(tmp) as recorder:
    wrapped = getattr(owner, name)
    original = wrapped._attn_doctor_original
    for _ in range(3):
        step(model, x)
    for _ in range(pairs):
        times = {}
        for captured in random.sample((False, True), 2):
            setattr(owner, name, wrapped if captured else original)
            start, seconds, count = time.perf_counter(), recorder.seconds, recorder.calls
            step(model, x)
            times[captured] = time.perf_counter() - start
            if captured:
                own.append(recorder.seconds - seconds)
                calls.append(recorder.calls - count)
        setattr(owner, name, wrapped)
        relative.append(times[True] / times[False] - 1)
        plain.append(times[False])
medians = sorted(statistics.median(random.choices(relative, k=len(relative))) for _ in range(2000))
step_ms, per_call = statistics.median(plain) * 1e3, statistics.median(own) / statistics.median(calls) * 1e6
print(f"{attention}, 8 layers, hidden 512, seq 512, batch 4, bf16, {torch.cuda.get_device_name()}: {pairs} pairs; "
      f"plain step {step_ms:.2f} ms; captured step {100 * statistics.median(relative):+.2f}% (95% interval of the "
      f"median {100 * medians[50]:+.2f}% to {100 * medians[-51]:+.2f}%; mean {100 * statistics.mean(relative):+.2f}%); "
      f"own time {per_call:.1f} us per call, {statistics.median(calls)} calls per step")
