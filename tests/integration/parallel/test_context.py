"""ParallelContext: every rank's coordinates and process groups for each (tp, pp, dp) layout.

The context turns a rank number into tensor/pipeline/data-parallel coordinates and process groups;
the fault-tolerant layer derives its replicas and DP groups, without communication, in
``ft/topology.py``. Both are built on the one rank layout of ``parallel/layout.py`` (tp fastest, a
replica is a contiguous block of ranks). If the groups the context builds disagreed with
``Topology``, a rank would reduce its gradient shard with the wrong DP peers. So the expectations
here come from ``Topology``, never from ``context.py`` itself.

Real gloo worlds of 1, 2 and 4 ranks build every layout whose size fits: (tp, pp) in (1,1), (2,1),
(1,2), (2,2), with the remaining factor as dp. Group membership is observed through a collective
(an all-gather of global ranks inside each group), so a group that merely lists the right ranks but
connects the wrong processes would fail too. The pure mapping functions are also checked against
``Topology`` exhaustively, in the test process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nanotron_recover.ft.topology import Topology
from nanotron_recover.parallel.context import ParallelContext, grid_coordinates, grid_rank
from tests.helpers.gloo_world import run_world

# (tp, pp, dp) layouts per world size: every (tp, pp) in {1, 2}^2 whose product divides the world.
LAYOUTS = {
    1: [(1, 1, 1)],
    2: [(1, 1, 2), (2, 1, 1), (1, 2, 1)],
    4: [(1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1)],
}
GROUPS = ("tp_group", "pp_group", "dp_group", "mp_group", "tied_group")


def _members(group: dist.ProcessGroup | None) -> list[int] | None:
    """Global ranks of ``group`` in group-rank order, as seen through an all-gather over it."""
    if group is None:
        return None
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, torch.tensor([dist.get_rank()]), group=group)
    return [int(t.item()) for t in gathered]


def _context_worker(rank: int, world_size: int, layouts: list[tuple[int, int, int]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for tp, pp, dp in layouts:
        ctx = ParallelContext.create(tp, pp, dp, torch.device("cpu"))
        info: dict[str, Any] = {
            "rank": ctx.rank,
            "coords": (ctx.dp_rank, ctx.pp_rank, ctx.tp_rank),
            "first": ctx.is_first_stage,
            "last": ctx.is_last_stage,
            "pp_global_ranks": list(ctx.pp_global_ranks),
            "last_stage_rank": ctx.last_stage_rank,
            "prev": None if ctx.is_first_stage else ctx.prev_rank,
            "next": None if ctx.is_last_stage else ctx.next_rank,
            # The layers shard by the rank inside the group: it must be the coordinate.
            "tp_group_rank": dist.get_rank(ctx.tp_group),
            "pp_group_rank": dist.get_rank(ctx.pp_group),
        }
        for name in GROUPS:
            info[name] = _members(getattr(ctx, name))
        seen[f"{tp},{pp},{dp}"] = info
    # A layout that does not cover the world is refused before any group is made.
    try:
        ParallelContext.create(world_size + 1, 1, 1, torch.device("cpu"))
    except ValueError as e:
        seen["mismatch"] = str(e)
    return seen


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """What every rank of a world of each size saw, built once (one world per size)."""
    root = tmp_path_factory.mktemp("context")
    return {n: run_world(_context_worker, n, root, args=(LAYOUTS[n],)) for n in sorted(LAYOUTS)}


def _expected(topo: Topology, rank: int) -> dict[str, Any]:
    c = topo.coords(rank)
    pipeline = [topo.rank_of(c.replica, p, c.tp) for p in range(topo.pp)]
    return {
        "rank": rank,
        "coords": (c.replica, c.pp, c.tp),
        "first": c.pp == 0,
        "last": c.pp == topo.pp - 1,
        "pp_global_ranks": pipeline,
        "last_stage_rank": pipeline[-1],
        "prev": None if c.pp == 0 else topo.rank_of(c.replica, c.pp - 1, c.tp),
        "next": None if c.pp == topo.pp - 1 else topo.rank_of(c.replica, c.pp + 1, c.tp),
        "tp_group_rank": c.tp,
        "pp_group_rank": c.pp,
        "tp_group": [topo.rank_of(c.replica, c.pp, t) for t in range(topo.tp)],
        "pp_group": pipeline,
        "dp_group": topo.dp_group_ranks(c.pp, c.tp),
        "mp_group": topo.ranks_of_replica(c.replica),
        "tied_group": None if topo.pp == 1 else [pipeline[0], pipeline[-1]],
    }


CASES = [(n, layout) for n, layouts in sorted(LAYOUTS.items()) for layout in layouts]


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("world_size", "layout"), CASES, ids=[f"w{n}-tp{t}pp{p}dp{d}" for n, (t, p, d) in CASES]
)
def test_context_agrees_with_topology(
    observed: dict[int, list[dict[str, Any]]], world_size: int, layout: tuple[int, int, int]
) -> None:
    tp, pp, dp = layout
    topo = Topology(tp=tp, pp=pp, n_replicas=dp)
    assert topo.world_size == world_size
    for rank, seen in enumerate(observed[world_size]):
        assert seen[f"{tp},{pp},{dp}"] == _expected(topo, rank), f"rank {rank}"


@pytest.mark.mpi
def test_context_tp_groups_share_the_stage_and_pp_groups_stride_by_tp(
    observed: dict[int, list[dict[str, Any]]],
) -> None:
    # Spelled out for the 2x2 grid, independently of Topology: tp peers are neighbours.
    seen = observed[4]
    assert [s["2,2,1"]["tp_group"] for s in seen] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [s["2,2,1"]["pp_group"] for s in seen] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [(s["2,2,1"]["first"], s["2,2,1"]["last"]) for s in seen] == [(True, False)] * 2 + [
        (False, True)
    ] * 2
    assert [s["2,1,2"]["dp_group"] for s in seen] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [s["1,2,2"]["mp_group"] for s in seen] == [[0, 1], [0, 1], [2, 3], [2, 3]]


@pytest.mark.mpi
def test_context_refuses_a_layout_that_does_not_fill_the_world(
    observed: dict[int, list[dict[str, Any]]],
) -> None:
    for n, ranks in observed.items():
        for seen in ranks:
            assert seen.get("mismatch") == f"world size {n} != tp*pp*dp = {n + 1}*1*1"


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("dp", [1, 3])
def test_grid_mapping_is_topology_mapping(tp: int, pp: int, dp: int) -> None:
    topo = Topology(tp=tp, pp=pp, n_replicas=dp)
    for rank in range(topo.world_size):
        c = topo.coords(rank)
        assert grid_coordinates(rank, tp, pp) == (c.replica, c.pp, c.tp)
        assert grid_rank(c.replica, c.pp, c.tp, tp, pp) == rank == topo.rank_of(c.replica, c.pp, c.tp)


@pytest.mark.mpi
def test_gloo_world_reports_a_failing_rank_with_its_traceback(tmp_path: Path) -> None:
    # The world runner itself: a rank that raises fails the test with its traceback, promptly.
    with pytest.raises(pytest.fail.Exception, match="rank 1 is broken"):
        run_world(_failing_worker, 2, tmp_path, timeout_s=30)


def _failing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 is broken")
    dist.barrier()  # rank 0 waits for a peer that never comes; the harness must kill it
