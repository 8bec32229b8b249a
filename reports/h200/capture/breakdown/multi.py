"""Several capture variants against plain, step by step in one process (variants swapped in by monkeypatching
between steps): per variant, the median over rounds of (variant step / neighbouring plain step - 1)."""
import operator, random, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path.cwd())); sys.path.insert(0, str(Path.cwd() / "benchmarks"))
import torch
import torch.nn.functional as F
import attn_doctor
from attn_doctor.tracing import record, describe, store
from bench_capture import make_layer, step

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
variants = sys.argv[2].split(",") if len(sys.argv) > 2 else ["full"]
attention = sys.argv[3] if len(sys.argv) > 3 else "sdpa"
device = "cuda" if torch.cuda.is_available() else "cpu"
hidden, seq, batch, heads = (512, 512, 4, 8) if device == "cuda" else (64, 16, 2, 4)
dtype = torch.bfloat16 if device == "cuda" else torch.float32
if device == "cpu": torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(*[make_layer(hidden, heads, attention) for _ in range(8)]).to(device, dtype)
x = torch.randn(batch, seq, hidden, device=device, dtype=dtype)
R, D, S = record.Recorder, describe.CallDescriber, store.CallLog
saved = {(R, "_write"): R._write, (D, "lines"): D.lines, (R, "_record"): R._record, (R, "_where"): R._where,
         (S, "append"): S.append, (describe, "tensors_key"): describe.tensors_key}
extra = {}
WRAPPERS = {}
try:
    sys.path.insert(0, str(Path(__file__).parent)); import variants_extra  # noqa: E401  # optional: more variants, name -> function(apply: bool)
    extra = variants_extra.VARIANTS
    WRAPPERS = variants_extra.WRAPPERS
except ImportError:
    pass
def apply(v):
    for (o, n), f in saved.items(): setattr(o, n, f)
    for name, f in extra.items(): f(False)
    if v == "no-write": R._write = lambda self, calls: None
    if v == "const-lines": D.lines = lambda self, *a, **k: ['{"index":1,"module":"0.x","layer":0,"step":1,"values":null,"signature":0}\n']
    if v == "no-append": S.append = lambda self, line: None
    if v == "no-where": R._where = lambda self, m: ("", None)
    if v == "key-q-only": describe.tensors_key = lambda t: saved[(describe, "tensors_key")](t[:1])
    if v in extra: extra[v](True)
step(model, x)
rel = {v: [] for v in variants}; own = {v: [] for v in variants}; plain_t = []
api = {"sdpa": (F, "scaled_dot_product_attention")}.get(attention)
if api is None:
    import transformer_engine.pytorch as te
    api = (te.DotProductAttention, "forward")
with tempfile.TemporaryDirectory() as tmp, attn_doctor.capture(tmp) as rec:
    wrapped = getattr(*api)
    original = wrapped._attn_doctor_original
    made = {v: WRAPPERS[v](rec, original) for v in variants if v in WRAPPERS}
    for _ in range(3): step(model, x)
    for i in range(rounds):
        order = variants[:] ; random.shuffle(order)
        for v in order:
            t = {}
            for captured in ((False, True) if random.random() < 0.5 else (True, False)):
                apply(v if captured else "full")
                setattr(*api, made.get(v, wrapped) if captured else original)
                s0, o0 = time.perf_counter(), rec.seconds
                step(model, x)
                t[captured] = (time.perf_counter() - s0, rec.seconds - o0)
            rel[v].append(t[True][0] / t[False][0] - 1); own[v].append(t[True][1]); plain_t.append(t[False][0])
    apply("full"); setattr(*api, wrapped)
random.seed(1)
def ci(values):
    meds = sorted(statistics.median(random.choices(values, k=len(values))) for _ in range(1000))
    return meds[25], meds[-26]
p = statistics.median(plain_t)
print(f"{attention} {device} Python {sys.version.split()[0]}: {rounds} rounds; plain {p*1e3:.2f} ms/step")
for v in variants:
    lo, hi = ci(rel[v])
    print(f"  {v:14s} step {100*statistics.median(rel[v]):+6.2f}% (95% CI {100*lo:+.2f}..{100*hi:+.2f}), mean {100*statistics.mean(rel[v]):+6.2f}%; "
          f"own {statistics.median(own[v])/8*1e6:5.1f} us/call = {100*statistics.median(own[v])/p:.2f}%")
