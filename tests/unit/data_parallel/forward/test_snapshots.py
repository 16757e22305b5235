"""Node-memory snapshots: published only when complete, two slots, a torn write keeps the newest;
a folder private to its user, metadata in JSON, restored through a mapping."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from nanotron_recover.config import SnapshotArgs
from nanotron_recover.data_parallel.forward import snapshots as snapshots_module
from nanotron_recover.data_parallel.forward.snapshots import (
    NodeSnapshots,
    SnapshotDirRefused,
    SnapshotSkipped,
    decode_meta,
    encode_meta,
)
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


def test_a_store_holds_nothing_more_after_many_snapshots_than_after_a_few(tmp_path):
    """A snapshot is written every step of a run that may last millions of steps: nothing the
    store keeps may grow with the number of snapshots it wrote."""

    def sizes(snaps: NodeSnapshots) -> dict[str, int]:
        return {k: len(v) for k, v in vars(snaps).items() if isinstance(v, (list, dict, set, tuple))}

    snaps = store(tmp_path)
    for step in range(1, 4):
        snaps.write(step, lambda step=step: state_of(step, numel=10))
        snaps.wait()
    few = sizes(snaps)
    for step in range(4, 60):
        snaps.write(step, lambda step=step: state_of(step, numel=10))
        snaps.wait()
    assert snaps.error is None and (snaps.published, snaps.last_published) == (59, 59)
    assert sizes(snaps) == few


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
    removed = snaps.remove_run()
    assert snaps.available() == [] and not (tmp_path / "run-a").exists()
    assert removed.path == tmp_path / "run-a" and removed.files == 3 and removed.errors == ()


# -- removal: without a live store, only inside the private folder -----------------------------------
def test_a_run_is_removed_from_its_id_alone_every_replica_and_coordinate(tmp_path):
    """What ``snapshots clean`` and the job script's last step do: every slot of the run on this
    host (any replica, coordinate or generation), nothing of another run; bytes as allocated."""
    for replica in (0, 1):
        for coordinate in (0, 1):
            w = NodeSnapshots(tmp_path, "run-a", "tp1pp1", coordinate=coordinate, replica=replica)
            w.write(1, lambda: state_of(1), asynchronous=False)
            w.write(2, lambda: state_of(2), asynchronous=False)
    other = store(tmp_path)
    other.run_root = tmp_path / "run-b"
    other.write(1, lambda: state_of(1), asynchronous=False)
    held = sum(f.lstat().st_blocks * 512 for f in (tmp_path / "run-a").rglob("*") if f.is_file())

    removed = snapshots_module.remove_run_snapshots(tmp_path, "run-a")

    assert removed == snapshots_module.Removed(tmp_path / "run-a", 4 * 2 * 3, held)
    assert removed.nbytes >= 8 * state_of(1).nbytes()
    assert not (tmp_path / "run-a").exists() and [p.step for p in other.available()] == [1]
    again = snapshots_module.remove_run_snapshots(tmp_path, "run-a")  # nothing left: not an error
    assert (again.files, again.nbytes, again.errors) == (0, 0, ())


def test_removal_names_nothing_outside_the_private_folder_and_follows_no_link(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_bytes(b"x" * 5000)
    root = tmp_path / "shm"
    for bad in ("", ".", "..", "../victim", "a/b"):
        with pytest.raises(ValueError, match="is not a run id"):
            snapshots_module.remove_run_snapshots(root, bad)
    # A missing folder removes nothing and is not created.
    assert snapshots_module.remove_run_snapshots(root, "run-a").files == 0 and not root.exists()
    # A link in a run's place is removed itself; a link inside a run is removed, not followed.
    root.mkdir(mode=0o700)
    (root / "run-a").symlink_to(victim)
    assert snapshots_module.remove_run_snapshots(root, "run-a").files == 1
    store(root).write(1, lambda: state_of(1), asynchronous=False)
    (root / "run-a" / "c0" / "link").symlink_to(victim)
    (root / "run-a" / "c0" / "file-link").symlink_to(victim / "precious")
    assert snapshots_module.remove_run_snapshots(root, "run-a").files == 5
    assert not (root / "run-a").exists() and (victim / "precious").read_bytes() == b"x" * 5000
    # A folder that is a link (or not ours) is refused as a whole: nothing behind it is touched.
    store(victim).write(1, lambda: state_of(1), asynchronous=False)
    (tmp_path / "linked").symlink_to(victim)
    with pytest.raises(SnapshotDirRefused, match="is a symlink"):
        snapshots_module.remove_run_snapshots(tmp_path / "linked", "run-a")
    assert (victim / "run-a").is_dir() and (victim / "precious").exists()


def test_a_process_fenced_off_the_job_touches_no_slot_and_removes_nothing(tmp_path):
    """An older generation's process (``may_publish`` False) on a node where the newer one keeps its
    snapshots: its write skips before a slot's ``published.json`` is removed or its ``state.bin``
    written, and its end removes nothing."""
    current = store(tmp_path)
    current.write(1, lambda: state_of(1), asynchronous=False)
    current.write(2, lambda: state_of(2), asynchronous=False)
    slots = sorted((tmp_path / "run-a").rglob("*"))
    before = [(p, p.stat().st_mtime_ns, p.stat().st_size) for p in slots]
    fenced = store(tmp_path, may_publish=lambda: False)

    fenced.write(3, lambda: state_of(3), asynchronous=False)

    assert isinstance(fenced.error, snapshots_module.SnapshotFenced)
    assert isinstance(fenced.error, SnapshotSkipped) and "no longer belongs to the job" in str(fenced.error)
    assert [
        (p, p.stat().st_mtime_ns, p.stat().st_size) for p in sorted((tmp_path / "run-a").rglob("*"))
    ] == before
    assert [p.step for p in current.available()] == [2, 1]
    assert fenced.remove_run() is None
    assert [p.step for p in current.available()] == [2, 1]


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
    # A cap of its own (1 TiB): the default one (half the folder) would skip the large state before
    # its room is checked; the room checks are what this writer is about.
    store = snapshots.NodeSnapshots(root, "run-a", "tp1pp1", 0, 0, max_bytes=1 << 40)
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


def run_in_private_tmpfs(tmp_path: Path, size: str, script: str, **env: str) -> subprocess.CompletedProcess:
    """Run ``script`` (given the folder as its argument) on a tmpfs of ``size`` mounted in a mount
    namespace of its own: nothing outside the test sees it, and it goes with the process."""
    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "writer.py").write_text(script)
    mount = (
        f"mount -t tmpfs -o size={size} tmpfs {shm} && exec {sys.executable} {tmp_path / 'writer.py'} {shm}"
    )
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **env),
    )


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a private tmpfs"
)
def test_a_tmpfs_too_small_skips_the_snapshot_instead_of_killing_the_rank(tmp_path):
    """A container's /dev/shm is 64 MiB: a slot larger than the room left must be a skipped
    snapshot with a warning. Written through a sparse mapping it was a SIGBUS that killed the rank
    at step 1. Here a 1 MiB tmpfs, mounted in a mount namespace of the test's own, takes an 8 MB
    state."""
    proc = run_in_private_tmpfs(tmp_path, "1m", TINY_TMPFS_WRITER)
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)  # -7 / 135: SIGBUS
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert lines["statvfs"].startswith("SnapshotSkipped node snapshot skipped: it needs 7.6 MiB"), lines
    assert lines["fallocate"].startswith("SnapshotSkipped node snapshot skipped: could not reserve"), lines
    # The failed reservations hold no pages: the small snapshot fits again beside step 1.
    assert lines["steps"] == "[4, 1] None", lines
    assert lines["loaded"] == "1000.0", lines


DEFAULT_CAP_WRITER = textwrap.dedent(
    """
    import os, sys, torch
    from nanotron_recover.data_parallel.forward import snapshots
    from nanotron_recover.engines.state import EngineState
    root = sys.argv[1]
    def state(mib):
        return EngineState({"param/w": torch.full((int(mib * 2**18),), 1.0)}, {})
    # Two ranks of this node (mpirun's variable): each may take 2 slots of a quarter of half the room.
    store = snapshots.NodeSnapshots(root, "run-a", "tp1pp1", 0, 0)
    print("ranks:", store.ranks_per_node, flush=True)
    store.write(1, lambda: state(1.5), asynchronous=False)  # 2 x 2 x 1.5 MiB = 6 MiB > 4 MiB
    print("large:", type(store.error).__name__, store.error, flush=True)
    store.write(2, lambda: state(1.5), asynchronous=False)
    print("again:", type(store.error).__name__, store.error, flush=True)
    store.write(3, lambda: state(0.75), asynchronous=False)  # 2 x 2 x 0.75 MiB = 3 MiB: fits
    print("small:", [p.step for p in store.available()], store.error, flush=True)
    capped = snapshots.NodeSnapshots(root, "run-a", "tp1pp1", 1, 0, max_bytes=2 * 2**20)
    capped.write(4, lambda: state(1.5), asynchronous=False)  # a cap of its own: the default is off
    print("own cap:", [p.step for p in capped.available()], capped.error, flush=True)
    """
)


@pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare for a private tmpfs"
)
def test_without_max_mb_a_snapshot_over_half_the_tmpfs_for_the_node_is_skipped(tmp_path):
    """recover.snapshot.max_mb unset: on an 8 MiB tmpfs with two ranks on the node, a 1.5 MiB state
    (two slots per rank: 6 MiB in all) is over half the room and skipped, with the same message at
    every step (warned once); a 0.75 MiB state is written; a cap of one's own replaces the default."""
    proc = run_in_private_tmpfs(tmp_path, "8m", DEFAULT_CAP_WRITER, OMPI_COMM_WORLD_LOCAL_SIZE="2")
    shm = tmp_path / "shm"
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert lines["ranks"] == "2", lines
    assert lines["large"].startswith(
        "SnapshotSkipped node snapshot skipped: 2 slots of 1.5 MiB x 2 ranks of this node need 6.0 MiB, "
        f"more than 50% of the 8.0 MiB free in {shm} (4.0 MiB) at the first snapshot"
    ), lines
    assert "recover.snapshot.max_mb" in lines["large"], lines
    assert lines["again"] == lines["large"], "the same reason at every step: warned once"
    assert lines["small"] == "[3] None", lines
    assert lines["own cap"] == "[4] None", lines


