"""Point-to-point transfers between pipeline stages in a tp=2, pp=2 gloo world of four ranks.

The pipeline engines rely on three properties of ``P2P`` that a whole training run would only show
as a hang or a wrong loss:

- peers: with tp=2 a stage's neighbour is ``tp`` ranks away (rank 0 talks to rank 2, rank 1 to
  rank 3), never the tensor-parallel peer;
- order: each direction between two ranks is one ordered channel, the k-th receive gets the k-th
  send (tensors are tagged with the sender and their index);
- no deadlock: sends do not block, so both stages can send a whole series before either receives
  (as 1F1B does in its steady state); with blocking sends this world would hang until the
  collective timeout, and the test would fail.

Also: a non-contiguous tensor and one that requires grad arrive as plain values, receive buffers
have the declared shape and dtype, and ``wait_all`` leaves nothing pending.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nanotron_recover.parallel.context import ParallelContext
from nanotron_recover.parallel.pipeline_parallel.p2p import P2P
from tests.helpers.gloo_world import run_world

pytestmark = pytest.mark.mpi

TP, PP = 2, 2
SHAPE = (2, 3)
SERIES = 4


def _payload(sender: int, k: int) -> torch.Tensor:
    """The k-th tensor ``sender`` sends; its values name both."""
    return torch.arange(6, dtype=torch.float32).view(SHAPE) + 100 * sender + 10 * k


def _as_sent(sender: int, k: int) -> torch.Tensor:
    t = _payload(sender, k)
    if k == 1:
        return t.t().contiguous().t()  # same values, transposed strides
    if k == 2:
        return (t.clone().requires_grad_() * 1.0).clone()  # part of an autograd graph
    return t


def _p2p_worker(rank: int, world_size: int) -> dict[str, Any]:
    ctx = ParallelContext.create(TP, PP, 1, torch.device("cpu"))
    p2p = P2P(ctx, SHAPE, torch.float32)
    received = []
    if ctx.is_first_stage:
        for k in range(SERIES):
            p2p.send_forward(_as_sent(rank, k))
        received = [p2p.recv_backward() for _ in range(SERIES)]
    else:
        for k in range(SERIES):
            p2p.send_backward(_as_sent(rank, k))
        received = [p2p.recv_forward() for _ in range(SERIES)]
    pending = len(p2p._pending)
    p2p.wait_all()
    return {
        "received": received,
        "pending_before_wait": pending,
        "pending_after_wait": len(p2p._pending),
        "peer": ctx.next_rank if ctx.is_first_stage else ctx.prev_rank,
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_world(_p2p_worker, TP * PP, tmp_path_factory.mktemp("p2p"))


def test_neighbours_are_tp_ranks_apart(ranks: list[dict[str, Any]]) -> None:
    assert [r["peer"] for r in ranks] == [2, 3, 0, 1]


def test_each_channel_delivers_in_order_without_deadlock(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(ranks):
        peer = r["peer"]
        assert len(r["received"]) == SERIES
        for k, got in enumerate(r["received"]):
            assert got.shape == SHAPE and got.dtype == torch.float32 and not got.requires_grad
            assert torch.equal(got, _payload(peer, k)), f"rank {rank} receive {k}: {got}"


def test_sends_are_pending_until_waited(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["pending_before_wait"] == SERIES
        assert r["pending_after_wait"] == 0
