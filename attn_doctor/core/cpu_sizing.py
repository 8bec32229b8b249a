"""The default case on a CPU whose matrix products are slow in the case's dtype: its sizes shrunk so that a
`run` answers in about half a minute, with the same judgement.

The default case (batch 4, seq 1024, 16 heads of 64, bf16, causal) is TE#1615's; on a CPU without fast bf16
products (an AMD EPYC with AVX2 and no AVX512-BF16) its run took 617 s. Only the default lengths are shrunk: a
case whose batch or sequence lengths the user chose (a flag or a recipe key) is run as given, however long it
takes (the heartbeat says it is working). Only on the CPU, and only the batch, then the sequence length: never
the dtype, the mask or the heads, and never the verdict rules, which compare each kernel with
what a correct implementation in the same dtype gets on the same inputs (`attn_doctor.verdict`), so a smaller
case is judged the same way. Every shrink is said in one line (`Sizing.note`) and kept in the results.

The cost model (`product_seconds`): one probe is one forward and one backward of attention, seven matrix products
of 2·batch·heads·seq·seq_kv·head_dim flops each (QKᵀ and PV forward; dP, dV, dS·K, dSᵀ·Q and the recomputed
scores backward), so a run's products are probes × 14·b·h·s·skv·d flops at the measured rate
(`attn_doctor.machine.matmul_rate`, one thread). Measured on a 2-core Intel Xeon with bf16 emulated slow
(`ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2`: probe rate 4.0 GFLOP/s; 15 probes; benchmarks/RESULTS.md),
the whole run took 5.1 s at b1 s128, 5.6 s at b1 s256, 7.7 s at b1 s512 and 41.4 s at b1 s1024, where the
model says 0.9, 3.5, 14.1 and 56 s of products on top of about 4.5 s of start-up (interpreter, torch, the
workers, the float64 reference); with another process busy on one core, 8.3, 8.5, 15.8 and 52.6 s (start-up
about 7 s). So the model is an upper bound up to b1 s1024 (the two workers run in parallel); the default case
(293-333 s measured, 225 s modelled) is far over any budget either way.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from attn_doctor.core.case import Case
from attn_doctor.core.errors import BadInput

FLOPS_PER_PROBE_ELEMENT = 14  # seven products of 2 flops per (batch, head, query, key, dim) element
# The products may take this long: a run is the start-up (4.5-7 s on 2 cores, measured), the case-sized work
# that is not a product in the dtype (the float64 reference, comparisons: about 1 s at b1 s512) and the
# products, and answers in 30 s with room for a model off by half as much again or a busier machine.
PRODUCT_SECONDS_BUDGET = 15.0
MIN_SEQ = 128  # shorter sequences say little about long-context attention; the smallest case shrinking makes
SIZED_FIELDS = ("batch", "seq")  # in the order they are shrunk: the batch first (its sequences are independent)
FLAGS = {"batch": "--batch", "seq": "--seq"}


@dataclass(frozen=True)
class Sizing:
    case: Case
    note: str | None = None  # what was shrunk and why, in one line; None: the case is as given


def product_seconds(case: Case, probes: int, gflops: float) -> float:
    """The seconds a run's matrix products take: `probes` forward+backward calls of `case` at `gflops` GFLOP/s
    (the case's dtype, one thread)."""
    elements = case.batch * case.heads * case.seq * case.seq_kv * case.head_dim
    return probes * FLOPS_PER_PROBE_ELEMENT * elements / (gflops * 1e9)


def resizable(case: Case, device: str, given: Collection[str]) -> list[str]:
    """The sizes the CPU sizing may shrink: on the CPU, while the user chose none of the lengths (a user who
    gives --seq 8192 asked for that case, batch included). Lengths per sequence (--seqlens) and a replayed call
    fix the shapes themselves."""
    if not device.startswith("cpu") or case.seqlens is not None or case.seqlens_kv is not None:
        return []
    if case.replay is not None or set(given) & {"replay", "seqlens", "seqlens_kv", "seq_kv", *SIZED_FIELDS}:
        return []
    return list(SIZED_FIELDS)


def size_for_cpu(case: Case, device: str, given: Collection[str], probes: int, gflops: float | None) -> Sizing:
    """`case` with its batch, then its sequence length, halved (those `resizable` allows) until the run's
    products fit `PRODUCT_SECONDS_BUDGET` at `gflops` (or the batch is 1 and seq `MIN_SEQ`); unchanged on a GPU,
    when the products already fit, or when the rate is unknown (None)."""
    shrinkable = resizable(case, device, given)
    if not shrinkable or gflops is None or not (0 < gflops < math.inf) or probes <= 0:
        return Sizing(case)
    if product_seconds(case, probes, gflops) <= PRODUCT_SECONDS_BUDGET:
        return Sizing(case)
    sized = case
    while product_seconds(sized, probes, gflops) > PRODUCT_SECONDS_BUDGET:
        smaller = _halved(sized, shrinkable)
        if smaller is None:
            break
        sized = smaller
    if sized == case:
        return Sizing(case)
    shrunk = [name for name in SIZED_FIELDS if getattr(sized, name) != getattr(case, name)]
    sizes = ", ".join(f"{name} {getattr(sized, name)}" for name in shrunk)
    smallest = ", as far as it goes" if product_seconds(sized, probes, gflops) > PRODUCT_SECONDS_BUDGET else ""
    flags = "/".join(FLAGS[name] for name in shrunk)
    note = (f"CPU {case.dtype} matmul at {_rate(gflops)} GFLOP/s: the default case is shrunk to {sizes}{smallest} "
            f"(give {flags} to choose)")
    return Sizing(sized, note)


def _rate(gflops: float) -> str:
    return f"{gflops:.0f}" if gflops >= 10 else f"{gflops:.1f}" if gflops >= 1 else f"{gflops:.2g}"


def _halved(case: Case, shrinkable: list[str]) -> Case | None:
    """The next smaller case: the batch halved while above 1, else the sequence while above MIN_SEQ; None when
    neither can shrink (or the smaller case is not a valid one)."""
    changes: dict[str, int] = {}
    if "batch" in shrinkable and case.batch > 1:
        changes["batch"] = max(1, case.batch // 2)
    elif "seq" in shrinkable and case.seq > MIN_SEQ:
        changes["seq"] = max(MIN_SEQ, case.seq // 2)
        if case.seq_kv == case.seq:
            changes["seq_kv"] = changes["seq"]  # self-attention stays self-attention
    if not changes:
        return None
    try:
        return Case.from_dict({**case.to_dict(), **changes})  # validated as any case is
    except BadInput:
        return None
