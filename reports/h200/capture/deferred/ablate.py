"""Where a captured call's own time goes inside a training step, by ablation: the capture's own time per call
(Recorder.seconds) with one part of it replaced by a constant at a time, in interleaved rounds. The bench's model
(benchmarks/bench_capture.py), from the project root:
    python3 reports/h200/capture/deferred/ablate.py te|te-layer|sdpa [layers hidden heads seq batch] [--rounds N]
"each call written at once" is the capture without deferring the calls to the end of the forward pass."""
import statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path.cwd())); sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import torch
import attn_doctor
from attn_doctor.tracing import describe, record, store
from bench_capture import make_layer, step

attention = sys.argv[1]
layers, hidden, heads, seq, batch = (int(a) for a in (sys.argv[2:7] if len(sys.argv) > 6 else (8, 512, 8, 512, 4)))
rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 4
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)
model = torch.nn.Sequential(*[make_layer(hidden, heads, attention) for _ in range(layers)]).to(device, dtype)
x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)

CONSTANT_KEY = ("constant",)
VARIANTS = {
    "full": {},
    "each call written at once": {(record, "_kept_for_backward"): lambda output: False},
    "no calls-file write": {(store.CallLog, "append"): lambda self, line: None},
    "no key (constant)": {(describe.CallDescriber, "_key"): lambda self, *a: CONSTANT_KEY},
    "no TE key": {(describe, "te_key"): lambda module, now, pins: 0},  # the run had (m, pins): its row is void
    "no lines": {(describe.CallDescriber, "lines"): lambda self, *a, **k: ['{"index":0}\n']},
    "no lines, _where": {(describe.CallDescriber, "lines"): lambda self, *a, **k: ['{"index":0}\n'],
                         (record.Recorder, "_where"): lambda self, m: ("layers.0", 0)},
    "no lines, _where, _layout": {(describe.CallDescriber, "lines"): lambda self, *a, **k: ['{"index":0}\n'],
                                  (record.Recorder, "_where"): lambda self, m: ("layers.0", 0),
                                  (record.Recorder, "_layout"): lambda self: (0, 1, {})},
    "no _record": {(record.Recorder, "_record"): lambda self, *a: None},
}

def block(patches, steps=10):
    saved = {target: getattr(*target) for target in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        with tempfile.TemporaryDirectory() as tmp, attn_doctor.capture(tmp) as recorder:
            step(model, x)
            step(model, x)
            own, calls = recorder.seconds, recorder.calls
            times = []
            for _ in range(steps):
                t = time.perf_counter(); step(model, x); times.append(time.perf_counter() - t)
            return statistics.median(times), (recorder.seconds - own) / (steps * layers)  # a call per layer
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)

def plain(steps=10):
    times = []
    for _ in range(steps):
        t = time.perf_counter(); step(model, x); times.append(time.perf_counter() - t)
    return statistics.median(times)

step(model, x)
results = {name: [] for name in ["plain", *VARIANTS]}
for r in range(rounds):
    results["plain"].append((plain(), 0.0))
    for name, patches in (VARIANTS.items() if r % 2 == 0 else reversed(VARIANTS.items())):
        results[name].append(block(patches))
print(f"{attention}: {layers} layers, hidden {hidden}, seq {seq}, batch {batch}, {device}; {rounds} rounds; "
      f"medians: step ms, own us per call (Recorder.seconds)")
base = statistics.median(t for t, _ in results["plain"])
for name, values in results.items():
    t = statistics.median(v[0] for v in values); own = statistics.median(v[1] for v in values)
    print(f"  {name:22s} step {t*1e3:7.2f} ms ({100*(t/base-1):+5.1f}%)  own {own*1e6:6.1f} us/call")
