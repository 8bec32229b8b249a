"""Where the time of a TE probe goes on a GPU machine where nothing ran before (issue 51's speed goal).

A cold sweep's TE workers cost about 0.28 s per probe (reports/h100/issue51/lease3). This separates, for TE's fused
path called as attn-doctor calls it (a DotProductAttention per setting, backend selection forced each call), the
first call of a configuration from the same call again (what cuDNN builds once: graphs, runtime-compiled kernels)
and from calls that differ in batch or sequence length only (whether a sibling shape reuses what was built), wall
and CPU time apart, with a cProfile of the first calls. `--processes N` runs N copies at once, each on its own
shapes, as a sweep's N TE workers do: the per-call cost beside the others says what sharing the machine costs.

    python3 benchmarks/te_probe_cost.py OUT_DIR [--processes 7,1]     # on the GPU machine, TE installed

Writes OUT_DIR/te-probe-cost.json (every call) and OUT_DIR/te-probe-cost.txt (summary, profile's top entries).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Configurations like te-coverage's (seq 512, bshd/sbhd/thd, masks, head dims, GQA), each a new cuDNN graph.
CONFIGS = [
    dict(b=2, s=512, h=16, kv=16, d=64, dtype="bf16", mask="no_mask", fmt="bshd"),
    dict(b=2, s=512, h=16, kv=16, d=64, dtype="bf16", mask="causal", fmt="bshd"),
    dict(b=2, s=512, h=16, kv=16, d=128, dtype="bf16", mask="causal", fmt="bshd"),
    dict(b=2, s=512, h=16, kv=4, d=128, dtype="bf16", mask="causal", fmt="sbhd"),
    dict(b=2, s=512, h=16, kv=16, d=64, dtype="fp16", mask="causal", fmt="bshd"),
    dict(b=2, s=512, h=16, kv=16, d=128, dtype="fp16", mask="no_mask", fmt="sbhd"),
    dict(b=2, s=512, h=16, kv=16, d=64, dtype="bf16", mask="padding_causal", fmt="thd"),
    dict(b=2, s=512, h=16, kv=16, d=128, dtype="bf16", mask="padding", fmt="thd"),
]


def one_process(offset: int) -> dict:
    import cProfile
    import io
    import pstats

    started = time.perf_counter()
    import torch

    torch_s = time.perf_counter() - started
    import transformer_engine
    import transformer_engine.pytorch as te

    te_s = time.perf_counter() - started - torch_s
    os.environ.update(NVTE_FLASH_ATTN="0", NVTE_FUSED_ATTN="1", NVTE_UNFUSED_ATTN="0")
    from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa

    device = os.environ.get("TE_PROBE_COST_DEVICE", "cuda")  # cpu: a dry run of this script with a stand-in TE
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    calls = []
    profiler = cProfile.Profile()

    def call(config: dict, kind: str, b: int, s: int, profile: bool) -> None:
        torch.manual_seed(0)
        dtype = dtypes[config["dtype"]]
        h, kv, d, fmt = config["h"], config["kv"], config["d"], config["fmt"]
        shape = {"bshd": (b, s), "sbhd": (s, b), "thd": (b * s,)}[fmt]
        q = torch.randn(*shape, h, d, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(*shape, kv, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
        extra = {}
        if fmt == "thd":
            cu = torch.arange(0, (b + 1) * s, s, device=device, dtype=torch.int32)
            extra = dict(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=s, max_seqlen_kv=s)
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        if profile:
            profiler.enable()
        module = te.DotProductAttention(h, d, num_gqa_groups=kv, attn_mask_type=config["mask"], qkv_format=fmt)
        dpa._attention_backends["backend_selection_requires_update"] = True  # as attn-doctor forces its path
        out = module(q, k, v, **extra)
        sync()
        forward = time.perf_counter() - wall
        out.backward(torch.ones_like(out))
        sync()
        if profile:
            profiler.disable()
        calls.append(dict(config=config, kind=kind, b=b, s=s, forward_s=forward,
                          wall_s=time.perf_counter() - wall, cpu_s=time.process_time() - cpu,
                          sub_backend=str(dpa._attention_backends.get("fused_attention_backend"))))

    for number, config in enumerate(CONFIGS):
        s = config["s"] + 64 * offset  # each process its own shapes, as different cases are
        call(config, "first", config["b"], s, profile=True)
        call(config, "again", config["b"], s, profile=False)
        call(config, "batch+1", config["b"] + 1, s, profile=False)
        call(config, "seq+128", config["b"], s + 128, profile=False)
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(25)
    return dict(offset=offset, torch_import_s=torch_s, te_import_s=te_s, calls=calls, profile=text.getvalue(),
                te=getattr(transformer_engine, "__version__", "?"), torch=torch.__version__,
                cudnn=_te_cudnn(), threads=torch.get_num_threads())


def _te_cudnn() -> int | None:
    """The cuDNN TE loaded (asking torch would raise: TE loads the system's build before torch's own)."""
    try:
        import transformer_engine_torch as tex

        return tex.get_cudnn_version()
    except Exception:  # noqa: BLE001 - a fact for the summary only
        return None


def summary(runs: dict[int, list[dict]]) -> str:
    lines = []
    for processes, results in runs.items():
        lines.append(f"== {processes} process(es) at once ==")
        for result in results:
            lines.append(f"process {result['offset']}: torch import {result['torch_import_s']:.1f} s, TE import "
                         f"{result['te_import_s']:.1f} s (TE {result['te']}, torch {result['torch']})")
        for kind in ("first", "again", "batch+1", "seq+128"):
            calls = [c for result in results for c in result["calls"] if c["kind"] == kind]
            wall = sum(c["wall_s"] for c in calls) / len(calls)
            cpu = sum(c["cpu_s"] for c in calls) / len(calls)
            forward = sum(c["forward_s"] for c in calls) / len(calls)
            lines.append(f"  {kind:8} mean of {len(calls):3}: wall {wall * 1e3:7.1f} ms (forward {forward * 1e3:6.1f}),"
                         f" CPU {cpu * 1e3:7.1f} ms")
        first = results[0]
        lines.append(f"  per configuration, process {first['offset']} (first / again / batch+1 / seq+128 wall, ms):")
        for number in range(len(CONFIGS)):
            row = first["calls"][4 * number: 4 * number + 4]
            c = row[0]["config"]
            lines.append(f"    {c['dtype']} {c['mask']:15} {c['fmt']} d{c['d']} kv{c['kv']} sub-backend "
                         f"{row[0]['sub_backend']}: " + " / ".join(f"{r['wall_s'] * 1e3:.0f}" for r in row))
    results = runs[min(runs)]
    lines += ["", "(a process's first configuration includes its one-time costs: CUDA context, cuBLAS, TE's first call)",
              "", "cProfile of the first calls (the run with the fewest processes, its first):", results[0]["profile"]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--processes", default="1")
    parser.add_argument("--child", type=int, default=None)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(one_process(args.child)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    runs: dict[int, list[dict]] = {}
    base = 0  # every process of every run its own shapes: none finds what another built in its on-disk caches
    for processes in (int(p) for p in args.processes.split(",")):
        children = [subprocess.Popen([sys.executable, __file__, str(args.out), "--child", str(base + number)],
                                     stdout=subprocess.PIPE, text=True) for number in range(processes)]
        base += processes
        runs[processes] = [json.loads(child.communicate()[0].strip().splitlines()[-1]) for child in children]
    (args.out / "te-probe-cost.json").write_text(json.dumps(runs, indent=1))
    text = summary(runs)
    (args.out / "te-probe-cost.txt").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
