"""Bucketed, snapshotted, epoch-tagged reduction of the local gradient contribution.

The reduction runs after the last micro-batch (no data-parallel traffic during backward) over the
fault-tolerant DP communicator, bucket by bucket. Before bucket ``b`` is reduced in place, its local
contribution is copied to the snapshot ``S(b)``, and once the reduction returns the bucket is tagged
with the world epoch it was reduced in, ``eps(b)``.

A failure tears the reduction: buckets already reduced hold sums that include the lost replica's
contribution, and the bucket in flight holds anything. Every bucket with ``eps(b) < eps_cur`` (or no
tag) is stale: :meth:`restore` copies ``S(b)`` back so the buffer is again this rank's own local
contribution, the caller may add to it (extra micro-batches, a promoted spare's gradients), and
:meth:`reduce` runs again in the new epoch, taking fresh snapshots.

Where ``S(b)`` lives. A bucket in host memory keeps its snapshot in a buffer of its own, allocated
at its first reduction and reused by every later one (:attr:`Bucket.store`): taking ``S(b)`` is then
one copy into memory already mapped, where a fresh clone per reduction also paid for new pages
(``benchmarks/reduction.py``, 50M parameters on 4 ranks of 2 cores: 0.16 s a step for the clones,
0.03-0.04 s for the copies). The reduction
itself stays in place: an out-of-place ``Allreduce`` into a separate result buffer, which would
leave the contribution as its own snapshot, measured slower here, since Open MPI first copies the
send buffer into the result and the result must still be copied back into the gradient buffer.
Device buckets are staged through pinned host memory (:mod:`.staging`): their device->host copy
is queued for every bucket at the start of the reduction, each bucket is reduced out of place as
soon as its copy is done, and the host->device copy of its sum overlaps the next bucket's
reduction. The pinned staging buffer of a device bucket keeps this rank's contribution, so it is
``S(b)``: no device memory and no extra copy for snapshots on a GPU. Whether a snapshot is *valid*
is unchanged: from the reduction that takes it until the next :meth:`restore` or :meth:`reset`.

Several tensors can be reduced together (the gradient buffer plus small bookkeeping vectors); each
is cut into its own buckets of at most ``bucket_numel`` elements.

Restoring on a side stream (``restore(epoch, asynchronous=True)`` with CUDA buffers) overlaps the
copies with the extra micro-batches. :meth:`restore` always returns a :class:`RestoreHandle`; its
``wait()`` makes the compute stream wait for the copies and must come before anything is added to
the buffer (a promoted spare's gradients, the first backward of an extra micro-batch): a copy still
in flight would overwrite it. ``wait()`` is idempotent and a no-op after a blocking restore, so
calling it unconditionally is always right. Only buckets that live on the side stream's device
are copied there; buckets in host memory (the bookkeeping vector) are restored synchronously
before :meth:`restore` returns. :meth:`reduce`, :meth:`restore` and :meth:`reset` wait for a
pending restore themselves, since they read or drop the snapshots and the buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .staging import CopyEngine, CudaCopies
from .streams import CudaStreams, Streams

STAGING_DEPTH = 2  # reduced device buckets whose host->device copy may be in flight at once


@dataclass
class Bucket:
    view: torch.Tensor
    snapshot: torch.Tensor | None = None  # S(b), while valid (None: no snapshot)
    epoch: int | None = None
    # The host memory S(b) is taken into, kept across steps: for a device bucket the pinned
    # staging buffer MPI reads, for a host bucket a buffer of its own.
    store: torch.Tensor | None = None
    copied: object | None = None  # a device bucket's device->host copy into ``store``, until waited for

    def take_snapshot(self) -> torch.Tensor:
        """``S(b)`` of a bucket reduced where it lives: a copy of its current contents."""
        if self.store is None:
            self.store = torch.empty_like(self.view)
        return self.store.copy_(self.view)


class RestoreHandle:
    """The outcome of one :meth:`BucketedReduction.restore`.

    ``buckets``: indices of the buckets restored; ``asynchronous``: whether some of them are being
    copied on a side stream; ``done``: True once the compute stream is ordered after every copy
    (at once for a blocking restore, after :meth:`wait` otherwise).
    """

    def __init__(self, buckets: tuple[int, ...], streams: Streams | None = None, event: Any = None) -> None:
        self.buckets = buckets
        self._streams, self._event = streams, event
        self.asynchronous = event is not None

    @property
    def done(self) -> bool:
        return self._event is None

    def wait(self) -> None:
        """Make the current (compute) stream wait for the restore. Idempotent."""
        if self._event is None:
            return
        assert self._streams is not None
        self._streams.wait(self._event)
        self._event = None


class BucketedReduction:
    """Bucketed, snapshotted reduction of ``tensors`` (see the module docstring).

    ``streams`` runs asynchronous restores; by default a :class:`~.streams.CudaStreams` is created
    on the first asynchronous restore that has a CUDA bucket to copy, and a restore without device
    buckets (or with ``asynchronous=False``) is a plain copy that needs no stream at all.
    ``copies`` stages device buckets through host memory (:mod:`.staging`); by default a
    :class:`~.staging.CudaCopies` is created on the first reduction with a CUDA bucket.
    """

    def __init__(
        self,
        tensors: list[torch.Tensor],
        bucket_numel: int,
        streams: Streams | None = None,
        copies: CopyEngine | None = None,
        depth: int = STAGING_DEPTH,
    ) -> None:
        if bucket_numel < 1:
            raise ValueError("bucket_numel must be >= 1")
        if depth < 1:
            raise ValueError("depth must be >= 1")
        self.buckets: list[Bucket] = []
        for t in tensors:
            flat = t.view(-1)
            for start in range(0, flat.numel(), bucket_numel):
                self.buckets.append(Bucket(flat[start : start + bucket_numel]))
        self.streams = streams
        self.copies = copies
        self.depth = depth
        self._ring: dict[int, torch.Tensor] = {}  # pinned result buffers of device buckets, by slot
        self._pending: RestoreHandle | None = None

    def reduce(self, comm: Any, epoch: int, before_bucket: Callable[[int], None] | None = None) -> int:
        """Reduce every bucket not yet reduced in ``epoch``; returns the bytes reduced. Raises
        whatever ``comm`` raises on a failure (the torn state is then repaired by :meth:`restore`)."""
        self.wait_restored()  # the snapshots below must see the restored buffer
        todo = [i for i, b in enumerate(self.buckets) if b.epoch != epoch]
        copies = self._copies_for(todo)
        staged = {i for i in todo if copies is not None and copies.owns(self.buckets[i].view)}
        for i in sorted(staged):  # every device->host copy at once: S(b), and what MPI reads
            b = self.buckets[i]
            if b.snapshot is None:
                if b.store is None:
                    b.store = copies.host_buffer(b.view.numel(), b.view.dtype)
                b.copied = copies.to_host(b.store, b.view)
                b.snapshot = b.store
        in_flight: list[object | None] = [None] * self.depth
        nbytes, slot = 0, 0
        try:
            for i in todo:
                b = self.buckets[i]
                if before_bucket is not None:
                    before_bucket(i)
                b.epoch = None
                if i in staged:
                    assert copies is not None and b.store is not None
                    self._wait_copied(copies, b)
                    if in_flight[slot] is not None:
                        copies.host_wait(in_flight[slot])  # the slot's last sum has left it
                    out = self._ring_slot(copies, slot, b.view)
                    comm.allreduce_(b.store, epoch, out=out)
                    in_flight[slot] = copies.to_device(b.view, out)
                    slot = (slot + 1) % self.depth
                else:
                    if b.snapshot is None:
                        b.snapshot = b.take_snapshot()
                    comm.allreduce_(b.view, epoch)
                b.epoch = epoch
                nbytes += b.view.numel() * b.view.element_size()
        finally:
            # Whatever comes next (the optimizer, a restore) runs after every copy: no late copy
            # into a bucket, nor out of a staging buffer that a restore reads.
            for event in in_flight:
                if event is not None:
                    assert copies is not None
                    copies.device_wait(event)
            for i in staged:
                self._wait_copied(copies, self.buckets[i])
        return nbytes

    @staticmethod
    def _wait_copied(copies: CopyEngine | None, b: Bucket) -> None:
        if b.copied is not None:
            assert copies is not None
            copies.host_wait(b.copied)
            b.copied = None

    def _ring_slot(self, copies: CopyEngine, slot: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._ring.get(slot)
        if buf is None or buf.dtype != like.dtype or buf.numel() < like.numel():
            numel = max(b.view.numel() for b in self.buckets if b.view.dtype == like.dtype)
            buf = self._ring[slot] = copies.host_buffer(numel, like.dtype)
        return buf[: like.numel()]

    def _copies_for(self, todo: list[int]) -> CopyEngine | None:
        if self.copies is None:
            cuda = next((self.buckets[i].view for i in todo if self.buckets[i].view.is_cuda), None)
            if cuda is not None:
                self.copies = CudaCopies(cuda.device)
        return self.copies

    def stale(self, epoch: int) -> list[int]:
        return [i for i, b in enumerate(self.buckets) if b.snapshot is not None and b.epoch != epoch]

    def restore(self, epoch: int, asynchronous: bool = False) -> RestoreHandle:
        """Put this rank's local contribution back into every stale bucket and drop the snapshots
        (the contribution may grow before the next reduction, which snapshots it again).

        With ``asynchronous``, buckets on the side stream's device are copied there and the returned
        handle's :meth:`RestoreHandle.wait` must run before anything accumulates into the buffer;
        host buckets are always copied before this returns.
        """
        self.wait_restored()  # a second restore must not race the copies of the first
        stale = self.stale(epoch)
        streams = self._streams_for(stale) if asynchronous else None
        # Only device buckets can be ordered on a side stream; host ones are copied right here.
        deferred = [i for i in stale if streams is not None and streams.owns(self.buckets[i].view)]
        for i in sorted(set(stale) - set(deferred)):
            self.buckets[i].view.copy_(self.buckets[i].snapshot)
        handle = RestoreHandle(tuple(stale))
        if deferred:
            assert streams is not None
            pairs = [(self.buckets[i].view, self.buckets[i].snapshot) for i in deferred]

            def copy_back() -> None:
                for view, snapshot in pairs:
                    view.copy_(snapshot, non_blocking=True)

            # A device bucket's S(b) is its pinned staging buffer, kept for good: only device
            # snapshots need keeping alive for the side stream.
            alive = [snapshot for _, snapshot in pairs if streams.owns(snapshot)]
            event = streams.side(copy_back, keep_alive=alive)
            handle = RestoreHandle(tuple(stale), streams, event)
            self._pending = handle
        for i in stale:
            self.buckets[i].epoch = None
        for b in self.buckets:
            b.snapshot = None
        return handle

    def wait_restored(self) -> None:
        """Order the compute stream after the last asynchronous restore, if it is still pending."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None

    def reset(self) -> None:
        """Forget snapshots and tags (a new step)."""
        self.wait_restored()
        for b in self.buckets:
            b.snapshot, b.epoch = None, None

    def _streams_for(self, stale: list[int]) -> Streams | None:
        if self.streams is None:
            cuda = next((self.buckets[i].view for i in stale if self.buckets[i].view.is_cuda), None)
            if cuda is None:
                return None  # nothing to overlap: a CPU run restores by plain copies
            self.streams = CudaStreams(cuda.device)
        return self.streams
