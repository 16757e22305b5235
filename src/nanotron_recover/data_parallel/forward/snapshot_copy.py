"""The device-to-host copy of a node snapshot on CUDA: a side stream into pinned host memory.

A node snapshot (:mod:`.snapshots`) is handed the live tensors of a rank's state
(``export_state(copy=False)``). On CPU the snapshot thread copies them straight into the slot's
mapped ``state.bin``. On CUDA that copy from the thread would run on the thread's default stream,
the legacy one, which synchronises with the compute stream, into pageable memory that the driver
stages through a bounce buffer, and the thread's current device is device 0 whatever the rank's
(only the main thread selected it). Instead, per rank:

1. **Committed.** On the main thread, right after the optimizer step of the committed step
   (``NodeSnapshots.write``, from ``mode.after_step``), :meth:`DeviceCopy.committed` records an
   event on the compute stream (the current stream of the rank's device): everything that produced
   the state is before it.
2. **Copy.** On the snapshot thread, :meth:`DeviceCopy.stage` makes the side stream (one per rank,
   created at the first snapshot) wait for that event, then queues every device tensor's bytes into
   its place in one pinned host buffer laid out like ``state.bin`` (``non_blocking``: the DMA
   engine copies while the compute stream runs the next step), and records ``done`` on the side
   stream. Host tensors of the state (AdamW's zero moments before the first step) are copied by the
   thread itself. The buffer is allocated once, from the state's layout, and reused; a state of
   another layout (names, shapes, dtypes) frees it and allocates another.
3. **Ordered before the next optimizer step.** The only thing that changes the exported tensors
   (parameters, fp32 masters, AdamW moments) is the optimizer step: the next step's forward and
   backward read the parameters and write the gradient buffer, which is not exported. So the main
   thread waits for nothing during compute; before the next optimizer step
   (``NodeSnapshots.wait_exported``, from ``mode.local_phase(OPTIMIZER)``) it only makes the compute
   stream wait for ``done`` (:meth:`DeviceCopy.order_compute_after`: ``wait_event``, no host
   block), so the optimizer's kernels cannot overwrite a tensor the side stream still reads.
4. **Written.** The snapshot thread blocks on ``done`` (``event.synchronize()``) and only then
   copies the pinned buffer into the slot (one host copy) and publishes it.

The pinned buffer costs one more copy of the rank's state in host memory (pinned: not swappable),
besides the two slots; it is what makes the copy asynchronous and at the link's pinned bandwidth.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ...engines.state import Layout

Allocate = Callable[[int], torch.Tensor]


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory (a flat uint8 tensor)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def plain_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of ordinary host memory (what :class:`HostBuffer` uses where nothing is pinned)."""
    return torch.empty(nbytes, dtype=torch.uint8)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as a flat uint8 tensor on its own device (a view when it is contiguous)."""
    t = tensor.detach().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8)


class HostBuffer:
    """One host buffer for a state's bytes in layout order, allocated for a layout and kept.

    :meth:`for_layout` returns the same buffer while the layout stays the same (every step of a
    run) and allocates a new one only when it changes; ``allocations`` counts them."""

    def __init__(self, allocate: Allocate = pinned_bytes) -> None:
        self._allocate = allocate
        self.layout: Layout | None = None
        self.buffer: torch.Tensor | None = None
        self.allocations = 0

    def for_layout(self, layout: Layout, nbytes: int) -> torch.Tensor:
        if self.buffer is None or layout != self.layout or self.buffer.numel() != nbytes:
            self.buffer = None  # the old one is freed before the new one is taken
            self.buffer = self._allocate(nbytes)
            self.layout = [tuple(e) for e in layout]  # type: ignore[misc]
            self.allocations += 1
        return self.buffer


def copy_in_layout_order(
    dst: torch.Tensor, tensors: Iterable[torch.Tensor], non_blocking: bool = False
) -> int:
    """Every tensor's bytes into the flat uint8 ``dst``, one after the other (the ``state.bin``
    order); device tensors with ``non_blocking`` on the current stream. Returns the bytes copied."""
    offset = 0
    for tensor in tensors:
        n = tensor.numel() * tensor.element_size()
        if n:
            dst[offset : offset + n].copy_(byte_view(tensor), non_blocking=non_blocking and tensor.is_cuda)
        offset += n
    return offset


@dataclass
class StagedCopy:
    """A snapshot's device-to-host copy in flight: ``buffer`` holds the state's bytes once ``done``
    has completed. ``started`` is set when the copier times its copies (benchmarks)."""

    buffer: torch.Tensor
    done: Any  # torch.cuda.Event recorded on the side stream after the last copy
    nbytes: int
    started: Any = None  # torch.cuda.Event recorded on the side stream before the first copy

    def wait(self) -> None:
        """Block the calling thread until the copy is done (the snapshot thread, before the write)."""
        self.done.synchronize()

    def seconds(self) -> float | None:
        """The copy's own time on the side stream (after :meth:`wait`); None unless timed."""
        if self.started is None:
            return None
        return float(self.started.elapsed_time(self.done)) / 1e3


class DeviceCopy:
    """The side stream and pinned buffer of one rank's snapshots on CUDA ``device`` (see the module
    docstring for the protocol). ``allocate`` replaces the pinned allocation (tests); ``timing``
    records a start event too, for :meth:`StagedCopy.seconds`."""

    def __init__(self, device: torch.device, allocate: Allocate | None = None, timing: bool = False) -> None:
        if device.type != "cuda":
            raise ValueError(f"DeviceCopy needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.host = HostBuffer(allocate or pinned_bytes)
        self.timing = timing
        self._stream: Any = None  # created by the first snapshot, on self.device

    @property
    def stream(self) -> Any:
        """The side stream (created on first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    @contextlib.contextmanager
    def on_device(self) -> Iterator[None]:
        """The rank's device as the current one (on the snapshot thread, whose default is device 0)."""
        with torch.cuda.device(self.device):
            yield

    def committed(self) -> Any:
        """Step 1, main thread: an event after everything queued so far on the compute stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def stage(self, tensors: list[torch.Tensor], layout: Layout, nbytes: int, committed: Any) -> StagedCopy:
        """Step 2, snapshot thread: queue the copy of ``tensors`` (``layout``, ``nbytes`` in all)
        into the pinned buffer on the side stream, after ``committed``."""
        buffer = self.host.for_layout(layout, nbytes)
        stream = self.stream
        stream.wait_event(committed)
        started = None
        with torch.cuda.stream(stream):
            if self.timing:
                started = torch.cuda.Event(enable_timing=True)
                started.record(stream)
            # Temporaries (a non-contiguous or bool tensor's bytes) are allocated on the side
            # stream here, so the caching allocator reuses them only after these copies.
            copy_in_layout_order(buffer, tensors, non_blocking=True)
            done = torch.cuda.Event(enable_timing=self.timing)
            done.record(stream)
        return StagedCopy(buffer, done, nbytes, started)

    def order_compute_after(self, copy: StagedCopy) -> None:
        """Step 3, main thread before the next optimizer step: the compute stream waits for the
        copy (on the device; the main thread does not block)."""
        torch.cuda.current_stream(self.device).wait_event(copy.done)


__all__ = [
    "DeviceCopy",
    "HostBuffer",
    "StagedCopy",
    "byte_view",
    "copy_in_layout_order",
    "pinned_bytes",
    "plain_bytes",
]
