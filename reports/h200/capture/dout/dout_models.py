"""Issue 17's H200 evidence for the output gradient's (dO's) geometry: a 2-layer stack of the capture bench's
layers (`benchmarks/bench_capture.py`: sdpa, te, te-layer), two training steps under a metadata-only capture
into DIR/cap-<kind>; the dO each attention call's backward really got is noted independently, by a hook set by a
wrapper installed before the capture's, and compared with what the capture recorded.

    python3 reports/h200/capture/dout/dout_models.py DIR sdpa|te|te-layer   (from the project root)
"""

import functools
import sys
from pathlib import Path

import transformer_engine.pytorch as te  # first: TE loads its own cuDNN before torch uses one
import torch
import torch.nn.functional as F

sys.path[:0] = [str(Path.cwd()), str(Path.cwd() / "benchmarks")]
import attn_doctor  # noqa: E402
from attn_doctor.tracing.store import read_capture  # noqa: E402
from bench_capture import make_layer, step  # noqa: E402

out_dir, kind = Path(sys.argv[1]), sys.argv[2]
seen = []  # (call order, geometry of the gradient the backward gave that output)


def geometry(t):
    return {"shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
            "nbytes": t.untyped_storage().nbytes(), "dtype": str(t.dtype).removeprefix("torch.")}


def noting(original):
    @functools.wraps(original)  # the capture binds the arguments by the wrapped function's signature
    def call(*args, **kwargs):
        out = original(*args, **kwargs)
        result = out[0] if isinstance(out, (tuple, list)) else out
        if result.requires_grad:
            position = len(seen)
            seen.append(None)
            result.register_hook(lambda g, position=position: seen.__setitem__(position, geometry(g)))
        return out
    return call


if kind == "sdpa":
    F.scaled_dot_product_attention = noting(F.scaled_dot_product_attention)
else:
    te.DotProductAttention.forward = noting(te.DotProductAttention.forward)
torch.manual_seed(0)
model = torch.nn.Sequential(*[make_layer(512, 8, kind) for _ in range(2)]).to("cuda", torch.bfloat16)
x = torch.randn(4, 512, 512, device="cuda", dtype=torch.bfloat16)
with attn_doctor.capture(out_dir / f"cap-{kind}"):
    for _ in range(2):
        step(model, x)
calls = read_capture(out_dir / f"cap-{kind}")
recorded = [call.meta["tensors"].get("dout") for call in calls]
recorded = [None if r is None else {"shape": r["shape"], "stride": r["stride"], "storage_offset": r["storage_offset"],
                                    "nbytes": r["storage"]["nbytes"], "dtype": r["dtype"]} for r in recorded]
print(f"{kind}: {len(calls)} calls captured, {len(seen)} outputs noted; dO recorded for "
      f"{sum(r is not None for r in recorded)}; recorded == noted for every call: {recorded == seen}")
for call, r in zip(calls[:2], recorded[:2]):
    o = call.meta["tensors"]["out"]
    print(f"  call {call.index} ({call.meta['module']}): out shape {o['shape']} stride {o['stride']}; "
          f"dO shape {r['shape']} stride {r['stride']} offset {r['storage_offset']} storage {r['nbytes']} B")