def test_the_default_cap_counts_the_node_s_ranks_and_the_run_s_own_slots(tmp_path, monkeypatch):
    """The room is measured once, at the first snapshot: the free space plus what this run's folder
    already holds (a relaunch reuses the previous generation's slots)."""
    mib = 2**20
    free = [64 * mib]

    def statvfs(path):
        return os.statvfs_result((4096, 4096, 1 << 20, free[0] // 4096, free[0] // 4096, 0, 0, 0, 0, 255))

    monkeypatch.setattr(snapshots_module.os, "statvfs", statvfs)
    state = EngineState({"param/w": torch.ones(2 * mib)}, {})  # 8 MiB
    # 4 ranks x 2 slots x 8 MiB = 64 MiB: more than half of 64 MiB.
    four = store(tmp_path, ranks_per_node=4)
    four.write(1, lambda: state, asynchronous=False)
    assert isinstance(four.error, SnapshotSkipped) and "64.0 MiB" in str(four.error), four.error
    assert four.default_cap == (4 * mib, four.default_cap[1])
    # 2 ranks: 32 MiB, written.
    two = store(tmp_path, ranks_per_node=2)
    two.write(1, lambda: state, asynchronous=False)
    assert two.error is None and [p.step for p in two.available()] == [1]
    # A relaunch (a new process) finds 16 MiB free but 8 MiB of this run's own slot: 24 MiB of room,
    # 12 MiB for the node: 1.5 MiB a slot at 4 ranks, which the 8 MiB state exceeds...
    free[0] = 16 * mib
    relaunched = store(tmp_path, ranks_per_node=4)
    relaunched.write(2, lambda: state, asynchronous=False)
    assert isinstance(relaunched.error, SnapshotSkipped)
    assert f"of the 24.0 MiB free in {tmp_path}" in str(relaunched.error), relaunched.error
    # ...and decided once: more room later does not change the cap nor the message.
    message = str(relaunched.error)
    free[0] = 1 << 40
    relaunched.write(3, lambda: state, asynchronous=False)
    assert str(relaunched.error) == message
    assert snapshots_module.node_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}) == 8
    assert snapshots_module.node_ranks({"LOCAL_WORLD_SIZE": "3"}) == 3
    assert snapshots_module.node_ranks({"OMPI_COMM_WORLD_LOCAL_SIZE": "x"}) == 1
    assert snapshots_module.node_ranks({}) == 1


