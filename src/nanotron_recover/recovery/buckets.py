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

Several tensors can be reduced together (the gradient buffer plus small bookkeeping vectors); each
is cut into its own buckets of at most ``bucket_numel`` elements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Bucket:
    view: torch.Tensor
    snapshot: torch.Tensor | None = None
    epoch: int | None = None


class BucketedReduction:
    def __init__(self, tensors: list[torch.Tensor], bucket_numel: int):
        if bucket_numel < 1:
            raise ValueError("bucket_numel must be >= 1")
        self.buckets: list[Bucket] = []
        for t in tensors:
            flat = t.view(-1)
            for start in range(0, flat.numel(), bucket_numel):
                self.buckets.append(Bucket(flat[start : start + bucket_numel]))
        self._restore_stream: torch.cuda.Stream | None = None

    def reduce(self, comm, epoch: int, before_bucket: Callable[[int], None] | None = None) -> None:
        """Reduce every bucket not yet reduced in ``epoch``; raises whatever ``comm`` raises on a
        failure (the torn state is then repaired by :meth:`restore`)."""
        for i, b in enumerate(self.buckets):
            if b.epoch == epoch:
                continue
            if before_bucket is not None:
                before_bucket(i)
            if b.snapshot is None:
                b.snapshot = b.view.clone()
            b.epoch = None
            host = b.view if b.view.device.type == "cpu" else b.view.cpu()
            comm.allreduce_(host, epoch)
            if host is not b.view:
                b.view.copy_(host)
            b.epoch = epoch

    def stale(self, epoch: int) -> list[int]:
        return [i for i, b in enumerate(self.buckets) if b.snapshot is not None and b.epoch != epoch]

    def restore(self, epoch: int, asynchronous: bool = False) -> torch.cuda.Event | None:
        """Put this rank's local contribution back into every stale bucket and drop the snapshots
        (the contribution may grow before the next reduction, which snapshots it again).

        With ``asynchronous`` on CUDA the copies run on a side stream and an event is returned: the
        caller must make the compute stream wait on it before anything accumulates into the buffer.
        """
        stale = self.stale(epoch)
        use_stream = asynchronous and stale and self.buckets[stale[0]].view.is_cuda
        if use_stream:
            if self._restore_stream is None:
                self._restore_stream = torch.cuda.Stream()
            self._restore_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._restore_stream):
                for i in stale:
                    self.buckets[i].view.copy_(self.buckets[i].snapshot, non_blocking=True)
                    # The snapshot is freed below while the copy may still run on the side stream.
                    self.buckets[i].snapshot.record_stream(self._restore_stream)
            event = torch.cuda.Event()
            event.record(self._restore_stream)
        for i in stale:
            if not use_stream:
                self.buckets[i].view.copy_(self.buckets[i].snapshot)
            self.buckets[i].epoch = None
        for b in self.buckets:
            b.snapshot = None
        return event if use_stream else None

    def reset(self) -> None:
        """Forget snapshots and tags (a new step)."""
        for b in self.buckets:
            b.snapshot, b.epoch = None, None
