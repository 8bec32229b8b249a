# Where the step time of a captured launch-bound stack goes (issue 17, fourth H200 run): forward and backward CPU
# time and the synchronised step, plain, captured, captured with _record replaced by a no-op (the wrappers alone),
# and captured with the garbage collector off; 16 rounds of 5 steps, order reversed every other round.
#   PYTHONWARNINGS=ignore python3 reports/h200/capture/own-time/gap.py sdpa|te   (from the project root)
import sys, os, time, tempfile, statistics, contextlib, gc
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.getcwd() + "/benchmarks")
import torch
from bench_capture import Block
import attn_doctor
from attn_doctor.tracing import record
attention = sys.argv[1] if len(sys.argv) > 1 else "sdpa"
torch.manual_seed(0)
model = torch.nn.Sequential(*[Block(512, 8, attention) for _ in range(8)]).to("cuda", torch.bfloat16)
x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16)
def step():
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter(); y = model(x).float().square().mean(); t1 = time.perf_counter()
    y.backward(); t2 = time.perf_counter(); torch.cuda.synchronize(); t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t0
real = record.Recorder._record
variants = {"plain": None, "full": real, "no _record": lambda *a: None, "full, gc off": real}
res = {k: [] for k in variants}
step(); step()
with tempfile.TemporaryDirectory() as tmp:
    for r in range(16):
        for name, rec in (variants.items() if r % 2 == 0 else list(variants.items())[::-1]):
            if rec is not None: record.Recorder._record = rec
            if "gc off" in name: gc.disable()
            with (attn_doctor.capture(f"{tmp}/{r}{name}") if rec else contextlib.nullcontext()) as c:
                step()
                s0 = c.seconds if c else 0.0
                ts = [step() for _ in range(5)]
                own = (c.seconds - s0) / 5 if c else 0.0
            gc.enable()
            res[name].append([statistics.median(t[i] for t in ts) for i in range(3)] + [own])
base = [statistics.median(v[i] for v in res["plain"]) for i in range(3)]
print(f"{attention}: forward CPU / backward CPU / step (synchronised), ms; own = the capture's Recorder.seconds")
for k, v in res.items():
    m = [statistics.median(x[i] for x in v) * 1e3 for i in range(4)]
    print(f"  {k:14s} fwd {m[0]:6.2f}  bwd {m[1]:6.2f}  step {m[2]:6.2f} ({(m[2] / base[2] / 1e3 - 1) * 100:+.1f}%)  own {m[3]:.2f}")