# -- a folder private to its user ------------------------------------------------------------------
def test_the_default_folder_is_per_user_and_created_private(tmp_path):
    assert SnapshotArgs().dir == f"/dev/shm/nanotron-recover-{os.getuid()}"
    assert SnapshotArgs(dir="/x/snaps-{uid}/y").dir == f"/x/snaps-{os.getuid()}/y"
    snaps = store(tmp_path / "shm-{uid}")
    snaps.write(1, lambda: state_of(1), asynchronous=False)
    root = tmp_path / f"shm-{os.getuid()}"
    assert snaps.root == root and snaps.error is None
    st = os.lstat(root)
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    slot = root / "run-a" / "c0" / "r0" / "slot0"
    for name in ("state.bin", "meta.json", "published.json"):
        assert stat.S_IMODE(os.lstat(slot / name).st_mode) == 0o600, name


def test_a_folder_of_ours_left_open_is_made_private_again(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    os.chmod(root, 0o755)  # created by an older version, or by hand
    store(root).write(1, lambda: state_of(1), asynchronous=False)
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o700
    assert [p.step for p in store(root).available()] == [1]


def assert_refused(snaps: NodeSnapshots, why: str) -> None:
    """The write is a skipped snapshot (reported, not raised: the rank trains on) and nothing is
    read from the folder either."""
    snaps.write(1, lambda: state_of(1))
    snaps.wait()
    assert isinstance(snaps.error, SnapshotDirRefused) and isinstance(snaps.error, SnapshotSkipped)
    message = str(snaps.error)
    assert "\n" not in message and why in message and "recover.snapshot.dir" in message, message
    assert snaps.available() == [] and snaps.refused is not None
    with pytest.raises(FileNotFoundError):
        snaps.load(1)


def test_a_symlinked_folder_is_refused_and_never_written_through(tmp_path):
    elsewhere = tmp_path / "someone-elses"
    elsewhere.mkdir(mode=0o700)
    store(elsewhere).write(3, lambda: state_of(3), asynchronous=False)  # a snapshot behind the link
    before = sorted((p, p.stat().st_mtime_ns) for p in elsewhere.rglob("*"))
    (tmp_path / "shm").symlink_to(elsewhere)
    snaps = store(tmp_path / "shm")
    assert_refused(snaps, "is a symlink")
    snaps.remove_run()  # removes nothing through the link either
    assert sorted((p, p.stat().st_mtime_ns) for p in elsewhere.rglob("*")) == before


def test_a_folder_of_another_user_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "shm"
    root.mkdir(mode=0o700)  # owned by this test's uid; the store below runs as another one
    monkeypatch.setattr(os, "getuid", lambda: 4242)
    assert_refused(store(root), f"belongs to uid {os.stat(root).st_uid}, not to this user (uid 4242)")
    assert list(root.iterdir()) == []


def test_a_file_in_place_of_the_folder_and_an_open_parent_are_refused(tmp_path):
    (tmp_path / "file").write_text("")
    assert_refused(store(tmp_path / "file"), "not a directory")
    open_parent = tmp_path / "open"
    open_parent.mkdir()
    os.chmod(open_parent, 0o777)  # anyone may rename the folder away: no sticky bit
    if os.geteuid() == 0:
        os.chown(open_parent, 4242, -1)  # and it is not ours
        assert_refused(store(open_parent / "shm"), "writable by every user without the sticky bit")
    os.chmod(open_parent, 0o1777)  # like /dev/shm and /tmp
    snaps = store(open_parent / "shm")
    snaps.write(1, lambda: state_of(1), asynchronous=False)
    assert snaps.error is None and [p.step for p in snaps.available()] == [1]


def test_files_planted_as_symlinks_are_never_followed(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    snaps = store(tmp_path / "shm")
    snaps.write(1, lambda: state_of(1), asynchronous=False)
    slot0 = tmp_path / "shm" / "run-a" / "c0" / "r0" / "slot0"
    slot1 = slot0.parent / "slot1"
    slot1.mkdir()
    (slot1 / "state.bin").symlink_to(victim)
    snaps.write(2, lambda: state_of(2), asynchronous=False)  # into slot1: its state.bin is a link
    assert isinstance(snaps.error, OSError) and victim.read_bytes() == b"precious"
    (slot1 / "state.bin").unlink()
    (slot1 / "meta.json").symlink_to(victim)
    snaps.write(2, lambda: state_of(2), asynchronous=False)
    assert isinstance(snaps.error, OSError) and victim.read_bytes() == b"precious"
    # A published.json that is a link is no snapshot.
    (slot1 / "meta.json").unlink()
    published = json.loads((slot0 / "published.json").read_text())
    (slot0 / "published.json").unlink()
    victim.write_text(json.dumps(published))
    (slot0 / "published.json").symlink_to(victim)
    assert snaps.available() == []


# -- metadata: JSON, never pickle ------------------------------------------------------------------
def test_the_engine_meta_round_trips_through_json():
    meta = {
        "engine": "3d",
        "coordinate": "tp0-pp1",
        "optimizer": {
            "steps": {"w": 12.0, "b": None},
            "param_groups": [
                {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-5, "foreach": None, "fused": False}
            ],
        },
        "rng": {"cpu": bytes(range(256)) * 20, "cuda": b""},
        "odd": {1: "int key", "$x": "a key like a tag", (1, 2): [float("inf"), -0.0]},
        "tensor": torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
    }
    text = json.dumps(encode_meta(meta))
    back = decode_meta(json.loads(text))
    tensor = back.pop("tensor")
    assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, meta.pop("tensor"))
    assert back == meta
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.95)  # a tuple again
    assert math.copysign(1.0, back["odd"][(1, 2)][1]) == -1.0
    with pytest.raises(TypeError, match="cannot hold object"):
        encode_meta({"x": object()})
    for bad in ({"$eval": "x"}, {"$bytes": "not base64!"}, {"$tuple": [1], "extra": 2}, {"$tensor": {}}):
        with pytest.raises(ValueError):
            decode_meta(bad)


