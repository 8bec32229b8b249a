"""What a rank of a distributed probe knows and how the ranks stay together.

`Context`: the rank grid, its real process groups (every TP and every CP group, from new_group) and its
device. `Progress`: the rank's progress file (stage, probe, whether it is waiting in a collective, its
error), replaced atomically at every stage, which is how the launcher names a rank that hangs or dies.
`agree`: backend work that raises is caught (`guarded`) and shared with all ranks at an agreement point
(all_gather_object), so every rank leaves a failing probe together and the outcome names the failing rank.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path

from attn_doctor.core.errors import KernelError, first_line
from attn_doctor.distributed.grid import PROGRESS_PREFIX, cp_group_ranks, cp_positions, grid_position, tp_group_ranks


class Progress:
    """This rank's progress file, replaced atomically at every stage."""

    def __init__(self, folder: str, rank: int):
        self.path = Path(folder) / f"{PROGRESS_PREFIX}{rank}.json"
        self.state = {"rank": rank, "pid": os.getpid(), "stage": "starting", "probe": -1, "probe_t0": None,
                      "collective": False, "error": None, "finished": False, "t": time.time()}
        self.write()

    def write(self) -> None:
        self.state["t"] = time.time()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.path)

    def stage(self, stage: str, collective: bool = False) -> None:
        self.state.update(stage=stage, collective=collective)
        self.write()

    def probe(self, index: int) -> None:
        self.state.update(probe=index, probe_t0=time.time(), stage="starting the probe", collective=False)
        self.write()


class Stop(Exception):
    """Some rank could not do its part of a probe; every rank leaves the probe (statuses of all ranks)."""

    def __init__(self, statuses: list[dict]):
        super().__init__("; ".join(f"rank {r}: {s['reason']}" for r, s in enumerate(statuses) if s["status"] != "ok"))
        self.statuses = statuses


class Context:
    """The rank grid, its process groups and device, as this rank sees them."""

    def __init__(self, job: dict, progress: Progress):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.job, self.progress = job, progress
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.tp, self.cp = job["tp"], job["cp"]
        self.comm = job["cp_comm_type"]
        if self.world != self.tp * self.cp:
            raise RuntimeError(f"WORLD_SIZE {self.world} != tp {self.tp} x cp {self.cp}")
        self.tp_rank, self.cp_rank = grid_position(self.rank, self.tp)
        device_name = job["device"]
        if device_name.startswith("cuda"):
            if self.local_rank >= torch.cuda.device_count():
                raise RuntimeError(f"rank {self.rank}: LOCAL_RANK {self.local_rank} but torch sees "
                                   f"{torch.cuda.device_count()} CUDA device(s)")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        import datetime

        progress.stage(f"init_process_group ({backend})", collective=True)
        # The parent enforces --timeout; the process group's own timeout only backs it up.
        timeout = datetime.timedelta(seconds=max(600.0, 4 * float(job["timeout_s"])))
        dist.init_process_group(backend=backend, timeout=timeout)
        progress.stage("creating the TP and CP groups", collective=True)
        self.tp_group = self.cp_group = None
        self.tp_ranks = self.cp_ranks = [self.rank]
        for ranks in tp_group_ranks(self.tp, self.cp):  # every rank creates every group, in one order
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.tp_group, self.tp_ranks = group, ranks
        for ranks in cp_group_ranks(self.tp, self.cp):
            group = dist.new_group(ranks)
            if self.rank in ranks:
                self.cp_group, self.cp_ranks = group, ranks
        self._positions: dict[tuple[int, int], object] = {}

    # -- agreement and collectives ---------------------------------------------------------------

    def agree(self, what: str, status: dict) -> list[dict]:
        """Share every rank's status; raise Stop on every rank if any rank's is not ok."""
        self.progress.stage(f"the agreement after {what}", collective=True)
        statuses: list = [None] * self.world
        self.dist.all_gather_object(statuses, status)
        if any(s["status"] != "ok" for s in statuses):
            raise Stop(statuses)
        return statuses

    def positions(self, seq: int, cp_rank: int):
        key = (seq, cp_rank)
        if key not in self._positions:
            self._positions[key] = self.torch.tensor(cp_positions(seq, self.cp, cp_rank), device=self.device)
        return self._positions[key]

    def collective(self, what: str) -> None:
        self.progress.stage(what, collective=True)

    def compute(self, what: str) -> None:
        self.progress.stage(what, collective=False)


INTERNAL = "attn-doctor internal error (not the kernel's)"


def guarded(fn):
    """(result, status): the work may raise; the status says how, for the agreement. What the kernel raised
    (marked by `kernel_code` in the work) names the kernel; anything else is attn-doctor's and says so."""
    from attn_doctor.backends import Unsupported

    try:
        return fn(), {"status": "ok", "reason": ""}
    except Unsupported as exc:
        return None, {"status": "skip", "reason": str(exc)}
    except KernelError as exc:  # a kernel's failure on one rank becomes that rank's error
        return None, {"status": "error", "reason": str(exc),
                      "detail": "".join(traceback.format_exception(exc.cause, limit=8))}
    except Exception as exc:  # noqa: BLE001 - reported, never blamed on the kernel
        return None, {"status": "error", "reason": f"{INTERNAL}: {first_line(exc)}", "internal": True,
                      "detail": traceback.format_exc(limit=8)}
