"""Node-memory snapshots: published only when complete, two slots, a torn write keeps the newest."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from nanotron_recover.data_parallel.forward.snapshots import NodeSnapshots, SnapshotSkipped
from nanotron_recover.engines.state import EngineState


def state_of(step: int, numel: int = 1000) -> EngineState:
    g = torch.Generator().manual_seed(step)
    tensors = {
        "param/w": torch.randn(numel, generator=g),
        "param/b16": torch.randn(7, generator=g).to(torch.bfloat16),
        "opt/step": torch.tensor([step], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0),
    }
    return EngineState(tensors, {"rng": {"cpu": bytes([step % 256])}, "step": step})


def assert_same(a: EngineState, b: EngineState) -> None:
    assert list(a.tensors) == list(b.tensors)
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        assert torch.equal(a.tensors[name], b.tensors[name]), name
    assert a.meta == b.meta


def store(root: Path, replica: int = 0, **kw) -> NodeSnapshots:
    return NodeSnapshots(root, "run-a", "tp1pp1", coordinate=0, replica=replica, **kw)


def test_round_trip_and_two_slots(tmp_path):
    snaps = store(tmp_path)
    for step in (1, 2, 3):
        snaps.write(step, lambda step=step: state_of(step))
        snaps.wait()
        assert snaps.error is None
    assert [p.step for p in snaps.available()] == [3, 2]  # the two newest, one per slot
    assert_same(snaps.load(3), state_of(3))
    assert_same(snaps.load(2), state_of(2))
    with pytest.raises(FileNotFoundError, match="no snapshot of step 1"):
        snaps.load(1)


def test_another_replicas_snapshot_of_the_coordinate_is_found(tmp_path):
    store(tmp_path, replica=1).write(5, lambda: state_of(5), asynchronous=False)
    reader = store(tmp_path, replica=3)
    assert [(p.step, p.replica) for p in reader.available()] == [(5, 1)]
    assert_same(reader.load(5), state_of(5))


def test_other_run_or_layout_is_never_read(tmp_path):
    store(tmp_path).write(4, lambda: state_of(4), asynchronous=False)
    assert NodeSnapshots(tmp_path, "run-b", "tp1pp1", 0, 0).available() == []
    assert NodeSnapshots(tmp_path, "run-a", "tp2pp1", 0, 0).available() == []
    assert NodeSnapshots(tmp_path, "run-a", "tp1pp1", 1, 0).available() == []


def test_cap_and_export_errors_are_reported_not_raised(tmp_path):
    snaps = store(tmp_path, max_bytes=100)
    snaps.write(1, lambda: state_of(1))
    snaps.wait()
    assert isinstance(snaps.error, SnapshotSkipped) and "recover.snapshot.max_mb" in str(snaps.error)
    assert snaps.available() == []

    def broken() -> EngineState:
        raise RuntimeError("export failed")

    snaps = store(tmp_path)
    snaps.write(2, broken)
    snaps.wait_exported()  # never blocks forever on a failed export
    snaps.wait()
    assert isinstance(snaps.error, RuntimeError)


def test_export_is_waited_for_before_the_state_changes(tmp_path):
    live = torch.zeros(1000)
    snaps = store(tmp_path)

    def export() -> EngineState:
        time.sleep(0.3)  # a slow copy
        return EngineState({"w": live.clone()}, {})

    snaps.write(1, export)
    snaps.wait_exported()
    live.fill_(7.0)  # the next optimizer step
    snaps.wait()
    assert torch.equal(snaps.load(1).tensors["w"], torch.zeros(1000))


def test_write_killed_from_outside_keeps_the_previous_snapshot(tmp_path):
    """SIGKILL a process in the middle of writing a large snapshot: the step before stays readable,
    the torn one is never listed."""
    small = store(tmp_path)
    small.write(1, lambda: state_of(1), asynchronous=False)
    small.write(2, lambda: state_of(2), asynchronous=False)
    # The writer is slowed down (a pause after each of its 40 tensors) so that the kill lands in
    # the middle of the write on a busy machine too; when it lands is not the writer's choice.
    code = textwrap.dedent(
        f"""
        import time, torch
        from nanotron_recover.data_parallel.forward import snapshots
        from nanotron_recover.engines.state import EngineState
        plain = snapshots._byte_view
        snapshots._byte_view = lambda t: (time.sleep(0.05), plain(t))[1]
        big = EngineState({{f"param/{{k}}": torch.ones(250_000) for k in range(40)}}, {{}})
        print("writing", flush=True)
        snapshots.NodeSnapshots({str(tmp_path)!r}, "run-a", "tp1pp1", 0, 0).write(3, lambda: big, asynchronous=False)
        print("published", flush=True)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        torn = tmp_path / "run-a" / "c0" / "r0" / "slot0" / "state.bin"  # the older slot (step 1)
        deadline = time.monotonic() + 60
        while not (torn.exists() and torn.stat().st_size > 4096) and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert [p.step for p in small.available()] == [2]
    assert_same(small.load(2), state_of(2))