def test_meta_is_json_and_a_planted_pickle_is_never_loaded(tmp_path):
    snaps = store(tmp_path)
    snaps.write(1, lambda: state_of(1), asynchronous=False)
    slot = tmp_path / "run-a" / "c0" / "r0" / "slot0"
    assert not (slot / "meta.pkl").exists()
    saved = json.loads((slot / "meta.json").read_text())
    assert saved["layout"][1] == ["param/b16", [7], "bfloat16"]

    marker = tmp_path / "pickle-ran"

    class Payload:
        def __reduce__(self):
            return (marker.write_text, ("ran",))

    (slot / "meta.pkl").write_bytes(pickle.dumps(Payload()))
    assert_same(snaps.load(1), state_of(1))
    (slot / "meta.json").unlink()
    assert snaps.available() == []  # no JSON metadata: not a snapshot (the pickle is ignored)
    assert not marker.exists()


@pytest.mark.parametrize(
    "damage",
    [
        "not json{",
        json.dumps({"layout": "x"}),
        json.dumps({"layout": [["param/w", [999], "float32"]], "meta": {}}),  # bytes do not add up
        json.dumps({"layout": [["param/w", [1000], "complex128"]], "meta": {}}),
        json.dumps({"layout": [["w", ["1000"], "float32"]], "meta": {}}),
        json.dumps({"layout": [], "meta": {"$pickle": "gASV"}}),
    ],
)
def test_a_snapshot_whose_metadata_does_not_parse_is_skipped(tmp_path, damage):
    snaps = store(tmp_path)
    snaps.write(1, lambda: state_of(1), asynchronous=False)
    snaps.write(2, lambda: state_of(2), asynchronous=False)
    (tmp_path / "run-a" / "c0" / "r0" / "slot1" / "meta.json").write_text(damage)  # step 2's
    assert [p.step for p in snaps.available()] == [1]
    with pytest.raises(FileNotFoundError):
        snaps.load(2)


