"""The fault-tolerant layer's view of the rank layout: replicas, local ranks and DP groups.

The job is launched as ``W_init * PP * TP`` MPI ranks (docs/architecture.md, "Topology"), laid out
as in :mod:`nanotron_recover.parallel.layout` (the single definition): replica ``r // (TP * PP)``,
local rank ``r % (TP * PP)``, then ``(pp, tp)`` with TP fastest. The mapping is fixed for the
lifetime of the job and never depends on which ranks are still alive, so any rank can compute any
other rank's coordinates (and the failed replicas from a set of failed ranks) without communication.

The DP group of coordinate ``(pp, tp)`` is the set of ranks with that local rank
across the alive replicas; its members are ordered by replica id.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..parallel.layout import grid_coordinates, grid_rank


@dataclass(frozen=True)
class RankCoords:
    """Where one MPI rank sits in the 3D grid."""

    rank: int
    replica: int
    local_rank: int
    pp: int
    tp: int


@dataclass(frozen=True)
class Topology:
    """The static grid: ``n_replicas`` replicas of ``pp * tp`` ranks each."""

    tp: int
    pp: int
    n_replicas: int

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "n_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def replica_size(self) -> int:
        """Ranks per replica (``TP * PP``)."""
        return self.tp * self.pp

    @property
    def world_size(self) -> int:
        """Ranks in the initial job (``W_init * TP * PP``)."""
        return self.n_replicas * self.replica_size

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")

    def replica_of(self, rank: int) -> int:
        return self.coords(rank).replica

    def local_rank_of(self, rank: int) -> int:
        return self.coords(rank).local_rank

    def coords(self, rank: int) -> RankCoords:
        """The (replica, local rank, pp, tp) of an initial MPI rank."""
        self._check_rank(rank)
        replica, pp, tp = grid_coordinates(rank, self.tp, self.pp)
        return RankCoords(rank=rank, replica=replica, local_rank=self.local_rank(pp, tp), pp=pp, tp=tp)

    def local_rank(self, pp: int, tp: int) -> int:
        """Local rank of coordinate ``(pp, tp)`` inside any replica."""
        return self.rank_of(0, pp, tp)

    def rank_of(self, replica: int, pp: int, tp: int) -> int:
        """Initial MPI rank of ``(replica, pp, tp)``."""
        if not 0 <= replica < self.n_replicas:
            raise ValueError(f"replica {replica} outside [0, {self.n_replicas})")
        if not (0 <= pp < self.pp and 0 <= tp < self.tp):
            raise ValueError(f"(pp={pp}, tp={tp}) outside grid pp={self.pp} tp={self.tp}")
        return grid_rank(replica, pp, tp, self.tp, self.pp)

    def ranks_of_replica(self, replica: int) -> list[int]:
        """All initial MPI ranks of one replica, in local-rank order."""
        return [self.rank_of(replica, p, t) for p in range(self.pp) for t in range(self.tp)]

    def dp_group_ranks(self, pp: int, tp: int, replicas: Iterable[int] | None = None) -> list[int]:
        """Initial ranks of the DP group of ``(pp, tp)`` over ``replicas`` (default: all), by replica id."""
        chosen = range(self.n_replicas) if replicas is None else sorted(set(replicas))
        return [self.rank_of(r, pp, tp) for r in chosen]

    def replicas_of(self, ranks: Iterable[int]) -> list[int]:
        """Sorted distinct replicas that contain any of ``ranks``."""
        return sorted({self.replica_of(r) for r in ranks})

    def complete_replicas(self, ranks: Iterable[int]) -> list[int]:
        """Sorted replicas all of whose ranks are in ``ranks`` (a replica missing any rank is failed)."""
        present = set(ranks)
        return [
            rep for rep in range(self.n_replicas) if all(r in present for r in self.ranks_of_replica(rep))
        ]
