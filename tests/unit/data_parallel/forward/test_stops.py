"""Stops (``data_parallel/forward/stops.py``) on the fake communicator: one agreed stop, one outcome,
one exit status, on every path that ends the job."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanotron_recover.data_parallel.forward import members as members_module
from nanotron_recover.data_parallel.forward.restore import snapshot_layout_id
from nanotron_recover.data_parallel.forward.snapshot_folder import snapshot_run_id
from nanotron_recover.data_parallel.forward.snapshots import NodeSnapshots
from nanotron_recover.engines.state import EngineState
from nanotron_recover.errors import ExitCode, StopRun
from nanotron_recover.failures import stop_bit
from nanotron_recover.generation import Relaunch, write_relaunch
from tests.helpers.fake_comm import Fault
from tests.helpers.forward_replica import Exited, Replica

# -- stops ------------------------------------------------------------------------------------------


def test_stop_request_rides_on_the_agree(tmp_path, exits):
    job = Replica(tmp_path, W=4, G=2, me=0)
    job.assert_full_batch(1, job.step(1))
    job.fr.after_step(1)
    job.fr.request_stop(StopRun("io", "No space left on device: checkpoints/1"))
    job.fr.request_stop(StopRun("deterministic", "a later request does not replace the first"))

    with pytest.raises(Exited) as exited:
        job.step(2)

    assert exited.value.code == ExitCode.IO
    assert job.comm.agrees[-1] == (True, stop_bit("io"))
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind) == ("stopped", 1, "io")
    assert stop.message == "No space left on device: checkpoints/1"
    assert job.comm.barriers == 1 and job.comm.watch_stopped


def test_stop_requested_by_another_replica(tmp_path, exits):
    # A save failed on another rank (a full disk): only that rank knows the message.
    job = Replica(tmp_path, W=4, G=2, me=0)
    job.comm.others_stop = stop_bit("io")
    job.comm.others_gather = ("No space left on device: checkpoints/1", False)

    with pytest.raises(Exited) as exited:
        job.step(1)

    assert exited.value.code == ExitCode.IO
    assert job.comm.agrees == [(True, 0)]
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind) == ("stopped", 0, "io")
    # The logging rank learns the message from the allgather; it does not know it itself.
    assert job.comm.global_comm.gathered == [(None, False)]
    assert stop.message == "No space left on device: checkpoints/1"


def test_lost_replica_whose_record_stops_the_job(tmp_path, exits):
    record = {"kind": "deterministic", "phase": "recovery", "message": "InjectedError again on [6]"}
    job = Replica(tmp_path, W=4, G=2, me=0, faults=[Fault(1, "allreduce", 2, (3,), record)])

    with pytest.raises(Exited) as exited:
        job.step(1)

    assert exited.value.code == ExitCode.DETERMINISTIC
    assert job.engine.batches == [[0, 1]]  # stopped, not repaired: nothing redone
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind, stop.message) == (
        "stopped",
        0,
        "deterministic",
        "InjectedError again on [6]",
    )
    (incident,) = job.incidents
    assert incident["kind"] == "deterministic" and incident["failed_replicas"] == [3]


def test_below_min_replicas_saves_the_last_committed_step_and_stops(tmp_path, exits):
    job = Replica(
        tmp_path, W=4, G=2, me=0, faults=[Fault(2, "allreduce", 0, (3,))], sets=["recover.min_replicas=4"]
    )
    job.assert_full_batch(1, job.step(1))
    job.fr.after_step(1)

    with pytest.raises(Exited) as exited:
        job.step(2)

    assert exited.value.code == ExitCode.TOO_FEW_REPLICAS
    assert job.saves == [(1, True)]  # the checkpoint writer saves step 1, synchronously
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind) == ("stopped", 1, "too_few_replicas")
    assert "3 replicas left, below recover.min_replicas=4" in stop.message
    assert f"Saved step 1 to {tmp_path / 'checkpoints' / '1'}" in stop.message
    (incident,) = job.incidents
    assert incident["step"] == 2 and incident["failed_replicas"] == [3]


def test_below_min_replicas_whose_save_fails_exits_1(tmp_path, exits):
    # Exit 3 promises a checkpoint of the last committed step: without one the run exits 1.
    job = Replica(
        tmp_path, W=4, G=2, me=0, faults=[Fault(2, "allreduce", 0, (3,))], sets=["recover.min_replicas=4"]
    )

    def full_disk(step: int, synchronous: bool) -> None:
        raise OSError(28, "No space left on device")

    job.fr.s.parts.save = full_disk
    job.assert_full_batch(1, job.step(1))
    job.fr.after_step(1)

    with pytest.raises(Exited) as exited:
        job.step(2)

    assert exited.value.code == ExitCode.FAILED
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind, int(stop.exit_code)) == ("stopped", 1, "too_few_replicas", 1)
    assert "Could not save step 1: [Errno 28] No space left on device" in stop.message
    assert job.comm.global_comm.gathered == [(stop.message, True)]


def test_below_min_replicas_exits_1_when_another_writer_failed_to_save(tmp_path, exits):
    job = Replica(
        tmp_path, W=4, G=2, me=1, faults=[Fault(1, "allreduce", 0, (3,))], sets=["recover.min_replicas=4"]
    )
    job.comm.others_gather = ("3 replicas left. Could not save step 0: disk full", True)

    with pytest.raises(Exited) as exited:
        job.step(1)

    assert exited.value.code == ExitCode.FAILED
    assert job.saves == [] and job.outcomes == []  # replica 0 writes and logs
    assert job.comm.global_comm.gathered == [(None, False)]


def test_every_replica_lost(tmp_path, exits, monkeypatch):
    # This rank (replica 1's) still runs, the only one: it records the lost job, exit 1, no save.
    job = Replica(tmp_path, W=2, G=2, me=1, faults=[Fault(2, "agree", 0, (0, 1))])
    job.assert_full_batch(1, job.step(1))
    job.fr.after_step(1)
    snapshot_ends: list[bool] = []
    monkeypatch.setattr(job.fr, "_end_snapshots", lambda: snapshot_ends.append(True))

    with pytest.raises(Exited) as exited:
        job.step(2)

    assert exited.value.code == ExitCode.FAILED == 1
    assert job.saves == []
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind, int(stop.exit_code)) == ("stopped", 1, "all_replicas_lost", 1)
    assert stop.message.startswith("every replica lost (failed replicas [0, 1])")
    assert job.comm.global_comm.gathered == []  # nobody left to gather with
    assert snapshot_ends == []  # a lost job keeps its node-memory snapshots for a relaunch


def test_every_replica_lost_is_recorded_by_the_lowest_rank_still_running(tmp_path, exits):
    # Ranks 0 and 1 both still run (each lost a replica peer): rank 0 records, rank 1 only exits 1.
    job = Replica(tmp_path, W=3, G=2, me=1, faults=[Fault(1, "allreduce", 1, (0, 1, 2), running=(0,))])

    with pytest.raises(Exited) as exited:
        job.step(1)

    assert exited.value.code == ExitCode.FAILED
    assert job.outcomes == [] and job.saves == []


# -- node-memory snapshots at the end of the job ------------------------------------------------------
def snapshotting(job: Replica) -> Replica:
    """The fake engine exports as the mode asks (``export_state(copy=False)``): real snapshots."""
    job.engine.export_state = lambda copy=True: EngineState({"grads": job.engine.grads_flat.clone()}, {})
    return job


def snapshot_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in (run_dir / "shm").rglob("*") if not p.is_dir())


def committed(job: Replica, *steps: int) -> None:
    for step in steps:
        job.assert_full_batch(step, job.step(step))
        job.fr.after_step(step)
    job.fr.snapshots.wait()
    assert job.fr.snapshots.error is None and (
        job.fr.snapshots.published,
        job.fr.snapshots.last_published,
    ) == (len(steps), steps[-1])


def test_a_completed_job_leaves_no_snapshot_on_its_node(tmp_path, exits):
    job = snapshotting(Replica(tmp_path, W=2, G=2, me=1))
    committed(job, 1, 2)
    assert snapshot_files(tmp_path)

    job.fr.finish(2)

    assert snapshot_files(tmp_path) == []


def test_a_stop_without_relaunch_leaves_no_snapshot_on_its_node(tmp_path, exits):
    # Replica 0 fails in step 3 and min_replicas=2: the job stops (exit 3), nothing relaunches it.
    job = snapshotting(
        Replica(
            tmp_path, W=2, G=2, me=1, faults=[Fault(3, "allreduce", 0, (0,))], sets=["recover.min_replicas=2"]
        )
    )
    committed(job, 1, 2)

    with pytest.raises(Exited) as exited:
        job.step(3)

    assert exited.value.code == ExitCode.TOO_FEW_REPLICAS and job.saves == [(2, True)]
    assert snapshot_files(tmp_path) == []


def test_a_rank_that_wrote_no_snapshot_still_removes_the_runs_on_its_node(tmp_path, exits):
    # An earlier generation's replica 3 left its slots on this node; this job completes at once.
    job = Replica(tmp_path, W=2, G=2, me=1)
    cfg = job.fr.s.cfg
    old = NodeSnapshots(tmp_path / "shm", snapshot_run_id(cfg, tmp_path), snapshot_layout_id(cfg), 0, 3)
    old.write(5, lambda: EngineState({"w": job.engine.grads_flat.clone()}, {}), asynchronous=False)
    assert snapshot_files(tmp_path) and job.fr.snapshots is None

    job.fr.finish(0)

    assert snapshot_files(tmp_path) == []


def test_a_rank_fenced_off_the_job_leaves_the_new_generations_snapshots(tmp_path, exits, monkeypatch):
    """A process of generation 0 still running when generation 1 was launched (a node cut off, then
    back) writes no snapshot and, when it completes, removes none of the node's."""
    job = snapshotting(Replica(tmp_path, W=2, G=2, me=1))
    committed(job, 1, 2)
    monkeypatch.setattr(members_module, "fail_stop", lambda reason: pytest.fail(reason))
    write_relaunch(tmp_path, Relaunch(generation=1, cause="node_lost", ended_at=0.0, last_committed=2))
    before = [(p, p.stat().st_mtime_ns) for p in snapshot_files(tmp_path)]

    job.assert_full_batch(3, job.step(3))
    job.fr.after_step(3)  # its snapshot of step 3 is skipped: the slots are generation 1's now
    job.fr.snapshots.wait()
    job.fr.finish(3)

    assert "no longer belongs to the job" in str(job.fr.snapshots.error)
    assert [(p, p.stat().st_mtime_ns) for p in snapshot_files(tmp_path)] == before