# -- two slots across generations ------------------------------------------------------------------
def test_after_a_relaunch_the_older_generations_slots_are_replaced_first(tmp_path):
    """Generation 0 published steps 9 and 10; generation 1 restarts from step 5 and redoes 6, 7, 8.
    Ordered by step alone, the stale step 10 stayed and every write replaced the previous good one
    ([10, 6], [10, 7], [10, 8]): a write torn then left no snapshot of generation 1."""
    gen0 = store(tmp_path, generation=0)
    for step in (9, 10):
        gen0.write(step, lambda step=step: state_of(step), asynchronous=False)
    gen1 = store(tmp_path, generation=1)
    seen = []
    for step in (6, 7, 8):
        gen1.write(step, lambda step=step: state_of(step), asynchronous=False)
        assert gen1.error is None
        seen.append([(p.step, p.generation) for p in gen1.available()])
    assert seen == [[(10, 0), (6, 1)], [(7, 1), (6, 1)], [(8, 1), (7, 1)]]
    assert_same(gen1.load(7), state_of(7))
    assert_same(gen1.load(8), state_of(8))


# -- restore through a mapping ---------------------------------------------------------------------
def test_load_is_bit_for_bit_through_a_mapping_without_reading_the_file(tmp_path, monkeypatch):
    special = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 3.4e38])
    payload = torch.tensor([0x7FC00001, 0x7F800001, 0xFFFFFFFF], dtype=torch.int64).to(torch.int32)
    state = EngineState(
        {
            "f32": torch.cat([special, payload.view(torch.float32)]),  # NaN payloads kept
            "bf16": torch.randn(33, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16),
            "i64": torch.tensor([-(2**63), 2**63 - 1, 0, -1], dtype=torch.int64),
            "bool": torch.tensor([[True, False], [False, True]]),
            "empty": torch.zeros(0),
            "empty2d": torch.zeros((3, 0), dtype=torch.bfloat16),
            "u8": torch.arange(256, dtype=torch.uint8),
        },
        {"step": 4},
    )
    snaps = store(tmp_path)
    snaps.write(4, lambda: state, asynchronous=False)

    def no_whole_file(*args, **kwargs):
        raise AssertionError("state.bin read whole")

    monkeypatch.setattr(Path, "read_bytes", no_whole_file)
    got = snaps.load(4)
    assert list(got.tensors) == list(state.tensors)
    for name, want in state.tensors.items():
        have = got.tensors[name]
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert snapshots_module._byte_view(have).tolist() == snapshots_module._byte_view(want).tolist(), name
    # The loaded tensors own their memory: the mapping is gone, the file may change.
    bin_path = tmp_path / "run-a" / "c0" / "r0" / "slot0" / "state.bin"
    with open(bin_path, "r+b") as f:
        f.write(b"\0" * 16)
    got.tensors["u8"].add_(1)  # writable
    assert got.tensors["f32"][2] == float("inf")
    assert snapshots_module._byte_view(snaps.load(4).tensors["u8"]).tolist()[16:] == list(range(16, 256))


def test_a_snapshot_removed_after_it_was_listed_is_file_not_found(tmp_path):
    snaps = store(tmp_path)
    snaps.write(1, lambda: state_of(1), asynchronous=False)
    assert [p.step for p in snaps.available()] == [1]
    shutil.rmtree(tmp_path / "run-a")
    with pytest.raises(FileNotFoundError, match="no snapshot of step 1"):
        snaps.load(1)
