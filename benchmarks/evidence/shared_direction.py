"""How large a direction the keys and values of each captured attention call share: the statistic the
`deep-layer` inputs are built on (`attn_doctor.numerics.inputs`, `standalone.SHARED_DIRECTION`).

For every call of a capture made with values, per (sequence, kv head): the mean key over the sequence's
tokens, its norm over the root-mean-square norm of the keys' deviations from it; likewise for the values.
Printed per call as the median and the largest over the (sequence, kv head) pairs, with the layer the call
was captured at. Seeded `deep-layer` inputs give 1.5 for both; standard normal ones about 1/sqrt(seq).

Usage: python benchmarks/evidence/shared_direction.py CAPTURE_DIR [CAPTURE_DIR ...]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

from attn_doctor.tracing.replay_case import native_format
from attn_doctor.tracing.replay_source import as_bshd
from attn_doctor.tracing.store import load_values, read_capture


def shared_direction(t: torch.Tensor) -> list[float]:
    """Per (sequence, head) of a bshd tensor: |mean over tokens| / RMS |token - mean|."""
    t = t.to(torch.float64)
    mean = t.mean(dim=1, keepdim=True)
    spread = (t - mean).square().sum(-1).mean(dim=1).sqrt()  # [b, h]
    return (mean[:, 0].norm(dim=-1) / spread.clamp_min(1e-300)).flatten().tolist()


def main(folders: list[str]) -> int:
    print("capture | rank | layer | call | keys: median, max | values: median, max")
    for folder in folders:
        for call in read_capture(Path(folder)):
            fmt = native_format(call)
            if call.values_path is None or fmt == "thd":
                continue  # no values, or packed sequences (their tokens need the packing to split)
            values = load_values(call.values_path, lambda name: name in ("k", "v"))
            figures = [shared_direction(as_bshd(values[name], fmt, side="kv")) for name in ("k", "v")]
            layer = call.meta.get("layer", call.meta.get("arguments", {}).get("layer_number", "?"))
            cells = "; ".join(f"{statistics.median(f):.2f}, {max(f):.2f}" for f in figures)
            print(f"{Path(folder).name} | {call.rank} | {layer} | {call.index} | {cells}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__.strip().splitlines()[-1])
    sys.exit(main(sys.argv[1:]))
