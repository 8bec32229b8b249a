"""Rank 0's part of a distributed probe: reassemble the gathered shards, and measure the whole tensors and
every rank's own shard against float64, against a single-process run of the same backend on the full
tensors and against the local baseline's (the float64 reference and the baseline run are computed once per
case and kept for its other backends)."""

from __future__ import annotations

import time
from collections.abc import Callable

from attn_doctor.backends import BASELINE, Backend, Unsupported
from attn_doctor.core.case import Case
from attn_doctor.core.errors import first_line
from attn_doctor.distributed.context import Context
from attn_doctor.distributed.grid import TENSORS, grid_position, parallel_label
from attn_doctor.numerics import views
from attn_doctor.numerics.inputs import Inputs, synchronize
from attn_doctor.numerics.metrics import compare, relative_distance
from attn_doctor.numerics.reference import Reference, attention_reference


def single_process_run(ctx: Context, backend: Backend, case: Case, inputs: Inputs) -> list:
    """The backend on the full tensors in this one process (contiguous, its own format): bshd out, dq, dk, dv."""
    fmt = backend.format_for(case)
    leaves = [views.to_format(t, fmt).contiguous().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    out = backend.forward(*leaves, case)
    grads = ctx.torch.autograd.grad(out, leaves, views.to_format(inputs.dout, fmt).contiguous())
    return [views.to_bshd(t.detach(), fmt) for t in (out, *grads)]


class RankZero:
    def __init__(self, ctx: Context, backend_of: Callable):
        self.ctx = ctx
        self.backend_of = backend_of  # spec -> the backend built in this process
        self._case_key: tuple | None = None  # the case whose reference and baseline run are kept
        self._case_runs: tuple[Reference, float, dict | None, dict, float] | None = None

    def analyse(self, backend: Backend, case: Case, inputs: Inputs, gathered: dict, rans: list[str],
                method: str | None, kernel_s: float) -> dict:
        ctx, torch = self.ctx, self.ctx.torch
        hq, hkv = case.heads // ctx.tp, case.kv_heads // ctx.tp

        def shard_index(name: str, rank: int):
            t, c = grid_position(rank, ctx.tp)
            heads = hq if name in ("out", "dq") else hkv
            pos = ctx.positions(case.seq, c) if ctx.cp > 1 else slice(None)
            return pos, slice(t * heads, (t + 1) * heads)

        def cut(tensor, name: str, rank: int):
            pos, heads = shard_index(name, rank)
            return tensor[:, pos, heads]

        full = {}
        for name, parts in gathered.items():
            like = inputs.q if name in ("out", "dq") else inputs.k
            whole = torch.empty_like(like)
            for rank, part in enumerate(parts):
                pos, heads = shard_index(name, rank)
                whole[:, pos, heads] = part
            full[name] = whole

        reference, reference_s, baseline, notes, baseline_s = self._reference_and_baseline(case, inputs)
        start = time.perf_counter()
        single, single_notes = self._single_run(backend, case, inputs, "single")
        notes = {**single_notes, **notes}
        synchronize(ctx.device)
        single_s = baseline_s + time.perf_counter() - start

        start = time.perf_counter()
        exact = reference.tensors()

        def measure(tensors: dict, rank: int | None = None) -> dict:
            """Each tensor (or rank's shard of it) against float64, with the reference's term magnitudes."""
            def part(t, n):
                return t if rank is None else cut(t, n, rank)
            return {n: compare(tensors[n], part(exact[n], n), part(reference.terms(n), n)).to_dict() for n in TENSORS}

        result = {
            "status": "ok",
            "ran": self.ran_label(rans),
            "metrics": measure(full),
            "single_metrics": measure(single) if single else {},
            "baseline_metrics": measure(baseline) if baseline else {},
            "vs_single": {n: relative_distance(full[n], single[n]) for n in TENSORS} if single else {},
            "bitwise_single": {n: bool(torch.equal(full[n], single[n])) for n in TENSORS} if single else {},
            "ranks": [],
            "extra": {"cp_method": method, **notes} if method else dict(notes),
        }
        for rank in range(ctx.world):
            t, c = grid_position(rank, ctx.tp)
            entry = {"rank": rank, "tp_rank": t, "cp_rank": c, "ran": rans[rank],
                     "metrics": measure({n: gathered[n][rank] for n in TENSORS}, rank)}
            if baseline:
                entry["baseline_metrics"] = measure({n: cut(baseline[n], n, rank) for n in TENSORS}, rank)
            if single:
                entry["vs_single"] = {n: relative_distance(gathered[n][rank], cut(single[n], n, rank)) for n in TENSORS}
            result["ranks"].append(entry)
        result["seconds"] = {"kernel": kernel_s, "reference": reference_s, "single-process runs": single_s,
                             "compare": time.perf_counter() - start}
        return result

    def _reference_and_baseline(self, case: Case, inputs: Inputs) -> tuple[Reference, float, dict | None, dict, float]:
        """The float64 reference and the local baseline's single-process run of `case`, with their seconds."""
        if self._case_key != case.key():
            self._case_runs = None  # free the previous case first
            start = time.perf_counter()
            reference = attention_reference(inputs.q, inputs.k, inputs.v, inputs.dout, softmax_scale=case.softmax_scale,
                                            semantics=inputs.semantics)
            synchronize(self.ctx.device)
            reference_s = time.perf_counter() - start
            start = time.perf_counter()
            baseline, notes = self._single_run(self.backend_of(BASELINE), case, inputs, "baseline")
            synchronize(self.ctx.device)
            self._case_key = case.key()
            self._case_runs = (reference, reference_s, baseline, notes, time.perf_counter() - start)
        return self._case_runs

    def _single_run(self, backend: Backend, case: Case, inputs: Inputs, label: str) -> tuple[dict | None, dict]:
        """`backend` on the full tensors in this one process, or None with the note saying why not."""
        try:
            return dict(zip(TENSORS, single_process_run(self.ctx, backend, case, inputs))), {}
        except Unsupported as exc:
            return None, {f"{label}_skipped": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported beside the distributed result
            return None, {f"{label}_error": first_line(exc)}

    def ran_label(self, rans: list[str]) -> str:
        ctx = self.ctx
        what = rans[0] if len(set(rans)) == 1 else "; ".join(f"rank {r}: {x}" for r, x in enumerate(rans))
        return f"{what} + {parallel_label(ctx.tp, ctx.cp, ctx.comm, ctx.world)}"
