"""A node snapshot's device-to-host copy (snapshot_copy.py): the pinned buffer kept per layout, the
side stream's ordering (driven through stand-ins for torch.cuda, no GPU needed), the slot written
only once the copy is done, the RNG of the rank's own device; and, on a GPU, the same for real."""

from __future__ import annotations

import contextlib
import threading
from pathlib import Path

import pytest
import torch

from nanotron_recover.data_parallel.forward import snapshot_copy
from nanotron_recover.data_parallel.forward.snapshot_copy import (
    DeviceCopy,
    HostBuffer,
    StagedCopy,
    copy_in_layout_order,
    plain_bytes,
)
from nanotron_recover.data_parallel.forward.snapshots import NodeSnapshots
from nanotron_recover.engines.state import EngineState, rng_state

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def live_state(device: str | torch.device = "cpu") -> EngineState:
    tensors = {
        "param/w": torch.arange(1000, dtype=torch.float32, device=device),
        "param/b16": torch.linspace(-1, 1, 7, device=device).to(torch.bfloat16),
        "exp_avg/w": torch.full((3, 5), 0.5, device=device),
        "mask": torch.tensor([True, False, True], device=device),
        "empty": torch.zeros(0, device=device),
        "zeros_on_host": torch.zeros(4),  # AdamW's moments before the first step are CPU zeros
    }
    return EngineState(tensors, {"step": 1})


def file_bytes(state: EngineState) -> bytes:
    """What ``state.bin`` holds: every tensor's bytes in order."""
    return b"".join(snapshot_copy.byte_view(t).cpu().numpy().tobytes() for t in state.tensors.values())


def store(root: Path, **kw) -> NodeSnapshots:
    return NodeSnapshots(root, "run-a", "tp1pp1", coordinate=0, replica=0, **kw)


# -- the buffer ------------------------------------------------------------------------------------
def test_the_host_buffer_is_allocated_once_per_layout_and_reused():
    taken: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        taken.append(nbytes)
        return plain_bytes(nbytes)  # stands for the pinned allocation

    host = HostBuffer(allocate)
    state = live_state()
    first = host.for_layout(state.layout(), state.nbytes())
    for _ in range(3):  # every step of a run: the same layout, the same memory
        again = host.for_layout(live_state().layout(), state.nbytes())
        assert again.data_ptr() == first.data_ptr()
    assert host.allocations == 1 and taken == [state.nbytes()]

    grown = EngineState({**state.tensors, "param/extra": torch.ones(10)}, {})
    other = host.for_layout(grown.layout(), grown.nbytes())  # a new layout: a new buffer
    assert other.numel() == grown.nbytes() and host.allocations == 2
    renamed = EngineState({"param/v" if k == "param/w" else k: t for k, t in grown.tensors.items()}, {})
    host.for_layout(renamed.layout(), renamed.nbytes())  # same bytes, other names: re-allocated too
    assert host.allocations == 3 and taken == [state.nbytes(), grown.nbytes(), grown.nbytes()]


def test_the_bytes_go_in_layout_order_as_in_state_bin():
    state = live_state()
    dst = plain_bytes(state.nbytes())
    assert copy_in_layout_order(dst, list(state.tensors.values())) == state.nbytes()
    assert dst.numpy().tobytes() == file_bytes(state)


