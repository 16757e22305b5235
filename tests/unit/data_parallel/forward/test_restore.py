"""Restoring a relaunched job from node snapshots: every rank agrees on the step, a snapshot that
cannot be read any more is received from another replica, and when some coordinate has no readable
copy every rank falls back to the disk checkpoint alike, never a crash.

Four ranks (2 coordinates x 2 replicas, one node per replica) run :func:`restore_from_snapshots`
on threads, over in-process communicators whose ``allgather`` is a real exchange between them."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from nanotron_recover.data_parallel.forward import restore
from nanotron_recover.data_parallel.forward.restore import newest_common_step, restore_from_snapshots
from nanotron_recover.data_parallel.forward.snapshots import NodeSnapshots
from nanotron_recover.data_parallel.forward.state_transfer import TransferResult
from nanotron_recover.engines.state import EngineState

COORDINATES, REPLICAS = 2, 2


class Group:
    """A communicator shared by threads: ``allgather`` returns every member's value, in order."""

    def __init__(self, size: int) -> None:
        self.values: list[Any] = [None] * size
        self.barrier = threading.Barrier(size, timeout=30)

    def allgather(self, index: int, value: Any) -> list[Any]:
        self.values[index] = value
        self.barrier.wait()
        out = list(self.values)
        self.barrier.wait()
        return out


class Member:
    def __init__(self, group: Group, index: int, calls: list[str], name: str) -> None:
        self.group, self.index, self.calls, self.name = group, index, calls, name

    def allgather(self, value: Any) -> list[Any]:
        self.calls.append(self.name)
        return self.group.allgather(self.index, value)


class Rank:
    """What restore uses of a rank's FaultTolerantComm."""

    def __init__(self, rank: int, world: Group, dp: Group) -> None:
        self.rank = rank
        self.local_rank, self.replica = rank % COORDINATES, rank // COORDINATES
        self.calls: list[str] = []
        self.global_comm = Member(world, rank, self.calls, "global")
        self.dp_comm = Member(dp, self.replica, self.calls, "dp")


def state_of(step: int, coordinate: int) -> EngineState:
    g = torch.Generator().manual_seed(100 * coordinate + step)
    tensors = {"param/w": torch.randn(64, generator=g), "exp_avg/w": torch.randn(64, generator=g)}
    return EngineState(tensors, {"coordinate": coordinate, "rng": {"cpu": bytes([step])}})


