"""Real tensor and context parallelism: a probe on tp x cp ranks launched with torchrun.

`launch` starts the ranks and reads back what rank 0 measured (`outcome`); `rank` is the program every
rank runs, `grid` the rank arithmetic they share, `shards` how a rank computes its shard, `collectives`
the CP reshuffles, `analysis` rank 0's comparison.
"""

from attn_doctor.distributed.grid import cp_chunks, cp_group_ranks, cp_positions, grid_position, tp_group_ranks
from attn_doctor.distributed.launch import check_launchable, launch, launch_many
from attn_doctor.distributed.outcome import DistributedOutcome, RankShard, baseline_row, judged_rows, to_row

__all__ = ["DistributedOutcome", "RankShard", "baseline_row", "check_launchable", "cp_chunks", "cp_group_ranks",
           "cp_positions", "grid_position", "judged_rows", "launch", "launch_many", "to_row", "tp_group_ranks"]