# -- the side stream's protocol, through stand-ins for torch.cuda ----------------------------------
class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        self.name = f"event{FakeEvent.made}"
        FakeEvent.made += 1

    made = 0

    def record(self, stream: FakeStream) -> None:
        stream.log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        pass


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda stand-ins that log what DeviceCopy asks of streams and events; a copy logs
    which stream was current."""
    log: list = []
    compute = FakeStream("compute", log)
    current = [compute]
    made: list[FakeStream] = []

    @contextlib.contextmanager
    def use(stream: FakeStream):
        current.insert(0, stream)
        yield
        current.pop(0)

    def new_stream(device=None) -> FakeStream:
        made.append(FakeStream("side", log))
        return made[-1]

    FakeEvent.made = 0
    monkeypatch.setattr(torch.cuda, "Stream", new_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    plain_copy = snapshot_copy.copy_in_layout_order

    def logged_copy(dst, tensors, non_blocking=False):
        log.append(("copy", current[0].name, non_blocking))
        return plain_copy(dst, tensors, non_blocking)

    monkeypatch.setattr(snapshot_copy, "copy_in_layout_order", logged_copy)
    return log, made


def test_the_copy_runs_on_a_side_stream_after_the_commit_and_before_the_next_optimizer_step(fake_cuda):
    log, made = fake_cuda
    copier = DeviceCopy(torch.device("cuda", 0), allocate=plain_bytes)
    state = live_state()
    committed = copier.committed()  # main thread, after the optimizer step
    staged = copier.stage(list(state.tensors.values()), state.layout(), state.nbytes(), committed)
    copier.order_compute_after(staged)  # main thread, before the next optimizer step
    assert log == [
        ("record", "event0", "compute"),  # committed: after the compute stream's work so far
        ("wait_event", "side", "event0"),  # the copy waits for it...
        ("copy", "side", True),  # ...runs on the side stream, asynchronously...
        ("record", "event1", "side"),  # ...and says when it is done
        ("wait_event", "compute", "event1"),  # the optimizer's kernels wait for that, on the device
    ]
    assert staged.buffer.numpy().tobytes() == file_bytes(state)
    log.clear()
    again = copier.stage(list(state.tensors.values()), state.layout(), state.nbytes(), committed)
    assert again.buffer.data_ptr() == staged.buffer.data_ptr() and copier.host.allocations == 1
    assert len(made) == 1, "one side stream per rank, made once"
    with pytest.raises(ValueError):
        DeviceCopy(torch.device("cpu"))


class DeferredCopy(DeviceCopy):
    """A copier whose copies land only when their event is synchronized (a side stream as late as
    it may be), with the stream calls logged: the slot must be written after the wait, and the
    compute stream ordered after the copy before the next optimizer step."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, allocate=plain_bytes)
        self.log: list[str] = []

    def on_device(self):
        return contextlib.nullcontext()

    def committed(self):
        self.log.append("committed")
        return "committed"

    def stage(self, tensors, layout, nbytes, committed):
        assert committed == "committed"
        buffer = self.host.for_layout(layout, nbytes)
        buffer.fill_(0xEE)  # garbage until the copy lands
        sources = [t.clone() for t in tensors]  # what the committed step held
        log = self.log

        class Done:
            def synchronize(self) -> None:
                log.append("synchronize")
                copy_in_layout_order(buffer, sources)

        self.log.append("staged")
        return StagedCopy(buffer, Done(), nbytes)

    def order_compute_after(self, copy):
        self.log.append("compute waits")


def test_the_slot_is_written_from_the_pinned_buffer_only_once_the_copy_is_done(tmp_path):
    snaps = store(tmp_path)
    cuda = torch.device("cuda", 0)
    snaps.copier = copier = DeferredCopy(cuda)
    state = live_state()
    snaps.write(1, lambda: state, device=cuda)
    snaps.wait_exported()
    for t in state.tensors.values():  # the next optimizer step, ordered after the copy
        if t.dtype.is_floating_point:
            t.add_(100)
    snaps.wait()
    assert snaps.error is None, snaps.error
    # The thread's wait and the main thread's ordering race; each is in its place.
    assert [e for e in copier.log if e != "compute waits"] == ["committed", "staged", "synchronize"]
    assert copier.log.index("compute waits") > copier.log.index("staged")
    got = snaps.load(1)
    assert file_bytes(got) == file_bytes(live_state())
    snaps.write(2, lambda: live_state(), device=cuda)
    snaps.wait()
    assert snaps.copier is copier and copier.host.allocations == 1  # kept across steps
    # On CPU nothing of this: no copier, no stream.
    plain = store(tmp_path / "cpu")
    plain.write(1, lambda: live_state(), device=torch.device("cpu"))
    plain.wait_exported()
    plain.wait()
    assert plain.error is None and plain.copier is None and plain.last_copy is None