def test_remove_run(tmp_path):
    snaps = store(tmp_path)
    snaps.write(1, lambda: state_of(1), asynchronous=False)
    snaps.remove_run()
    assert snaps.available() == [] and not (tmp_path / "run-a").exists()


def test_live_tensors_are_copied_before_the_state_may_change_and_each_slot_file_is_kept(tmp_path):
    """The snapshot may be handed the live tensors (``export_state(copy=False)``): once
    ``wait_exported`` returns, changing them (the next optimizer step) no longer reaches the
    snapshot."""
    live = {"param/w": torch.arange(1000, dtype=torch.float32), "exp_avg/w": torch.ones(1000)}
    snaps = store(tmp_path)
    for step in (1, 2, 3):
        snaps.write(step, lambda step=step: EngineState(live, {"step": step}))
        snaps.wait_exported()
        for t in live.values():
            t.add_(100.0)
        snaps.wait()
        assert snaps.error is None
    assert [p.step for p in snaps.available()] == [3, 2]
    for step in (2, 3):
        got = snaps.load(step)
        assert torch.equal(got.tensors["param/w"], torch.arange(1000, dtype=torch.float32) + 100 * (step - 1))
        assert torch.equal(got.tensors["exp_avg/w"], torch.ones(1000) + 100 * (step - 1))


TINY_TMPFS_WRITER = textwrap.dedent(
    """
    import os, sys, torch
    from nanotron_recover.data_parallel.forward import snapshots
    from nanotron_recover.engines.state import EngineState
    root = sys.argv[1]
    store = snapshots.NodeSnapshots(root, "run-a", "tp1pp1", 0, 0)
    small = EngineState({"param/w": torch.full((1000,), 1.0)}, {})
    large = EngineState({"param/w": torch.full((2_000_000,), 2.0)}, {})  # 8 MB into 1 MiB
    store.write(1, lambda: small, asynchronous=False)
    store.write(2, lambda: large, asynchronous=False)
    print("statvfs:", type(store.error).__name__, store.error, flush=True)
    # Room that statvfs promised but is gone by the time the pages are taken (another writer on
    # the node): the reservation itself must turn it into a skip.
    plenty = os.statvfs_result((4096, 4096, 1 << 30, 1 << 30, 1 << 30, 0, 0, 0, 0, 255))
    snapshots.os.statvfs = lambda path: plenty
    store.write(3, lambda: large, asynchronous=False)
    print("fallocate:", type(store.error).__name__, store.error, flush=True)
    snapshots.os.statvfs = os.statvfs
    store.write(4, lambda: small, asynchronous=False)
    print("steps:", [p.step for p in store.available()], store.error, flush=True)
    print("loaded:", float(store.load(4).tensors["param/w"].sum()), flush=True)
    """
)


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a private tmpfs"
)
def test_a_tmpfs_too_small_skips_the_snapshot_instead_of_killing_the_rank(tmp_path):
    """A container's /dev/shm is 64 MiB: a slot larger than the room left must be a skipped
    snapshot with a warning. Written through a sparse mapping it was a SIGBUS that killed the rank
    at step 1. Here a 1 MiB tmpfs, mounted in a mount namespace of the test's own, takes an 8 MB
    state."""
    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "writer.py").write_text(TINY_TMPFS_WRITER)
    proc = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"mount -t tmpfs -o size=1m tmpfs {shm} && exec {sys.executable} {tmp_path / 'writer.py'} {shm}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)  # -7 / 135: SIGBUS
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert lines["statvfs"].startswith("SnapshotSkipped node snapshot skipped: it needs 7.6 MiB"), lines
    assert lines["fallocate"].startswith("SnapshotSkipped node snapshot skipped: could not reserve"), lines
    # The failed reservations hold no pages: the small snapshot fits again beside step 1.
    assert lines["steps"] == "[4, 1] None", lines
    assert lines["loaded"] == "1000.0", lines
