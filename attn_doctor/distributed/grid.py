"""The rank grid of a distributed probe, as pure arithmetic the launcher and every rank share.

Ranks form a tp x cp grid, TP fastest (Megatron's order): rank = cp_rank * tp + tp_rank, so a TP group is
`tp` consecutive ranks and a CP group is the ranks tp_rank, tp_rank + tp, ... TP splits the query heads and
the key/value heads into tp equal shards. CP splits the sequence load-balanced as TE expects: 2*cp chunks,
CP rank c holds chunks c and 2*cp-1-c, in that order.
"""

from __future__ import annotations

RANK_LAYOUT = "tp fastest (Megatron order): rank = cp_rank * tp + tp_rank"
CP_SPLIT = "load-balanced: 2*cp sequence chunks, CP rank c holds chunks c and 2*cp-1-c"
PROGRESS_PREFIX = "progress."
TENSORS = ("out", "dq", "dk", "dv")


def grid_position(rank: int, tp: int) -> tuple[int, int]:
    """(tp_rank, cp_rank) of a global rank; TP is the fastest-varying dimension."""
    return rank % tp, rank // tp


def tp_group_ranks(tp: int, cp: int) -> list[list[int]]:
    return [[c * tp + t for t in range(tp)] for c in range(cp)]


def cp_group_ranks(tp: int, cp: int) -> list[list[int]]:
    return [[c * tp + t for c in range(cp)] for t in range(tp)]


def cp_chunks(cp: int, cp_rank: int) -> tuple[int, int]:
    """The two of 2*cp sequence chunks CP rank `cp_rank` holds (TE's load-balanced causal split)."""
    return cp_rank, 2 * cp - 1 - cp_rank


def cp_positions(seq: int, cp: int, cp_rank: int) -> list[int]:
    """Global sequence positions of CP rank `cp_rank`'s tokens, in the order the rank holds them."""
    chunk = seq // (2 * cp)
    first, second = cp_chunks(cp, cp_rank)
    return list(range(first * chunk, (first + 1) * chunk)) + list(range(second * chunk, (second + 1) * chunk))


def parallel_label(tp: int, cp: int, cp_comm_type: str | None, nproc: int) -> str:
    parts = ([f"TP {tp}"] if tp > 1 else []) + ([f"CP {cp_comm_type}"] if cp > 1 else [])
    ranks = f"{nproc} rank{'s' if nproc > 1 else ''}"
    return f"{' + '.join(parts)}, {ranks}" if parts else ranks
