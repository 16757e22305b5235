"""The static rank <-> (replica, pp, tp) mapping (docs/architecture.md, "Topology"; tp fastest)."""

from __future__ import annotations

import itertools

import pytest

from nanotron_recover.ft.topology import RankCoords, Topology


def test_mapping_tp_fastest() -> None:
    topo = Topology(tp=2, pp=3, n_replicas=2)
    assert topo.replica_size == 6 and topo.world_size == 12
    # Rank 7: replica 1, local rank 1 -> pp 0, tp 1.  Rank 10: replica 1, local 4 -> pp 2, tp 0.
    assert topo.coords(7) == RankCoords(rank=7, replica=1, local_rank=1, pp=0, tp=1)
    assert topo.coords(10) == RankCoords(rank=10, replica=1, local_rank=4, pp=2, tp=0)
    assert [topo.coords(r).tp for r in range(6)] == [0, 1, 0, 1, 0, 1]
    assert [topo.coords(r).pp for r in range(6)] == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize(("tp", "pp", "w"), [(1, 1, 1), (2, 1, 4), (1, 2, 3), (2, 2, 2), (4, 2, 3)])
def test_roundtrip_and_formula(tp: int, pp: int, w: int) -> None:
    topo = Topology(tp=tp, pp=pp, n_replicas=w)
    seen = set()
    for r in range(topo.world_size):
        c = topo.coords(r)
        assert c.replica == r // (tp * pp)
        assert c.local_rank == r % (tp * pp)
        assert (c.pp, c.tp) == (c.local_rank // tp, c.local_rank % tp)
        assert topo.rank_of(c.replica, c.pp, c.tp) == r
        assert topo.local_rank(c.pp, c.tp) == c.local_rank
        assert topo.replica_of(r) == c.replica and topo.local_rank_of(r) == c.local_rank
        seen.add((c.replica, c.pp, c.tp))
    assert seen == set(itertools.product(range(w), range(pp), range(tp)))


def test_groups() -> None:
    topo = Topology(tp=2, pp=2, n_replicas=3)
    assert topo.ranks_of_replica(1) == [4, 5, 6, 7]
    assert topo.dp_group_ranks(1, 0) == [2, 6, 10]
    assert topo.dp_group_ranks(1, 1, replicas=[2, 0]) == [3, 11]
    assert topo.replicas_of([5, 4, 11]) == [1, 2]
    # A replica missing any rank is not complete (i.e. it failed).
    alive = [r for r in range(12) if r not in (5, 8)]
    assert topo.complete_replicas(alive) == [0]
    assert topo.complete_replicas(range(12)) == [0, 1, 2]


def test_validation() -> None:
    with pytest.raises(ValueError):
        Topology(tp=0, pp=1, n_replicas=1)
    with pytest.raises(ValueError):
        Topology(tp=1, pp=1, n_replicas=-2)
    topo = Topology(tp=2, pp=1, n_replicas=2)
    for bad in (-1, 4):
        with pytest.raises(ValueError):
            topo.coords(bad)
    with pytest.raises(ValueError):
        topo.rank_of(2, 0, 0)
    with pytest.raises(ValueError):
        topo.rank_of(0, 1, 0)
    with pytest.raises(ValueError):
        topo.ranks_of_replica(5)
