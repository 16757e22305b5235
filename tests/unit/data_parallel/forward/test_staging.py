"""Host staging of device buckets (``staging.py`` through ``BucketedReduction``): on one process,
with a stand-in "device" (the gradient buffer, host memory that :class:`DeferredCopies` treats as
device memory and copies as late as the protocol allows) and an in-memory DP communicator that
reduces out of place and can fail mid-reduction."""

from __future__ import annotations

import pytest
import torch

from nanotron_recover.data_parallel.forward.buckets import BucketedReduction
from nanotron_recover.data_parallel.forward.staging import DeferredCopies
from nanotron_recover.data_parallel.forward.streams import DeferredStreams

PEERS = 1100.0  # what the other replicas add to every element (1000 and 100; 1000 once one died)


class Died(Exception):
    pass


class OutOfPlaceDP:
    """Adds the peers' contributions; with ``out`` the sum goes there and ``buf`` must stay as it
    is. ``fail_at``: the call (0-based) that fails once, after writing garbage into its result."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at, self.epoch, self.calls, self.peers = fail_at, 0, 0, PEERS
        self.reads: list[torch.Tensor] = []

    def allreduce_(self, buf: torch.Tensor, epoch: int, out: torch.Tensor | None = None) -> None:
        assert epoch == self.epoch, "reduction tagged with a stale epoch"
        assert not torch.isnan(buf).any(), "MPI read a staging buffer before its copy landed"
        target = buf if out is None else out
        if self.fail_at is not None and self.calls == self.fail_at:
            self.fail_at = None
            target.fill_(1e9)  # torn
            self.epoch += 1
            self.peers = 1000.0  # the peer of 100 died
            raise Died()
        self.calls += 1
        self.reads.append(buf.clone())
        if out is not None:
            out.copy_(buf)
        target += self.peers


def setup(n: int = 10, bucket: int = 3, depth: int = 2, fail_at: int | None = None, streams: bool = False):
    grads = torch.arange(n, dtype=torch.float32)
    bookkeeping = torch.ones(4, dtype=torch.float64)  # stays in host memory, reduced in place

    def on_device(t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == grads.untyped_storage().data_ptr()

    copies = DeferredCopies(on_device)
    red = BucketedReduction(
        [grads, bookkeeping],
        bucket,
        streams=DeferredStreams(on_device) if streams else None,
        copies=copies,
        depth=depth,
    )
    return grads, bookkeeping, red, OutOfPlaceDP(fail_at), copies


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_device_buckets_are_reduced_through_host_staging(depth):
    grads, bookkeeping, red, comm, copies = setup(n=11, bucket=2, depth=depth)
    assert red.reduce(comm, 0) == 11 * 4 + 4 * 8
    assert torch.equal(grads, torch.arange(11.0) + PEERS), "a ring slot reused before its copy left it"
    assert torch.equal(bookkeeping, torch.full((4,), 1 + PEERS, dtype=torch.float64))
    assert copies.pending == 0, "a copy nobody waited for"
    assert len(red._ring) == min(depth, 6), "one pinned result buffer per ring slot"


def test_the_staging_buffer_is_the_snapshot_and_is_reused():
    grads, _, red, comm, _ = setup()
    red.reduce(comm, 0)
    device = [b for b in red.buckets if b.view.dtype == torch.float32]
    assert all(b.snapshot is b.store for b in device), "S(b) of a device bucket is its staging buffer"
    assert torch.equal(torch.cat([b.snapshot for b in device]), torch.arange(10.0))
    stores = [b.store.data_ptr() for b in device]
    red.reset()
    grads.copy_(torch.arange(10.0) * 2)
    red.reduce(comm, 0)
    assert [b.store.data_ptr() for b in device] == stores, "staging buffers allocated once"
    assert torch.equal(grads, torch.arange(10.0) * 2 + PEERS)


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("fail_at", [0, 2, 4])
def test_torn_reduction_is_restored_from_the_staging_buffers_and_redone(fail_at, asynchronous):
    grads, bookkeeping, red, comm, copies = setup(fail_at=fail_at, streams=asynchronous)
    with pytest.raises(Died):
        red.reduce(comm, 0)
    assert copies.pending == 0, "a copy still in flight could overwrite the restore"
    handle = red.restore(comm.epoch, asynchronous=asynchronous)
    handle.wait()
    assert torch.equal(grads, torch.arange(10.0)), "the local contribution is back"
    assert torch.equal(bookkeeping, torch.ones(4, dtype=torch.float64))
    grads += 0.5  # an extra micro-batch the survivors compute
    red.reduce(comm, comm.epoch)
    assert torch.equal(grads, torch.arange(10.0) + 0.5 + 1000.0)
    assert torch.equal(bookkeeping, torch.full((4,), 1001.0, dtype=torch.float64))


def test_mpi_reads_only_landed_copies_and_never_writes_them():
    grads, _, red, comm, _ = setup(n=9, bucket=3)
    red.reduce(comm, 0)
    contributions = [r for r in comm.reads if r.dtype == torch.float32]
    assert torch.equal(torch.cat(contributions), torch.arange(9.0))
    assert torch.equal(
        torch.cat([b.store for b in red.buckets if b.view.dtype == torch.float32]), torch.arange(9.0)
    )


def test_exact_mode_integer_buckets_are_staged_too():
    grads = torch.arange(6, dtype=torch.int64)
    copies = DeferredCopies(lambda t: t.dtype == torch.int64)
    red = BucketedReduction([grads], 4, copies=copies)

    class IntDP:
        def allreduce_(self, buf, epoch, out=None):
            out.copy_(buf).add_(7)

    red.reduce(IntDP(), 0)
    assert torch.equal(grads, torch.arange(6) + 7)
    assert all(b.store.dtype == torch.int64 for b in red.buckets)


def test_depth_must_be_positive():
    with pytest.raises(ValueError, match="depth"):
        BucketedReduction([torch.zeros(3)], 2, depth=0)
