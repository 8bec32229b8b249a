"""Where a captured call's time goes: cProfile of many calls of a tiny attention (TE's DotProductAttention or
SDPA) under `attn_doctor.capture`, metadata only, sorted by own time. Complements bench_capture.py's totals.

    python benchmarks/profile_capture_call.py [--attention te|sdpa] [--device cuda] [--calls 3000]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import attn_doctor  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_capture import Block  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--attention", choices=("sdpa", "te"), default="sdpa")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    model = torch.nn.Sequential(Block(64, 4, args.attention)).to(args.device, torch.bfloat16)
    x = torch.randn(1, 16, 64, device=args.device, dtype=torch.bfloat16)
    with tempfile.TemporaryDirectory() as tmp, attn_doctor.capture(tmp), torch.no_grad():
        model(x)  # the first call writes the fingerprint
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(args.calls):
            model(x)
        profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
