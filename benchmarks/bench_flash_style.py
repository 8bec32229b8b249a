"""What the flash-style part of the yardstick costs: the extra float64 pass per case (issue 41).

Per case, the baseline's probe measures what a correct flash-style backward's output rounding makes on dQ and dK
(`attn_doctor.numerics.rounded_output.case_figures`): one more exact attention, keys as values, whose backward
needs only the value gradient, and two comparisons. This times it against the case's float64 reference
(`attention_reference` with the term magnitudes), each the median of --repeats, in this process.

    python benchmarks/bench_flash_style.py --device cpu --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from attn_doctor.core.case import make_case
from attn_doctor.numerics.inputs import make_inputs, synchronize
from attn_doctor.numerics.reference import attention_reference
from attn_doctor.numerics.rounded_output import case_figures
from attn_doctor.numerics.standalone import compared_rows


def timed(fn, device: torch.device, repeats: int) -> tuple[float, list[float]]:
    runs = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        runs.append(time.perf_counter() - start)
    return statistics.median(runs), runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seqs", default="1024,4096", help="comma-separated sequence lengths (b4 h16 d64 bf16 causal)")
    parser.add_argument("--inputs", default="normal,deep-layer")
    args = parser.parse_args()
    device = torch.device(args.device)
    for seq in (int(s) for s in args.seqs.split(",")):
        for inputs in args.inputs.split(","):
            case = make_case(batch=4, seq=seq, heads=16, head_dim=64, dtype="bf16", mask="causal", inputs=inputs)
            drawn = make_inputs(case, device)
            masks = compared_rows(case.plain(), drawn.semantics.allowed, device)

            def reference():
                return attention_reference(drawn.q, drawn.k, drawn.v, drawn.dout, softmax_scale=case.softmax_scale,
                                           semantics=drawn.semantics)

            exact = reference()
            ref_s, ref_runs = timed(reference, device, args.repeats)
            part_s, part_runs = timed(lambda: case_figures(case, drawn.q, drawn.k, drawn.dout, exact, drawn.semantics,
                                                           masks), device, args.repeats)
            print(json.dumps({"case": case.short(), "device": args.device, "reference_s": round(ref_s, 4),
                              "flash_style_part_s": round(part_s, 4), "part_over_reference": round(part_s / ref_s, 3),
                              "reference_runs": [round(r, 4) for r in ref_runs],
                              "part_runs": [round(r, 4) for r in part_runs]}), flush=True)


if __name__ == "__main__":
    main()
