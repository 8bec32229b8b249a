"""Would describing the deferred calls on a thread of their own take the capture's cost off a launch-bound step?
A probe before building it (issue 17): in one open metadata-only capture, steps paired in random order within a
round: plain (the original attention function), sync (the capture as committed: the forward's calls described
and written on the model's thread when its forward ends), thread (the same calls handed to a thread at the
forward's end; the step's time includes waiting, after its synchronisation, until the thread has written them),
thread-yield (the thread lets the interpreter lock go after each call) and none (the forward's calls dropped, not
described: the most a thread could save). PROBE_GC=off turns Python's collector off after the first steps.
The first steps run sync, so that every call site's dO hook is set and done before the thread runs (the probe's
thread would otherwise set hooks itself, which the real design must not).

    python3 reports/h200/capture/floor/probe.py ROUNDS sdpa|te|te-layer   (from the project root)
"""

import gc
import os
import queue
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path.cwd()), str(Path.cwd() / "benchmarks")]
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import attn_doctor  # noqa: E402
from attn_doctor.tracing.record import Recorder  # noqa: E402
from bench_capture import make_layer, step  # noqa: E402

rounds, attention = int(sys.argv[1]), sys.argv[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
random.seed(0)
model = torch.nn.Sequential(*[make_layer(512, 8, attention) for _ in range(8)]).to(DEVICE, torch.bfloat16)
x = torch.randn(4, 512, 512, device=DEVICE, dtype=torch.bfloat16)
if attention == "sdpa":
    owner, name = F, "scaled_dot_product_attention"
else:
    import transformer_engine.pytorch as te
    owner, name = te.DotProductAttention, "forward"

handed: "queue.Queue[tuple]" = queue.Queue()
sync_flush = Recorder._flush


def writer() -> None:
    while True:
        recorder, calls, polite = handed.get()
        try:
            if polite:  # a call at a time, the interpreter lock let go between them
                for call in calls:
                    recorder._write([call])
                    time.sleep(0)
            else:
                recorder._write(calls)
        except Exception as exc:  # noqa: BLE001
            print("writer:", exc, file=sys.stderr)
        finally:
            handed.task_done()


def threaded_flush(self, polite: bool = False) -> None:
    with self._lock:
        calls, self._deferred = self._deferred, []
    if calls:
        handed.put((self, calls, polite))


def polite_flush(self) -> None:
    threaded_flush(self, polite=True)


def dropping_flush(self) -> None:  # the most a thread could save: the calls not described at all
    with self._lock:
        self._deferred = []


threading.Thread(target=writer, daemon=True).start()
step(model, x)
times: dict[str, list[float]] = {"plain": [], "sync": [], "thread": [], "thread-yield": [], "none": []}
with tempfile.TemporaryDirectory() as tmp, attn_doctor.capture(tmp) as recorder:
    wrapped = getattr(owner, name)
    original = wrapped._attn_doctor_original
    for _ in range(3):
        step(model, x)
    if os.environ.get("PROBE_GC") == "off":  # is the collector's extra work part of the cost?
        gc.collect()
        gc.disable()
    for _ in range(rounds):
        for variant in random.sample(list(times), len(times)):
            setattr(owner, name, original if variant == "plain" else wrapped)
            Recorder._flush = {"thread": threaded_flush, "thread-yield": polite_flush, "none": dropping_flush}.get(variant, sync_flush)
            start = time.perf_counter()
            step(model, x)
            handed.join()
            times[variant].append(time.perf_counter() - start)
    setattr(owner, name, wrapped)
    Recorder._flush = sync_flush
    calls = recorder.calls


def summary(variant: str) -> str:
    relative = [a / b - 1 for a, b in zip(times[variant], times["plain"])]
    medians = sorted(statistics.median(random.choices(relative, k=len(relative))) for _ in range(2000))
    return (f"{variant} {100 * statistics.median(relative):+.2f}% (95% interval {100 * medians[50]:+.2f}% to "
            f"{100 * medians[-51]:+.2f}%)")


print(f"{attention}, 8 layers, hidden 512, seq 512, batch 4, bf16, {torch.cuda.get_device_name() if DEVICE == 'cuda' else 'cpu'}, Python "
      f"{sys.version.split()[0]}: {rounds} rounds; plain step {1e3 * statistics.median(times['plain']):.2f} ms; "
      f"{summary('sync')}; {summary('thread')}; {summary('thread-yield')}; {summary('none')}; {calls} calls recorded; gc {os.environ.get('PROBE_GC', 'on')}")
