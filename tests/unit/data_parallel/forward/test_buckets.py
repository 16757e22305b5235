"""BucketedReduction: snapshots, epoch tags and restore after a torn reduction (single process,
with an in-memory stand-in for the DP communicator that can fail mid-reduction)."""

from __future__ import annotations

import pytest
import torch

from nanotron_recover.data_parallel.forward import buckets as buckets_module
from nanotron_recover.data_parallel.forward.buckets import BucketedReduction
from nanotron_recover.data_parallel.forward.streams import DeferredStreams


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
    assert red.reduce(comm, 0) == 10 * 4, "the bytes reduced"
    assert torch.equal(local, torch.arange(10.0) + 1100.0)
    assert all(b.epoch == 0 for b in red.buckets)
    assert red.stale(0) == []
    assert red.reduce(comm, 0) == 0, "nothing left to reduce in this epoch"


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


# -- asynchronous restore: host buckets at once, device buckets on the side stream ----------------
# The gradient buffer is fp32 and plays the device; the bookkeeping vector is fp64 host memory, as
# in the transaction (CUDA gradients + a CPU float64 vector in one reduction).
def on_device(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32


class Peers:
    """DP stand-in for several tensors: adds the other replicas' contributions of the current epoch
    (``contributions[epoch]``, one list of tensors per peer, matching the reduced tensors) and fails
    once before bucket ``fail_at`` completes, after tearing it."""

    def __init__(self, red: BucketedReduction, tensors: list[torch.Tensor], contributions, fail_at=None):
        self.contributions, self.fail_at, self.epoch, self.calls = contributions, fail_at, 0, 0
        self.where: dict[int, tuple[int, int]] = {}
        for k, t in enumerate(tensors):
            base = t.data_ptr()
            for b in red.buckets:
                if b.view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                    self.where[b.view.data_ptr()] = (k, (b.view.data_ptr() - base) // t.element_size())

    def allreduce_(self, buf: torch.Tensor, epoch: int) -> None:
        assert epoch == self.epoch, "reduction tagged with a stale epoch"
        k, start = self.where[buf.data_ptr()]
        if self.fail_at is not None and self.calls == self.fail_at:
            self.fail_at = None
            buf.fill_(1e9)  # torn
            self.epoch += 1
            raise WorldChangedStub()
        self.calls += 1
        for peer in self.contributions[epoch]:
            buf += peer[k][start : start + buf.numel()]


def mixed(fail_at: int | None = None, streams=None):
    """Gradients (fp32, 10 elements: 3 buckets of 4) + bookkeeping (fp64, 4 elements: 1 bucket);
    one peer contributes 100 (gradients) and 1 (bookkeeping) in epoch 0."""
    grads = torch.arange(10, dtype=torch.float32)
    book = torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    red = BucketedReduction([grads, book], 4, streams=streams)
    peer = [torch.full((10,), 100.0), torch.full((4,), 1.0, dtype=torch.float64)]
    comm = Peers(red, [grads, book], {0: [peer], 1: []}, fail_at)
    return grads, book, red, comm


def test_async_restore_never_puts_host_buckets_on_the_side_stream():
    streams = DeferredStreams(on_device)
    grads, book, red, comm = mixed(fail_at=3, streams=streams)  # torn at the bookkeeping bucket
    with pytest.raises(WorldChangedStub):
        red.reduce(comm, 0)
    assert red.stale(1) == [0, 1, 2, 3], "every gradient bucket was reduced, the bookkeeping one is torn"
    reduced = grads.clone()
    # DeferredStreams raises, as record_stream does, if a host snapshot is handed to the side stream.
    handle = red.restore(1, asynchronous=True)
    assert handle.buckets == (0, 1, 2, 3) and handle.asynchronous and not handle.done
    assert torch.equal(book, torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64)), (
        "host: restored at once"
    )
    assert torch.equal(grads, reduced), "device buckets: nothing copied before the wait"
    assert len(streams.kept) == 3 and all(on_device(t) for t in streams.kept), "only device snapshots kept"
    handle.wait()
    assert handle.done
    assert torch.equal(grads, torch.arange(10, dtype=torch.float32))


def test_promoted_spare_shadow_counts_only_when_added_after_the_wait():
    shadow = torch.full((10,), 7.0)
    results = {}
    for order in ("after_wait", "before_wait"):
        grads, _, red, comm = mixed(fail_at=1, streams=DeferredStreams(on_device))
        with pytest.raises(WorldChangedStub):
            red.reduce(comm, 0)
        handle = red.restore(1, asynchronous=True)
        if order == "after_wait":
            handle.wait()
            grads.add_(shadow)
        else:
            grads.add_(shadow)  # races the copies still queued on the side stream
            handle.wait()
        results[order] = grads.clone()
    own = torch.arange(10, dtype=torch.float32)
    assert torch.equal(results["after_wait"], own + shadow)
    # The deferred copies really run late: adding before the wait loses what was added in the stale
    # buckets (0 and 1 here), so the test above would catch a missing or misplaced wait.
    assert not torch.equal(results["before_wait"], own + shadow)
    assert torch.equal(results["before_wait"][:8], own[:8]), "the late copy overwrote the shadow"


@pytest.mark.parametrize("asynchronous", [False, True])
def test_three_replicas_torn_then_redone_give_the_fault_free_totals(asynchronous):
    """Replicas 0, 1, 2 each compute one id (B=3) of the step. Replica 2 dies after every gradient
    bucket was reduced, while the bookkeeping bucket is in flight; replica 0 (simulated here) redoes
    replica 2's id and the survivors reduce again in epoch 1."""
    g = [torch.full((10,), float(10**r)) + torch.arange(10.0) for r in range(3)]
    loss = [0.25, 0.5, 2.0]

    def book(r: int) -> torch.Tensor:  # per id: [count of ids 0..2, loss of ids 0..2]
        v = torch.zeros(6, dtype=torch.float64)
        v[r], v[3 + r] = 1.0, loss[r]
        return v

    grads, bookkeeping = g[0].clone(), book(0)
    streams = DeferredStreams(on_device)
    red = BucketedReduction([grads, bookkeeping], 4, streams=streams)  # buckets: 4, 4, 2 | 4, 2
    contributions = {0: [[g[1], book(1)], [g[2], book(2)]], 1: [[g[1], book(1)]]}
    comm = Peers(red, [grads, bookkeeping], contributions, fail_at=3)
    with pytest.raises(WorldChangedStub):
        red.reduce(comm, 0)
    assert red.stale(1) == [0, 1, 2, 3]
    handle = red.restore(1, asynchronous=asynchronous)
    assert handle.asynchronous is asynchronous
    handle.wait()
    grads.add_(g[2])  # the extra micro-batch (replica 2's id), now computed by replica 0
    bookkeeping.add_(book(2))
    red.reduce(comm, 1)
    assert torch.equal(grads, g[0] + g[1] + g[2])
    assert torch.equal(bookkeeping[:3], torch.ones(3, dtype=torch.float64)), "every id summed exactly once"
    assert bookkeeping[3:].sum().item() == sum(loss)
    assert streams.pending == []


def test_wait_is_idempotent_and_reduce_waits_for_a_pending_restore():
    streams = DeferredStreams(on_device)
    grads, _, red, comm = mixed(fail_at=2, streams=streams)
    with pytest.raises(WorldChangedStub):
        red.reduce(comm, 0)
    handle = red.restore(1, asynchronous=True)
    handle.wait()
    handle.wait()
    assert streams.waits == 1 and handle.done
    # Without an explicit wait, the next reduction orders itself after the restore.
    grads2, _, red2, comm2 = mixed(fail_at=2, streams=DeferredStreams(on_device))
    with pytest.raises(WorldChangedStub):
        red2.reduce(comm2, 0)
    pending = red2.restore(1, asynchronous=True)
    red2.reduce(comm2, 1)
    assert pending.done
    assert torch.equal(grads2, torch.arange(10, dtype=torch.float32)), (
        "epoch 1 has no peers: own contribution"
    )


def test_blocking_restore_needs_no_streams(monkeypatch):
    def no_cuda(*_args, **_kwargs):
        raise AssertionError("a blocking restore must not touch any stream")

    monkeypatch.setattr(buckets_module, "CudaStreams", no_cuda)
    for streams in (None, DeferredStreams(on_device)):
        grads, book, red, comm = mixed(fail_at=3, streams=streams)
        with pytest.raises(WorldChangedStub):
            red.reduce(comm, 0)
        handle = red.restore(1)
        assert handle.done and not handle.asynchronous and handle.buckets == (0, 1, 2, 3)
        handle.wait()  # a no-op
        assert torch.equal(grads, torch.arange(10, dtype=torch.float32))
        if streams is not None:
            assert streams.pending == [] and streams.kept == []


def test_async_restore_of_host_tensors_without_streams_is_a_plain_copy(monkeypatch):
    def no_cuda(*_args, **_kwargs):
        raise AssertionError("no CUDA bucket: no side stream")

    monkeypatch.setattr(buckets_module, "CudaStreams", no_cuda)
    grads, book, red, comm = mixed(fail_at=3)
    with pytest.raises(WorldChangedStub):
        red.reduce(comm, 0)
    handle = red.restore(1, asynchronous=True)
    assert handle.done and not handle.asynchronous
    assert torch.equal(grads, torch.arange(10, dtype=torch.float32))
    assert red.streams is None


def test_nothing_stale_gives_a_done_handle():
    streams = DeferredStreams(on_device)
    _, _, red, comm = mixed(streams=streams)
    red.reduce(comm, 0)
    handle = red.restore(0, asynchronous=True)
    assert handle.buckets == () and handle.done and streams.pending == []


# -- where snapshots live ----------------------------------------------------------------------------
def test_host_snapshots_reuse_their_memory_and_hold_the_latest_contribution():
    local, red, comm = make()
    red.reduce(comm, 0)
    first = [b.snapshot.data_ptr() for b in red.buckets]
    assert all(p != b.view.data_ptr() for p, b in zip(first, red.buckets, strict=True)), (
        "a copy, not the buffer"
    )
    red.reset()
    local.copy_(torch.arange(10.0) * 2.0)  # the next step's contribution
    comm.fail_at = comm.calls + 2
    with pytest.raises(WorldChangedStub):
        red.reduce(comm, 0)
    assert [red.buckets[i].snapshot.data_ptr() for i in red.stale(1)] == first[:3], "no new memory"
    red.restore(1)
    assert torch.equal(local, torch.arange(10.0) * 2.0), "the snapshot of this step, not the last one"
    red.reduce(comm, 1)
    assert torch.equal(local, torch.arange(10.0) * 2.0 + 100.0)
