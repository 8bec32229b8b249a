"""One rank of a distributed probe: `python -m attn_doctor.distributed.rank JOB.json`, started by torchrun.

The job (written by `launch`) lists probes (coordinates of one rank grid: nproc = tp * cp ranks, TP
fastest). For each probe every rank builds the FULL inputs from the case's seed, takes its shard (its TP
heads and, under CP, its load-balanced sequence chunks), computes the shard's out/dq/dk/dv (`shards`),
and sends them to rank 0, which reassembles and measures them (`analysis`) and writes the results JSON.
Every rank writes its progress and its own output to the job folder (`context`), so a rank that fails,
dies or hangs is named.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

from attn_doctor.core.errors import first_line
from attn_doctor.distributed.context import Context, Progress, Stop, guarded
from attn_doctor.distributed.grid import TENSORS
from attn_doctor.results.files import write_atomic


def _redirect_output(folder: str, rank: int) -> None:
    """This rank's stdout and stderr go to rankRANK.log (torchrun would interleave them)."""
    log = open(Path(folder) / f"rank{rank}.log", "ab", buffering=0)  # noqa: SIM115 - lives as long as the process
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)


def _watch_parent() -> None:
    """Exit when torchrun goes away (killed): a rank must never outlive its launch."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(70)

    threading.Thread(target=watch, daemon=True).start()


class Prober:
    """Runs one probe after another on this rank."""

    def __init__(self, ctx: Context):
        from attn_doctor.distributed.analysis import RankZero

        self.ctx = ctx
        self.backends: dict = {}
        self.rank_zero = RankZero(ctx, self.backend) if ctx.rank == 0 else None

    def backend(self, spec):
        from attn_doctor.backends import build

        if spec.name not in self.backends:
            self.backends[spec.name] = build(spec)
        return self.backends[spec.name]

    def run(self, probe: dict) -> dict | None:
        """Every rank runs this; rank 0 returns the result, the others None."""
        from attn_doctor.core.coords import Coords
        from attn_doctor.core.errors import kernel_code
        from attn_doctor.distributed.shards import run_shard, shard_inputs
        from attn_doctor.numerics.inputs import make_inputs, synchronize

        ctx, torch = self.ctx, self.ctx.torch
        coords = Coords.from_dict(probe)
        spec, case = coords.backend, coords.case

        ctx.compute("building the backend and the inputs")

        def setup():
            from attn_doctor.backends import Unsupported

            with kernel_code(passthrough=(Unsupported,)):  # building a --kernel imports the user's module
                backend = self.backend(spec)
            inputs = make_inputs(case, ctx.device)
            checksum = [float(t.double().sum()) for t in (inputs.q, inputs.k, inputs.v, inputs.dout)]
            return backend, inputs, checksum

        result, status = guarded(setup)
        status["checksum"] = result[2] if result else None
        statuses = ctx.agree("building the inputs", status)
        if len({tuple(s["checksum"]) for s in statuses}) != 1:
            raise Stop([{"status": "error", "reason": f"built different inputs from seed {case.seed} "
                         f"(checksums {s['checksum']})"} for s in statuses])
        backend, inputs, _ = result
        q, k, v, dout = shard_inputs(ctx, case, inputs)

        synchronize(ctx.device)
        start = time.perf_counter()
        tensors, ran, method = run_shard(ctx, backend, case, q, k, v, dout)
        synchronize(ctx.device)
        kernel_s = time.perf_counter() - start

        ctx.collective("gathering the shards on rank 0")
        rans: list = [None] * ctx.world
        ctx.dist.all_gather_object(rans, ran)
        gathered = {}
        for name, tensor in zip(TENSORS, tensors):
            parts = [torch.empty_like(tensor) for _ in range(ctx.world)] if ctx.rank == 0 else None
            ctx.dist.gather(tensor.contiguous(), parts, dst=0)
            gathered[name] = parts
        if self.rank_zero is None:
            return None
        ctx.compute("rank 0: float64 reference, single-process runs, comparison")
        try:
            return self.rank_zero.analyse(backend, case, inputs, gathered, rans, method, kernel_s)
        except Exception as exc:  # noqa: BLE001 - attn-doctor's own failure, never the kernel's
            return {"status": "error", "internal": True,
                    "reason": f"attn-doctor internal error (not the kernel's): rank 0 failed comparing the "
                              f"shards: {first_line(exc)}", "detail": traceback.format_exc(limit=8)}


def stop_result(stop: Stop) -> dict:
    bad = [(r, s) for r, s in enumerate(stop.statuses) if s["status"] != "ok"]
    reasons = {s["reason"] for _, s in bad}
    if len(bad) == len(stop.statuses) and len(reasons) == 1:
        reason = f"every rank: {reasons.pop()}"
    else:
        reason = "; ".join(f"rank {r}: {s['reason']}" for r, s in bad)
    status = "skip" if all(s["status"] == "skip" for _, s in bad) else "error"
    detail = "\n".join(f"--- rank {r} ---\n{s['detail']}" for r, s in bad if s.get("detail"))
    result = {"status": status, "reason": reason, "detail": detail}
    if any(s.get("internal") for _, s in bad):
        result["internal"] = True
    return result


def run(job: dict, progress: Progress) -> int:
    ctx = Context(job, progress)
    prober = Prober(ctx)
    results: list[dict] = []
    for index, probe in enumerate(job["probes"]):
        progress.probe(index)
        try:
            result = prober.run(probe)
        except Stop as stop:
            result = stop_result(stop) if ctx.rank == 0 else None
        if ctx.rank == 0:
            results.append(result)
            write_atomic(Path(job["output"]), json.dumps(results, allow_nan=True))
    progress.stage("finishing", collective=True)
    ctx.dist.barrier()
    ctx.dist.destroy_process_group()
    progress.state["finished"] = True
    progress.stage("finished")
    return 0


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    _redirect_output(job["folder"], rank)
    progress = Progress(job["folder"], rank)
    _watch_parent()
    from attn_doctor.backends import prepare_process

    for family in dict.fromkeys(p["backend"]["family"] for p in job["probes"]):
        prepare_process(family)  # e.g. TE before anything loads torch's cuDNN; failures surface per probe
    from torch.distributed.elastic.multiprocessing.errors import record

    try:
        return record(run)(job, progress)
    except BaseException as exc:
        progress.state["error"] = first_line(exc)
        progress.write()  # keeps "collective": whether it failed waiting on a peer or on its own
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