def fake_transfer(dp_comm: Member, my_replica, donors, receivers, export) -> TransferResult:
    """The re-join transfer, over the fake: the first donor's state reaches every receiver."""
    values = dp_comm.allgather(export() if my_replica == donors[0] else None)
    sent = values[donors[0]]
    received = EngineState({k: t.clone() for k, t in sent.tensors.items()}, dict(sent.meta))
    return TransferResult(True, received if my_replica in receivers else None, 0, 0.0)


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Stores with steps 3 and 4 published on every node; ``run(at_most, broken)`` restores on
    every rank, ``broken`` maps (replica, coordinate) to what happens to its files just before it
    loads."""
    monkeypatch.setattr(restore, "transfer_state", fake_transfer)

    def store(rank: int) -> NodeSnapshots:
        replica, coordinate = rank // COORDINATES, rank % COORDINATES
        return NodeSnapshots(tmp_path / f"node{replica}", "run", "tp2-pp1", coordinate, replica, generation=0)

    for rank in range(COORDINATES * REPLICAS):
        for step in (3, 4):
            store(rank).write(step, lambda s=step, c=rank % COORDINATES: state_of(s, c), asynchronous=False)

    def run(
        at_most: int | None = None,
        broken: dict[tuple[int, int], Any] | None = None,
        disk: dict[int, int | None] | None = None,
    ):
        world = Group(COORDINATES * REPLICAS)
        dps = [Group(REPLICAS) for _ in range(COORDINATES)]
        ranks = [Rank(r, world, dps[r % COORDINATES]) for r in range(COORDINATES * REPLICAS)]
        results: dict[int, Any] = {}

        def body(ftc: Rank) -> None:
            snaps = store(ftc.rank)
            damage = (broken or {}).get((ftc.replica, ftc.local_rank))
            if damage is not None:
                load = snaps.load

                def damaged_load(step: int) -> EngineState:
                    damage(snaps.run_root / f"c{ftc.local_rank}" / f"r{ftc.replica}")
                    return load(step)

                snaps.load = damaged_load
            try:
                disk_step = (disk or {}).get(ftc.rank)
                results[ftc.rank] = restore_from_snapshots(ftc, snaps, COORDINATES, at_most, disk_step)
            except BaseException as error:  # noqa: BLE001 - reported to the test
                results[ftc.rank] = error

        threads = [threading.Thread(target=body, args=(ftc,)) for ftc in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a rank waits in a collective the others skipped"
        # The same collective calls in the same order: over the whole job, and per coordinate.
        assert len({tuple(c for c in r.calls if c == "global") for r in ranks}) == 1, [r.calls for r in ranks]
        for c in range(COORDINATES):
            assert len({tuple(r.calls) for r in ranks if r.local_rank == c}) == 1, [r.calls for r in ranks]
        return results

    return run


def vanish(mine: Path) -> None:
    shutil.rmtree(mine)  # removed between available() and load()


def damage_meta(mine: Path) -> None:
    for meta in mine.glob("slot*/meta.json"):
        meta.write_text("{not json")


def assert_restored(results: dict[int, Any], step: int) -> None:
    for rank, found in results.items():
        assert not isinstance(found, BaseException), found
        got_step, state = found
        want = state_of(step, rank % COORDINATES)
        assert got_step == step
        assert all(torch.equal(state.tensors[k], want.tensors[k]) for k in want.tensors), rank
        assert state.meta == want.meta


def test_every_rank_restores_the_newest_step_every_coordinate_holds(job):
    assert_restored(job(), 4)
    assert_restored(job(at_most=3), 3)  # never newer than the previous generation's last commit


def test_a_disk_checkpoint_newer_than_every_snapshot_wins_on_every_rank(job, capsys):
    """Snapshots taken less often than checkpoints (or by fewer replicas): the relaunch resumes from
    the newer disk checkpoint. One rank's reading of it is enough for all (a rank that could not
    read ``latest`` reads None), and a snapshot as new as the checkpoint is still preferred."""
    everyone = range(COORDINATES * REPLICAS)
    assert job(disk={2: 5}) == {rank: None for rank in everyone}
    assert "the disk checkpoint of step 5 is newer than the newest step the nodes' snapshots hold (4)" in (
        capsys.readouterr().out
    )
    assert_restored(job(disk=dict.fromkeys(everyone, 4)), 4)
    assert_restored(job(disk=dict.fromkeys(everyone, 2)), 4)


@pytest.mark.parametrize("damage", [vanish, damage_meta], ids=["removed", "damaged"])
def test_a_snapshot_lost_before_its_load_is_received_from_another_replica(job, damage, capsys):
    assert_restored(job(broken={(0, 1): damage}), 4)
    out = capsys.readouterr().out
    assert "rank 1: warning: the node snapshot of step 4 could not be read" in out
    assert "it counts as not held here" in out


@pytest.mark.parametrize("damage", [vanish, damage_meta], ids=["removed", "damaged"])
def test_a_coordinate_without_a_readable_copy_makes_every_rank_fall_back(job, damage, capsys):
    """Before, the rank whose load raised FileNotFoundError died (exit 2) and the others waited in
    the transfer; now every rank returns None alike and the trainer resumes from the checkpoint."""
    results = job(broken={(0, 1): damage, (1, 1): damage})
    assert results == {rank: None for rank in range(COORDINATES * REPLICAS)}
    out = capsys.readouterr().out
    assert (
        "relaunched: the node snapshot of step 4 could not be read by any replica of some coordinate" in out
    )


def test_a_refused_folder_holds_nothing_and_says_why(tmp_path, capsys):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "shm").symlink_to(tmp_path / "elsewhere")
    world, dp = Group(1), Group(1)
    ftc = Rank(0, world, dp)
    snaps = NodeSnapshots(tmp_path / "shm", "run", "tp1-pp1", 0, 0)
    assert restore_from_snapshots(ftc, snaps, 1) is None
    assert "is a symlink" in capsys.readouterr().out


def test_newest_common_step():
    assert newest_common_step([(0, [3, 4]), (1, [4]), (0, []), (1, [3])], 2) == 4
    assert newest_common_step([(0, [3, 4]), (1, [])], 2) is None
