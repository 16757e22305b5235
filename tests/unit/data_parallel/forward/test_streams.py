"""The side-stream protocol of asynchronous restores: the deferred host stand-in used by the bucket
tests, and CudaStreams' ordering driven through stand-ins for torch.cuda (no GPU needed)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from nanotron_recover.data_parallel.forward.streams import CudaStreams, DeferredEvent, DeferredStreams


def test_deferred_side_work_runs_only_when_waited_on_in_order():
    streams = DeferredStreams(lambda t: True)
    log: list[str] = []
    first = streams.side(lambda: log.append("a"))
    second = streams.side(lambda: log.append("b"))
    assert log == [] and not first.ran
    streams.wait(second)  # a stream is FIFO: waiting on the second runs the first too
    assert log == ["a", "b"] and first.ran and second.ran
    streams.wait(first)
    streams.wait(second)
    assert log == ["a", "b"] and streams.waits == 1, "waiting again runs nothing"


def test_deferred_rejects_host_tensors_to_keep_alive_like_record_stream():
    streams = DeferredStreams(lambda t: t.dtype == torch.float32)
    device, host = torch.zeros(2), torch.zeros(2, dtype=torch.float64)
    streams.side(lambda: None, keep_alive=[device])
    assert streams.kept == [device]
    with pytest.raises(NotImplementedError):
        streams.side(lambda: None, keep_alive=[device, host])
    assert streams.owns(device) and not streams.owns(host)


def test_deferred_synchronize_runs_everything_and_rejects_foreign_events():
    streams = DeferredStreams(lambda t: True)
    out = torch.zeros(1)
    streams.side(lambda: out.add_(1))
    streams.side(lambda: out.add_(2))
    streams.synchronize()
    assert out.item() == 3 and streams.pending == []
    with pytest.raises(TypeError):
        streams.wait(object())


class FakeEvent:
    pass


class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def record_event(self) -> FakeEvent:
        self.log.append(("record_event", self.name))
        return FakeEvent()

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name))


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda stand-ins that log what CudaStreams asks of the streams."""
    log: list = []
    compute = FakeStream("compute", log)
    current = [compute]

    @contextlib.contextmanager
    def use(stream: FakeStream):
        log.append(("enter", stream.name))
        current.insert(0, stream)
        yield
        current.pop(0)
        log.append(("exit", stream.name))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream("side", log))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)

    def record_stream(tensor, stream):
        raise AssertionError(f"record_stream on a {tensor.device} tensor")

    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    return log


def test_cuda_side_work_is_queued_after_the_compute_stream_and_waited_on(fake_cuda):
    streams = CudaStreams(torch.device("cuda", 0))
    event = streams.side(lambda: fake_cuda.append(("work",)))
    streams.wait(event)
    assert fake_cuda == [
        ("wait_stream", "side", "compute"),  # after everything already queued for compute
        ("enter", "side"),
        ("work",),
        ("exit", "side"),
        ("record_event", "side"),  # completes when the work queued on the side stream has run
        ("wait_event", "compute"),
    ]
    with pytest.raises(TypeError):
        streams.wait(DeferredEvent(lambda: None))


def test_cuda_streams_refuse_a_host_tensor_before_any_record_stream(fake_cuda):
    streams = CudaStreams(torch.device("cuda", 0))
    assert not streams.owns(torch.zeros(1))
    with pytest.raises(ValueError, match="kept alive"):
        streams.side(lambda: None, keep_alive=[torch.zeros(1, dtype=torch.float64)])
    assert fake_cuda == [], "nothing queued, no record_stream"
    with pytest.raises(ValueError):
        CudaStreams(torch.device("cpu"))
