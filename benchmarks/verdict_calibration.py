"""The verdict rule's calibration (issue 15): each correct CPU path's error against its terms' scale, in units
of the dtype's epsilon, whole tensor / worst (batch, head) slice, with the cancellation (||exact|| / scale) and
the bias z-score, on Gaussian inputs and on the cases where the exact dQ/dK cancel. NOISE_EPS in
attn_doctor/verdict/rule.py is chosen from these figures.

    python benchmarks/verdict_calibration.py
"""
import torch

from attn_doctor.backends import build, select, static_skip
from attn_doctor.core.case import make_case
from attn_doctor.core.coords import Coords
from attn_doctor.numerics import inputs as inp
from attn_doctor.probes import call
from attn_doctor.probes.caches import Caches

dev = torch.device("cpu")
specs = select(["sdpa", "local"])
backends = {s.name: build(s) for s in specs}
caches = Caches(dev)
orig = inp.make_inputs

def variant(kind):
    def mk(case, device, *source):
        x = orig(case, device, *source)
        if kind == "equal_keys":
            x.k[:] = x.k[:, :1]
        elif kind == "equal_values":
            x.v[:] = x.v[:, :1]
        elif kind == "huge":
            x.q.mul_(8); x.k.mul_(8)
        return x
    return mk

def rows(case, kind="normal"):
    import attn_doctor.probes.caches as pc
    pc.make_inputs = variant(kind)
    caches.case.clear()
    out = {}
    for name, b in backends.items():
        spec = next(s for s in specs if s.name == name)
        if static_skip(spec, case, "cpu"):
            continue
        try:
            o = call.run(b, Coords.call(case, spec, "contiguous"), caches)
        except Exception:
            continue
        if o.status == "ok":
            out[name] = o.metrics
    return out

cases = []
for dtype in ("bf16", "fp16", "fp32"):
    for seq, d, mask in [(64, 64, "causal"), (256, 64, "none"), (128, 128, "causal")]:
        cases.append((make_case(batch=1, seq=seq, heads=2, head_dim=d, dtype=dtype, mask=mask), "normal"))
    cases += [
        (make_case(batch=1, seq=1, heads=1, head_dim=16, dtype=dtype, mask="none"), "seq1"), (make_case(batch=1, seq=1, heads=4, head_dim=16, dtype=dtype, mask="none"), "seq1h4"), (make_case(batch=2, seq=3, heads=4, head_dim=128, dtype=dtype, mask="none", window=(0,0)), "win00d128"),
        (make_case(batch=1, seq=16, seq_kv=1, heads=2, head_dim=16, dtype=dtype, mask="none"), "skv1"),
        (make_case(batch=1, seq=32, heads=2, head_dim=16, dtype=dtype, mask="none", window=(0, 0)), "win00"),
        (make_case(batch=1, seq=64, heads=2, head_dim=64, dtype=dtype, mask="none"), "huge"),
        (make_case(batch=1, seq=64, heads=2, head_dim=64, dtype=dtype, mask="none"), "equal_keys"),
        (make_case(batch=1, seq=64, heads=2, head_dim=64, dtype=dtype, mask="causal"), "equal_values"),
    ]
EPS = {"bf16": 2**-7, "fp16": 2**-10, "fp32": 2**-23}
for case, kind in cases:
    r = rows(case, kind)
    base = r.get("local")
    for name, m in r.items():
        line = [f"{case.dtype} {kind:12s} {name:14s}"]
        for t in ("out", "dq", "dk", "dv"):
            x = m[t]
            line.append(f"{t}: {x.scaled_err/EPS[case.dtype]:5.2f}/{x.worst_head_scaled_err/EPS[case.dtype]:5.2f} c{x.cancellation:4.2f} z{x.bias_z:5.1f}")
        print(" | ".join(line))
