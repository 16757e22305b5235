"""The store gate (``ft/gate.py``) in gloo worlds of 3 processes over a real TCPStore: every rank
passes when all arrive, and a rank that never arrives makes the others fail at the timeout, naming
it -- the gate a replica passes on NCCL, where no monitored barrier exists."""

from __future__ import annotations

import torch.distributed as dist

from nanotron_recover.ft.gate import GateTimeout, StoreGate
from tests.helpers.gloo_world import run_world

TIMEOUT_S = 1.0


def _store(rank: int, world_size: int) -> dist.TCPStore:
    """A TCPStore hosted by rank 0, its port shared over the gloo world (as a replica's store is
    shared over MPI)."""
    store = None
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port[0], world_size, is_master=False)
    return store


def _gates_with_one_absent(rank: int, world_size: int, absent: int | None, gates: int) -> dict:
    """Pass ``gates`` gates; at the last one rank ``absent`` does not arrive. What each rank saw."""
    store = _store(rank, world_size)
    gate = StoreGate(store, rank, world_size)
    seen: dict = {"passed": 0, "missing": None, "timeout_s": None}
    for n in range(1, gates + 1):
        if n == gates and rank == absent:
            break
        try:
            gate(TIMEOUT_S)
            seen["passed"] = n
        except GateTimeout as e:
            seen["missing"], seen["timeout_s"], seen["message"] = e.missing, e.timeout_s, str(e)
            break
    dist.barrier()  # everyone is done with the gates before the keys are read
    seen["keys"] = {
        (n, r): store.check([gate.key(n, r)]) for n in range(1, gates + 1) for r in range(world_size)
    }
    dist.barrier()  # the store's host stays until every rank has read
    return seen


def test_every_rank_passes_and_only_the_last_gate_keeps_keys(tmp_path):
    seen = run_world(_gates_with_one_absent, 3, tmp_path, args=(None, 4))
    assert [s["passed"] for s in seen] == [4, 4, 4]
    assert [s["missing"] for s in seen] == [None, None, None]
    keys = seen[0]["keys"]
    assert [keys[(n, r)] for n in (1, 2, 3) for r in range(3)] == [False] * 9
    assert [keys[(4, r)] for r in range(3)] == [True] * 3


def test_a_rank_that_never_arrives_is_named_by_the_others(tmp_path):
    seen = run_world(_gates_with_one_absent, 3, tmp_path, args=(2, 3))
    assert [s["passed"] for s in seen] == [2, 2, 2]
    assert [s["missing"] for s in seen[:2]] == [[2], [2]]
    assert [s["timeout_s"] for s in seen[:2]] == [TIMEOUT_S, TIMEOUT_S]
    assert seen[0]["message"] == "gate 3 timed out after 1s: rank(s) [2] of the replica did not arrive"
    assert seen[2]["missing"] is None  # the absent rank never waited


def test_the_store_host_not_arriving_is_named_too(tmp_path):
    # Rank 0 hosts the store: it serves the others' keys even while it does not come to the gate.
    seen = run_world(_gates_with_one_absent, 3, tmp_path, args=(0, 1))
    assert [s["missing"] for s in seen[1:]] == [[0], [0]]
    assert [s["passed"] for s in seen] == [0, 0, 0]
