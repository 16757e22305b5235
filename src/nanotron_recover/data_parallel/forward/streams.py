"""Where an asynchronous restore runs: a side stream next to the compute stream.

:meth:`~.buckets.BucketedReduction.restore` with ``asynchronous=True`` copies the snapshots of the
stale device buckets back into the gradient buffer off the compute stream, so the copies overlap
with the survivors' extra micro-batches. The protocol between the two streams is:

1. ``side(work, keep_alive)`` enqueues ``work`` (the copies) on the side stream *after* everything
   already queued on the compute stream (whatever produced the buffer and the snapshots), and
   returns an event that completes when ``work`` has run. ``keep_alive`` are the device tensors
   ``work`` reads that the caller is about to drop (the snapshots): their memory must not be handed
   out again before the side stream is done with it.
2. ``wait(event)`` makes the compute stream wait for that event. Everything the compute stream does
   to the buffer afterwards (accumulating extra micro-batches, adding a promoted spare's gradients,
   reading it for the next reduction) is ordered after the copies; anything it did *before* may be
   overwritten by a late copy.
3. ``owns(tensor)`` says whether a tensor lives where the side stream runs. Only those buckets go
   on the side stream; the others (a CPU bookkeeping vector reduced with the CUDA gradients) are
   restored by a plain, synchronous copy, because host memory has no stream to order against and
   ``record_stream`` on a CPU tensor raises.

:class:`CudaStreams` implements this with a ``torch.cuda.Stream``. :class:`DeferredStreams` is a
host-only stand-in that makes ordering mistakes visible: it runs the side work only when it is
waited on, i.e. it behaves like a side stream that is always as late as it is allowed to be. A
caller that touches the buffer before waiting sees the un-restored data, and what it added is then
overwritten by the late copy. A blocking restore needs neither.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch


class Streams(Protocol):
    """A compute stream plus one side stream (see the module docstring for the protocol)."""

    def owns(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` lives on the device the side stream runs on."""
        ...

    def side(self, work: Callable[[], None], keep_alive: Sequence[torch.Tensor] = ()) -> object:
        """Run ``work`` on the side stream after all work queued so far on the compute stream;
        return an event for :meth:`wait`. Every tensor of ``keep_alive`` must be owned."""
        ...

    def wait(self, event: object) -> None:
        """Order all later compute-stream work after ``event``."""
        ...


class CudaStreams:
    """One CUDA side stream next to the current (compute) stream of ``device``."""

    def __init__(self, device: torch.device | int | None = None) -> None:
        if device is None or isinstance(device, int):
            device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        if device.type != "cuda":
            raise ValueError(f"CudaStreams needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._stream: torch.cuda.Stream | None = None  # created on first use, on self.device

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device

    def side(self, work: Callable[[], None], keep_alive: Sequence[torch.Tensor] = ()) -> torch.cuda.Event:
        for t in keep_alive:
            if not self.owns(t):
                # record_stream would raise on a host tensor deep inside the restore; say why here.
                raise ValueError(
                    f"only tensors on {self.device} can be kept alive for its side stream, got {t.device}"
                )
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            work()
            for t in keep_alive:
                # The caller frees these while the side stream may still read them: the caching
                # allocator must not reuse their memory before the work queued so far completes.
                t.record_stream(stream)
        return stream.record_event()

    def wait(self, event: object) -> None:
        if not isinstance(event, torch.cuda.Event):
            raise TypeError(f"expected a torch.cuda.Event from side(), got {type(event).__name__}")
        torch.cuda.current_stream(self.device).wait_event(event)


class DeferredEvent:
    """The pending side work of :class:`DeferredStreams`; ``ran`` once it has been executed."""

    def __init__(self, work: Callable[[], None]) -> None:
        self.work: Callable[[], None] | None = work

    @property
    def ran(self) -> bool:
        return self.work is None


class DeferredStreams:
    """Host-only streams for tests: the side work runs when it is waited on, not before.

    ``on_device`` decides which tensors count as device tensors (e.g. ``lambda t: t.dtype ==
    torch.float32`` to treat an fp32 gradient buffer as the device and an fp64 bookkeeping vector as
    host memory). :meth:`side` rejects a host tensor in ``keep_alive`` the way ``record_stream``
    does, and remembers the kept tensors in ``kept``. Like a real stream the side work runs in
    order: waiting on an event first runs every earlier pending event.
    """

    def __init__(self, on_device: Callable[[torch.Tensor], bool]) -> None:
        self.on_device = on_device
        self.pending: list[DeferredEvent] = []
        self.kept: list[torch.Tensor] = []
        self.waits = 0  # wait() calls that had work to run (idempotence shows as no increase)

    def owns(self, tensor: torch.Tensor) -> bool:
        return bool(self.on_device(tensor))

    def side(self, work: Callable[[], None], keep_alive: Sequence[torch.Tensor] = ()) -> DeferredEvent:
        for t in keep_alive:
            if not self.owns(t):
                raise NotImplementedError("record_stream on a host tensor: it has no stream to order against")
        self.kept.extend(keep_alive)
        event = DeferredEvent(work)
        self.pending.append(event)
        return event

    def wait(self, event: object) -> None:
        if not isinstance(event, DeferredEvent):
            raise TypeError(f"expected a DeferredEvent from side(), got {type(event).__name__}")
        if event.ran:
            return
        self.waits += 1
        while self.pending:
            first = self.pending.pop(0)
            self._run(first)
            if first is event:
                return

    def synchronize(self) -> None:
        """Run every pending side work (what a device-wide synchronize would force)."""
        while self.pending:
            self._run(self.pending.pop(0))

    @staticmethod
    def _run(event: DeferredEvent) -> None:
        work, event.work = event.work, None
        if work is not None:
            work()
