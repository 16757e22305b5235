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
Device buckets take a fresh clone, whose memory goes back to the caching allocator when the
snapshot is dropped (a kept buffer would hold a gradient-sized block through the next forward and
backward). Whether a snapshot is *valid* is unchanged: from the reduction that takes it until the
next :meth:`restore` or :meth:`reset`.

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

from .streams import CudaStreams, Streams


@dataclass
class Bucket:
    view: torch.Tensor
    snapshot: torch.Tensor | None = None  # S(b), while valid (None: no snapshot)
    epoch: int | None = None
    store: torch.Tensor | None = None  # host buckets: the memory S(b) is taken into, kept across steps

    def take_snapshot(self) -> torch.Tensor:
        """``S(b)``: a copy of the bucket's current contents."""
        if self.view.device.type != "cpu":
            return self.view.clone()
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
    """

    def __init__(
        self, tensors: list[torch.Tensor], bucket_numel: int, streams: Streams | None = None
    ) -> None:
        if bucket_numel < 1:
            raise ValueError("bucket_numel must be >= 1")
        self.buckets: list[Bucket] = []
        for t in tensors:
            flat = t.view(-1)
            for start in range(0, flat.numel(), bucket_numel):
                self.buckets.append(Bucket(flat[start : start + bucket_numel]))
        self.streams = streams
        self._pending: RestoreHandle | None = None

    def reduce(self, comm: Any, epoch: int, before_bucket: Callable[[int], None] | None = None) -> int:
        """Reduce every bucket not yet reduced in ``epoch``; returns the bytes reduced. Raises
        whatever ``comm`` raises on a failure (the torn state is then repaired by :meth:`restore`)."""
        self.wait_restored()  # the snapshots below must see the restored buffer
        nbytes = 0
        for i, b in enumerate(self.buckets):
            if b.epoch == epoch:
                continue
            if before_bucket is not None:
                before_bucket(i)
            if b.snapshot is None:
                b.snapshot = b.take_snapshot()
            b.epoch = None
            host = b.view if b.view.device.type == "cpu" else b.view.cpu()
            comm.allreduce_(host, epoch)
            if host is not b.view:
                b.view.copy_(host)
            b.epoch = epoch
            nbytes += b.view.numel() * b.view.element_size()
        return nbytes

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

            event = streams.side(copy_back, keep_alive=[snapshot for _, snapshot in pairs])
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
