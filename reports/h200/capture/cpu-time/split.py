"""Where a captured call's own time goes (issue 17, sixth H200 run): the part at the call and the part when the
model's forward pass ends (the calls described then), per call, in rounds of 20 steps of the bench's model
(benchmarks/bench_capture.py); and the same describing replayed at once on the same calls, caches warm.
    PYTHONWARNINGS=ignore python3 reports/h200/capture/cpu-time/split.py te|te-layer|sdpa   (project root)"""
import statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path.cwd())); sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import torch
import attn_doctor
from attn_doctor.tracing import record
from bench_capture import make_layer, step

attention = sys.argv[1]
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = torch.nn.Sequential(*[make_layer(512, 8, attention) for _ in range(8)]).to(device, torch.bfloat16)
x = torch.randn(4, 512, 512, device=device, dtype=torch.bfloat16)
at_end = [0.0]
batches = []
forward_done, write = record.Recorder._forward_done, record.Recorder._write


def timed_forward_done(self, *args):
    start = time.perf_counter()
    forward_done(self, *args)
    at_end[0] += time.perf_counter() - start


def kept_write(self, calls):
    batches.append(list(calls))
    write(self, calls)


record.Recorder._forward_done, record.Recorder._write = timed_forward_done, kept_write
step(model, x)
rounds = []
with tempfile.TemporaryDirectory() as tmp:
    for r in range(8):
        with attn_doctor.capture(f"{tmp}/{r}") as recorder:
            step(model, x)
            step(model, x)
            own, calls, at_end[0] = recorder.seconds, recorder.calls, 0.0
            for _ in range(20):
                step(model, x)
            n = recorder.calls - calls
            total = recorder.seconds - own
            batch = batches[-1]
            start = time.perf_counter()
            for _ in range(10):
                write(recorder, batch)
            warm = (time.perf_counter() - start) / (10 * len(batch))
            rounds.append(((total - at_end[0]) / n, at_end[0] / n, warm))
        batches.clear()
at_call, at_forward_end, warm = (statistics.median(r[i] for r in rounds) * 1e6 for i in range(3))
print(f"{attention}, 8 layers, hidden 512, {device}: own time per call {at_call:.1f} us at the call + "
      f"{at_forward_end:.1f} us when the forward pass ends; the latter replayed warm: {warm:.1f} us")