def test_the_cuda_rng_state_is_the_ranks_device_not_the_current_one(monkeypatch):
    asked: list = []

    def get_rng_state(device="cuda"):
        asked.append(device)
        return torch.tensor([7], dtype=torch.uint8)

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    assert rng_state(torch.device("cuda", 3))["cuda"] == bytes([7])
    assert asked == [torch.device("cuda", 3)]


# -- on a GPU ----------------------------------------------------------------------------------------
@CUDA
def test_cuda_snapshot_equals_the_committed_state_and_the_next_step_does_not_reach_it(tmp_path):
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.set_device(device)
    snaps = store(tmp_path)
    live = {
        "param/w": torch.randn(4_000_000, device=device),
        "param/b16": torch.randn(1001, device=device).to(torch.bfloat16),
        "mask": torch.rand(33, device=device) > 0.5,
        "exp_avg/host": torch.zeros(5),
    }
    for step in (1, 2, 3):
        for _ in range(200):  # a long tail of work queued on the compute stream: the copy waits for it
            live["param/w"].mul_(1.0001).add_(0.5)
        snaps.write(step, lambda step=step: EngineState(dict(live), {"step": step}), device=device)
        snaps.wait_exported()
        expected = {k: v.cpu() for k, v in live.items()}  # the committed state (the compute stream's)
        live["param/w"].add_(1000.0)  # the next optimizer step, on the compute stream
        live["param/b16"].add_(1000.0)
        snaps.wait()
        assert snaps.error is None, snaps.error
        got = snaps.load(step)
        for name, value in expected.items():
            assert torch.equal(got.tensors[name], value), (step, name)
    copier = snaps.copier
    assert copier is not None and copier.device == device
    assert copier.stream != torch.cuda.default_stream(device), "the copy is not on the default stream"
    assert copier.host.buffer is not None and copier.host.buffer.is_pinned()
    assert copier.host.allocations == 1
    assert snaps.last_copy is not None and snaps.last_copy.done.query()


@CUDA
def test_cuda_the_copy_runs_on_the_side_stream_while_the_compute_stream_is_busy():
    device = torch.device("cuda", 0)
    copier = DeviceCopy(device, timing=True)
    state = EngineState({"w": torch.ones(16_000_000, device=device)}, {})
    tensors = list(state.tensors.values())
    copier.stage(tensors, state.layout(), state.nbytes(), copier.committed()).wait()  # buffer, stream
    a = torch.randn(4096, 4096, device=device)
    committed = copier.committed()
    busy_start = torch.cuda.Event(enable_timing=True)
    busy_start.record()
    for _ in range(30):  # compute queued after the commit: the copy need not wait for it
        a = a @ a
        a = a / a.norm()
    busy_end = torch.cuda.Event(enable_timing=True)
    busy_end.record()
    staged = copier.stage(tensors, state.layout(), state.nbytes(), committed)
    staged.wait()
    torch.cuda.synchronize(device)
    assert staged.seconds() is not None and staged.seconds() > 0
    # The copy finished before the compute queued ahead of it on the other stream did.
    assert busy_start.elapsed_time(staged.done) < busy_start.elapsed_time(busy_end)
    assert torch.equal(staged.buffer.view(torch.float32), torch.ones(16_000_000))


@CUDA
def test_cuda_rng_state_of_the_ranks_device_read_on_another_thread():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.default_generators[device.index].manual_seed(1234)
    if device.index:
        torch.cuda.default_generators[0].manual_seed(99)
    got: dict = {}
    thread = threading.Thread(target=lambda: got.update(rng_state(device)))  # current device: 0
    thread.start()
    thread.join()
    assert got["cuda"] == torch.cuda.get_rng_state(device).numpy().tobytes()
    if device.index:
        assert got["cuda"] != torch.cuda.get_rng_state(0).numpy().tobytes()
