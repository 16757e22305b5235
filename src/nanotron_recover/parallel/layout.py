"""The rank layout: where rank ``r`` of a ``dp * pp * tp`` job sits in the 3D grid.

This is the only place the layout is written down (docs/architecture.md, "Topology"); both
``ParallelContext`` (the torch process groups) and ``ft.topology.Topology`` (the fault-tolerant
layer's replicas and DP communicators) are built on these two functions, so they cannot disagree
on which ranks are DP, PP or TP peers. Pure arithmetic: no torch, no MPI.

1. ``dp = rank // (tp * pp)`` -- a replica (one DP rank) is a contiguous block of ranks, which keeps
   one replica's torch.distributed world on as few nodes as possible.
2. ``local = rank % (tp * pp)`` -- the rank inside the replica.
3. ``pp = local // tp`` and ``tp = local % tp`` -- TP is the fastest moving coordinate, so TP peers
   (the most communication-heavy group) are neighbours, and a pipeline group strides by ``tp``.
"""

from __future__ import annotations


def grid_coordinates(rank: int, tp: int, pp: int) -> tuple[int, int, int]:
    """``(dp, pp, tp)`` coordinates of ``rank`` in a grid of ``tp * pp`` ranks per replica."""
    return rank // (tp * pp), (rank % (tp * pp)) // tp, rank % tp


def grid_rank(dp_rank: int, pp_rank: int, tp_rank: int, tp: int, pp: int) -> int:
    """The rank at coordinates ``(dp_rank, pp_rank, tp_rank)``; the inverse of :func:`grid_coordinates`."""
    return dp_rank * tp * pp + pp_rank * tp + tp_rank
