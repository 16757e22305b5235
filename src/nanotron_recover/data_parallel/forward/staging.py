"""Host staging of device gradient buckets for the cross-replica reduction.

The Open MPI build the project runs on reduces host memory only, so a bucket of device gradients
travels device -> host -> MPI -> host -> device. One bucket at a time, through pageable memory,
the copies add to the reduction instead of hiding behind it. :class:`~.buckets.BucketedReduction`
instead pipelines device buckets through a :class:`CopyEngine`:

1. Every device bucket owns a pinned host buffer, allocated at its first reduction and kept. At the
   start of a reduction the device->host copies of all buckets still to reduce are queued at once on
   a copy stream, after the work that produced the gradients.
2. Bucket ``k`` is reduced as soon as its own copy is done (a host wait on its event), *out of
   place*: MPI reads the pinned buffer and writes the sum into a slot of a small ring of pinned
   result buffers. The pinned buffer therefore keeps this rank's contribution: it *is* the
   snapshot ``S(k)``, which costs no device memory and no copy of its own.
3. The host->device copy of the result runs on a second stream while bucket ``k+1`` is reduced. A
   ring slot is written again only after its previous copy finished (``depth`` slots: at most
   ``depth`` copies in flight).
4. At the end, and before an exception leaves the reduction, the compute stream is ordered after
   every host->device copy: whatever reads the buffer next (the optimizer, or a restore after a
   torn reduction) sees every copy finished, and no late copy overwrites a restored bucket.

:class:`CudaCopies` implements the engine with two CUDA streams. :class:`DeferredCopies` is a
host-only stand-in that makes ordering mistakes visible, as :class:`~.streams.DeferredStreams`
does for restores: a copy runs only when it is waited for, so code that reads a staging buffer
before waiting for its copy reads stale data, and a result whose copy nobody waits for never
reaches the bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class CopyEngine(Protocol):
    """Copies between device buckets and pinned host memory on streams of their own."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` lives on the device this engine copies from and to."""
        ...

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer copies can run from and to asynchronously (pinned, for CUDA)."""
        ...

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        """Queue ``dst <- src`` (device to host) after the compute stream's work so far; an event."""
        ...

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        """Queue ``dst <- src`` (host to device); an event."""
        ...

    def host_wait(self, event: object) -> None:
        """Block the calling thread until ``event``'s copy is done."""
        ...

    def device_wait(self, event: object) -> None:
        """Order all later compute-stream work after ``event``'s copy."""
        ...


class CudaCopies:
    """A device->host and a host->device stream next to the compute stream of ``device``."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"CudaCopies needs a CUDA device, got {device}")
        self.device = device
        self.d2h = torch.cuda.Stream(device=device)
        self.h2d = torch.cuda.Stream(device=device)

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def _on(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        # After what the compute stream queued so far: the backward that wrote the gradients, or the
        # optimizer/restore that last touched the bucket.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        return self._on(self.d2h, dst, src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        return self._on(self.h2d, dst, src)

    def host_wait(self, event: object) -> None:
        assert isinstance(event, torch.cuda.Event)
        event.synchronize()

    def device_wait(self, event: object) -> None:
        assert isinstance(event, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(event)


class DeferredCopy:
    """A copy of :class:`DeferredCopies`, run when first waited for."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.dst, self.src = dst, src
        self.ran = False

    def run(self) -> None:
        # Reads its source only now, as a stream running late would: a source overwritten before
        # the copy was waited for (a ring slot reused too early) shows up as a wrong result.
        if not self.ran:
            self.dst.copy_(self.src)
            self.ran = True


class DeferredCopies:
    """Host-only :class:`CopyEngine`: tensors ``on_device`` says are on the device are copied as
    late as the protocol allows (when waited for); ``pending`` counts copies not yet run."""

    def __init__(self, on_device: Callable[[torch.Tensor], bool]) -> None:
        self._on_device = on_device
        self.queued: list[DeferredCopy] = []

    def owns(self, tensor: torch.Tensor) -> bool:
        return self._on_device(tensor)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((numel,), float("nan")).to(dtype)  # garbage until a copy lands

    def _queue(self, dst: torch.Tensor, src: torch.Tensor) -> DeferredCopy:
        copy = DeferredCopy(dst, src)
        self.queued.append(copy)
        return copy

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> DeferredCopy:
        return self._queue(dst, src)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> DeferredCopy:
        return self._queue(dst, src)

    def host_wait(self, event: object) -> None:
        assert isinstance(event, DeferredCopy)
        event.run()

    def device_wait(self, event: object) -> None:
        assert isinstance(event, DeferredCopy)
        event.run()

    @property
    def pending(self) -> int:
        return sum(not c.ran for c in self.queued)
