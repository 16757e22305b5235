"""Where a rank of the fault-tolerant communicator sits: its place in the grid (fixed for the
process's life) and its place in the current DP communicator (which changes with every recovery
and re-join). Read-only views for :class:`.comm.FaultTolerantComm`, which owns ``coords`` and the
DP communicator."""

from __future__ import annotations

from typing import Any

from .topology import RankCoords


class GridPosition:
    coords: RankCoords
    _dp_comm: Any  # MPI.Comm of the current world (None on a parked rank)

    @property
    def rank(self) -> int:
        """This process's logical rank: its place in the grid (never changes)."""
        return self.coords.rank

    @property
    def replica(self) -> int:
        return self.coords.replica

    @property
    def local_rank(self) -> int:
        return self.coords.local_rank

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        """Rank in the current DP communicator (position of this replica among the alive ones)."""
        return self._dp_comm.Get_rank()

    @property
    def dp_size(self) -> int:
        """Members of the current DP communicator (= number of alive replicas)."""
        return self._dp_comm.Get_size()
