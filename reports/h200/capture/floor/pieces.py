"""What each piece of a captured SDPA call costs, warm, in a tight loop (issue 17): the describing of a call of a
known signature and its parts, the module walk, the wrapper's binding, and Python's own speed (for comparing
hosts). Microseconds per run, best of 5.

    python3 reports/h200/capture/floor/pieces.py   (from the project root)
"""

import sys
import tempfile
import timeit
from pathlib import Path

sys.path[:0] = [str(Path.cwd())]
import torch  # noqa: E402

from attn_doctor.tracing import describe, record, store  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
b, s, h, d = 4, 512, 8, 64
qkv = torch.randn(b, s, 3, h, d, device=device, dtype=torch.bfloat16, requires_grad=True) * 1
q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
bound = {"query": q, "key": k, "value": v, "is_causal": True}
names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
describer = describe.CallDescriber({"pid": 1, "started": "now"})
call = dict(api="torch.sdpa", rank=0, world_size=1, parallel={}, bound=bound, qkv=("query", "key", "value"),
            output=out, te_module=None, te_state=None, index=0, module_path="3.attention", layer=3, step=1,
            values=None)
describer.lines(**call)
tmp = tempfile.mkdtemp()
log = store.CallLog(Path(tmp), 0, 1)
line = describer.lines(**call)[0]


class Inner(torch.nn.Module):
    def forward(self, n):
        return timeit.repeat(lambda: record.innermost_module(sys._getframe(1)), number=n, repeat=5)


pieces = {
    "sum(range(100))": lambda: sum(range(100)),
    "time.perf_counter()": __import__("time").perf_counter,
    "bind: dict(zip) | kwargs": lambda: dict(zip(names, (q, k, v))) | {"is_causal": True},
    "describer.lines (known signature)": lambda: describer.lines(**call),
    "  tensors_key(q, k, v, out)": lambda: describe.tensors_key((q, k, v, out)),
    "  _key": lambda: describer._key("torch.sdpa", 0, 1, {}, {"is_causal": True}, (q, k, v, out), None, None, []),
    "  hash(_key)": (lambda key: lambda: hash(key))(describer._key("torch.sdpa", 0, 1, {}, {"is_causal": True},
                                                                  (q, k, v, out), None, None, [])),
    "  _head": lambda: describer._head(5, "3.attention", 3, 1, None),
    "  log.append": lambda: log.append(line),
    "record._kept_for_backward": lambda: record._kept_for_backward(out),
    "q.untyped_storage()": q.untyped_storage,
}
print(f"{device}, {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, Python {sys.version.split()[0]}, "
      f"torch {torch.__version__}")
for name, function in pieces.items():
    n = 20000
    print(f"  {name:40s} {min(timeit.repeat(function, number=n, repeat=5)) / n * 1e6:7.2f} us")
n = 20000
print(f"  {'innermost_module (walk to the module)':40s} {min(Inner()(n)) / n * 1e6:7.2f} us")
log.close()
