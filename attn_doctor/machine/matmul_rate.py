"""How fast this machine multiplies matrices of a dtype on the CPU: one tiny timed batched product, a fact in the
manner of torch/utils/collect_env.py's (it never raises; None when it cannot be measured).

Why a measurement and not the CPU's flags: whether bf16 products are fast depends on the CPU (AVX512-BF16,
AMX), on what oneDNN may use (`ONEDNN_MAX_CPU_ISA`), on torch's build and on the threads it runs; the product
says it all. On an AMD EPYC with AVX2 and no AVX512-BF16, one 64×1024×64×1024 bf16 `bmm` took 13.0 s against
0.21 s in fp32, and the default `run` took 617 s; on an Intel Xeon with AMX the same bf16 product is faster than
fp32. `attn_doctor.core.cpu_sizing` sizes the default case from this rate.
"""

from __future__ import annotations

import math
import time

# batch, rows, inner, columns: the shape of a 4-head block of head-dim-64 scores at seq 128. 8.4 MFLOP: 13 ms
# at the slowest bf16 rate seen (0.66 GFLOP/s), microseconds with AMX; the four products below stay well under
# a second on any CPU attn-doctor runs on.
PROBE_SHAPE = (4, 128, 64, 128)
TIMED_PRODUCTS = 3  # after one untimed product (oneDNN picks and builds its kernel on the first)


def probe_flops() -> int:
    batch, rows, inner, columns = PROBE_SHAPE
    return 2 * batch * rows * inner * columns


def cpu_matmul_gflops(dtype: str = "bf16") -> float | None:
    """GFLOP/s of one small batched product of `dtype` (bf16, fp16, fp32) on one CPU thread: the fastest of a
    few timings, so that a stray pause does not make a fast machine look slow. None when torch is missing or the
    product fails.

    One thread, because on a core another process keeps busy, torch's threads wait for each other at every
    product: on 2 cores with one taken, two threads measured the AMX machine at 1.5 GFLOP/s, one thread at 280.
    One thread is also what each worker of a 2-core run gets (`execution.session.cpu_threads`)."""
    threads = None
    try:
        import torch

        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        batch, rows, inner, columns = PROBE_SHAPE
        generator = torch.Generator().manual_seed(0)
        left = torch.randn(batch, rows, inner, generator=generator).to(torch_dtype)
        right = torch.randn(batch, inner, columns, generator=generator).to(torch_dtype)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        with torch.no_grad():
            torch.bmm(left, right)
            fastest = math.inf
            for _ in range(TIMED_PRODUCTS):
                start = time.perf_counter()
                torch.bmm(left, right)
                fastest = min(fastest, time.perf_counter() - start)
        rate = probe_flops() / max(fastest, 1e-9) / 1e9
    except Exception:  # a fact about the machine: any failure means "not known", never a failed command
        return None
    finally:
        if threads is not None:
            _set_threads(threads)
    return rate if math.isfinite(rate) and rate > 0 else None


def _set_threads(threads: int) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
    except Exception:  # the measurement never raises; torch keeps the one thread then
        pass
