"""cProfile of the describing a captured forward pass's calls takes, replayed 300 times on one pass's calls with
caches warm (issue 17, sixth H200 run). It ran inline on the device, as this file's text in a heredoc:
    for a in te te-layer; do python3 - $a < reports/h200/capture/cpu-time/profile-describe.py; done
(with PYTHONWARNINGS=ignore PYTHONPATH=$PWD, from the project root). Output: profile-describe.txt."""
import sys, cProfile, pstats, tempfile, io
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch, attn_doctor
from attn_doctor.tracing import record
from bench_capture import make_layer, step
a = sys.argv[1]
torch.manual_seed(0)
m = torch.nn.Sequential(*[make_layer(512, 8, a) for _ in range(8)]).to("cuda", torch.bfloat16)
x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16)
B = []
w = record.Recorder._write
record.Recorder._write = lambda self, calls: (B.append(list(calls)), w(self, calls))[1]
with tempfile.TemporaryDirectory() as t, attn_doctor.capture(t) as r:
    for _ in range(3): step(m, x)
    b = B[-1]
    p = cProfile.Profile(); p.enable()
    for _ in range(300): w(r, b)
    p.disable()
    s = io.StringIO(); pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(22); print(a, len(b)); print(s.getvalue()[-4000:])
