"""BucketedReduction: snapshots, epoch tags and restore after a torn reduction (single process,
with an in-memory stand-in for the DP communicator that can fail mid-reduction)."""

from __future__ import annotations

import pytest
import torch

from nanotron_recover.recovery import BucketedReduction


class WorldChangedStub(Exception):
    pass


class FakeDP:
    """Sums with fixed peer contributions; fails once before bucket ``fail_at`` completes, after
    tearing it (writing garbage), the way a failed in-place allreduce leaves a buffer."""

    def __init__(self, peers: list[torch.Tensor], fail_at: int | None = None):
        self.peers, self.fail_at, self.epoch, self.calls = peers, fail_at, 0, 0
        self.offsets: dict[int, int] = {}

    def allreduce_(self, buf: torch.Tensor, epoch: int) -> None:
        assert epoch == self.epoch, "reduction tagged with a stale epoch"
        start = self.offsets[buf.data_ptr()]
        if self.fail_at is not None and self.calls == self.fail_at:
            self.fail_at = None
            buf.fill_(1e9)  # torn
            self.epoch += 1
            self.peers = self.peers[:-1]  # one peer died
            raise WorldChangedStub()
        self.calls += 1
        for p in self.peers:
            buf += p[start : start + buf.numel()]


def make(n: int = 10, bucket: int = 3, fail_at: int | None = None):
    local = torch.arange(n, dtype=torch.float32)
    peers = [torch.full((n,), 100.0), torch.full((n,), 1000.0)]
    red = BucketedReduction([local], bucket)
    comm = FakeDP(peers, fail_at)
    comm.offsets = {b.view.data_ptr(): i * bucket for i, b in enumerate(red.buckets)}
    return local, red, comm


def test_buckets_cover_the_buffer_in_order():
    local, red, _ = make(10, 3)
    assert [b.view.numel() for b in red.buckets] == [3, 3, 3, 1]
    assert torch.equal(torch.cat([b.view for b in red.buckets]), local)


def test_reduce_without_failure_sums_and_tags():
    local, red, comm = make()
    red.reduce(comm, 0)
    assert torch.equal(local, torch.arange(10.0) + 1100.0)
    assert all(b.epoch == 0 for b in red.buckets)
    assert red.stale(0) == []


def test_torn_reduction_is_restored_and_redone_in_the_new_epoch():
    local, red, comm = make(fail_at=2)
    with pytest.raises(WorldChangedStub):
        red.reduce(comm, 0)
    # Buckets 0-1 were reduced with both peers, bucket 2 is torn, bucket 3 untouched.
    assert red.stale(1) == [0, 1, 2]
    red.restore(1)
    assert torch.equal(local, torch.arange(10.0)), "restore gives back the local contribution"
    local += 5.0  # extra micro-batches of the survivors accumulate into the restored buffer
    red.reduce(comm, 1)
    assert torch.equal(local, torch.arange(10.0) + 5.0 + 100.0), "only the surviving peer is summed"
    assert all(b.epoch == 1 for b in red.buckets)


def test_failure_during_the_redo_restores_the_new_contribution():
    local, red, comm = make(fail_at=1)
    with pytest.raises(WorldChangedStub):
        red.reduce(comm, 0)
    red.restore(1)
    local += 5.0
    comm.fail_at, comm.peers = comm.calls + 1, [torch.full((10,), 100.0), torch.full((10,), 7.0)]
    with pytest.raises(WorldChangedStub):
        red.reduce(comm, 1)
    red.restore(2)
    assert torch.equal(local, torch.arange(10.0) + 5.0), "the snapshot taken in epoch 1 includes the extras"
    red.reduce(comm, 2)
    assert torch.equal(local, torch.arange(10.0) + 5.0 + 100.0)


def test_reset_forgets_tags_for_the_next_step():
    local, red, comm = make()
    red.reduce(comm, 0)
    red.reset()
    assert all(b.epoch is None and b.snapshot is None for b in red.buckets)
    local.zero_()
    red.reduce(comm, 0)
    assert torch.equal(local, torch.full((10,), 1100.0))


def test_several_tensors_are_bucketed_separately():
    a, b = torch.zeros(5), torch.zeros(2, dtype=torch.float64)
    red = BucketedReduction([a, b], 4)
    assert [x.view.numel() for x in red.buckets] == [4, 1, 2]
    assert red.buckets[2].view.dtype == torch.float64
