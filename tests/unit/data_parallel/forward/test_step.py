"""The step transaction (``data_parallel/forward/step.py``) on the fake communicator: the summed
gradient of every step is the full batch's, bit for bit, whatever fails and when (see
``tests/helpers/forward_replica.py`` for the fakes)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from nanotron_recover.ft.gate import StoreGate
from nanotron_recover.logging import read_incidents
from nanotron_recover.parallel.world import World
from nanotron_recover.policy import CoverageError
from nanotron_recover.timing import PHASES, PhaseTimes
from tests.helpers.fake_comm import OTHERS_BEGAN_S, OTHERS_SURFACED_S, Fault
from tests.helpers.forward_replica import N, Replica, bucket_calls

# -- no fault ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("me", [0, 2])
def test_fault_free_step_is_the_full_batch(tmp_path, me):
    job = Replica(tmp_path, W=4, G=2, me=me)
    grads, books = bucket_calls(job)
    for step in (1, 2):
        reduced = job.step(step)
        job.assert_full_batch(step, reduced)
        # This replica computed its own G ids once; every bucket was reduced once, in epoch 0.
        first = (step - 1) * job.B
        assert job.engine.batches == [[first + 2 * me, first + 2 * me + 1]]
        assert reduced.extra == {"world_epoch": 0, "g_cur": 2, "g_ext": 0}
        assert len(job.comm.reductions) == step * (grads + books)
    assert {e for e, *_ in job.comm.reductions} == {0}
    assert job.comm.agrees == [(True, 0), (True, 0)]
    assert job.incidents == [] and read_incidents(tmp_path) == []


# -- one replica lost -------------------------------------------------------------------------------

# Where replica 3 of 4 is lost in step 1: at the first gradient bucket, a middle one, a bookkeeping
# bucket (after every gradient bucket was reduced), or the commit agree (after all of them).
WHERE = {
    "first_bucket": ("allreduce", 0),
    "middle_bucket": ("allreduce", 1),
    "bookkeeping_bucket": ("allreduce", 4),
    "agree": ("agree", 0),
}


@pytest.mark.parametrize("where", sorted(WHERE))
def test_replica_lost_mid_step_still_sums_the_full_batch(tmp_path, where):
    op, index = WHERE[where]
    job = Replica(tmp_path, W=4, G=2, me=0, faults=[Fault(1, op, index, (3,))])
    grads, books = bucket_calls(job)
    assert (grads, books) == (3, 3)  # the indices above fall in the intended buckets

    reduced = job.step(1)

    # Replica 3's ids 6, 7 are redistributed over the 3 survivors: G_ext = 1, id 6 is ours.
    job.assert_full_batch(1, reduced)
    assert job.engine.batches == [[0, 1], [6]]
    assert reduced.extra == {"world_epoch": 1, "g_cur": 2, "g_ext": 1}
    # Every bucket was reduced again in the new epoch, and only those of the new epoch count.
    epoch1 = [(name, offset) for e, name, offset, _ in job.comm.reductions if e == 1]
    assert len(epoch1) == grads + books == len(set(epoch1))
    assert job.comm.agrees == [(True, 0)]

    (incident,) = job.incidents
    assert incident["step"] == 1
    assert incident["failed_replicas"] == [3] and incident["failed_ranks"] == [3]
    # The failed rank's host as it was when the failure surfaced (the supervisor probes it).
    assert incident["failed_hosts"] == [job.comm.processes[3].host]
    assert incident["action"] == "policy_boundary"
    assert incident["lost_ids"] == [6, 7] and incident["extra_microbatches"] == 2
    assert incident["epoch"] == 1 and incident["alive_replicas"] == [0, 1, 2]
    assert incident["kind"] == "crash" and incident["phase"] == op
    # No record: from the earliest survivor's start of the failing operation to the earliest
    # survivor seeing it, both read from the reduced bookkeeping (the simulated replicas' views).
    assert incident["detect_method"] == "first_wait"
    assert incident["detect_s"] == pytest.approx(OTHERS_BEGAN_S - OTHERS_SURFACED_S, abs=1e-5)
    assert incident["recover_s"] >= 0.0 and incident["redo_s"] >= 0.0
    assert read_incidents(tmp_path) == job.incidents
    assert len(job.lines) == 1 and "replicas [3] failed" in job.lines[0]
    dead = job.comm.processes[3]  # the fence names the failed process, not its rank
    assert (tmp_path / "fence" / f"{dead.host}-{dead.pid}").exists()

    # The next step plans for the 3 survivors: G = ceil(8/3) = 3, two Majors and a Minor.
    reduced = job.step(2)
    job.assert_full_batch(2, reduced)
    assert job.engine.batches == [[8, 9, 10]]
    assert reduced.extra == {"world_epoch": 1, "g_cur": 3, "g_ext": 0}
    assert len(job.incidents) == 1


# -- two failures in one step -----------------------------------------------------------------------


@pytest.mark.parametrize("second", [("allreduce", 4), ("agree", 0)], ids=["redo_bucket", "redo_agree"])
def test_second_failure_during_the_redo(tmp_path, second):
    # Replica 3 is lost at bucket 1; replica 1 while the survivors reduce again in epoch 1
    # (allreduce_ calls 2..7 of the step), or at the agree of epoch 1.
    faults = [Fault(1, "allreduce", 1, (3,)), Fault(1, *second, (1,))]
    job = Replica(tmp_path, W=4, G=2, me=0, faults=faults)

    reduced = job.step(1)

    job.assert_full_batch(1, reduced)
    # First repair: ids 6, 7 over 0, 1, 2 (G_ext 1). Second: replica 1's ids 2, 3 and its extra
    # id 7 over 0, 2 (G_ext 2): ids 2, 3 are ours.
    assert job.engine.batches == [[0, 1], [6], [2, 3]]
    assert reduced.extra == {"world_epoch": 2, "g_cur": 2, "g_ext": 3}
    assert [(i["failed_replicas"], i["epoch"]) for i in job.incidents] == [([3], 1), ([1], 2)]
    assert [i["lost_ids"] for i in job.incidents] == [[6, 7], [2, 3, 7]]
    assert [i["extra_microbatches"] for i in job.incidents] == [2, 3]
    assert {i["action"] for i in job.incidents} == {"policy_boundary"}
    assert len(read_incidents(tmp_path)) == 2


def test_two_replicas_lost_in_one_recovery(tmp_path):
    job = Replica(tmp_path, W=4, G=2, me=0, faults=[Fault(1, "allreduce", 5, (1, 3))])
    reduced = job.step(1)
    job.assert_full_batch(1, reduced)
    # Ids 2, 3, 6, 7 over the survivors 0, 2: G_ext = 2.
    assert job.engine.batches == [[0, 1], [2, 3]]
    assert reduced.extra["g_ext"] == 2
    (incident,) = job.incidents
    assert incident["failed_replicas"] == [1, 3] and incident["failed_ranks"] == [1, 3]
    assert incident["lost_ids"] == [2, 3, 6, 7] and incident["extra_microbatches"] == 4


# -- spare promotion --------------------------------------------------------------------------------


def test_spare_shadowing_the_lost_major_is_promoted_without_recompute(tmp_path):
    # B = 16 over 8 replicas. Step 1 loses replica 2; from then on 7 are alive: G = 3, Majors
    # 0 1 3 4 5, Minor 6 (one id), and this replica, 7, is the Spare shadowing Major 0.
    faults = [Fault(1, "agree", 0, (2,)), Fault(3, "allreduce", 1, (0,))]
    job = Replica(tmp_path, W=8, G=2, me=7, faults=faults)

    job.assert_full_batch(1, job.step(1))
    assert job.engine.batches == [[14, 15]]  # ids 4, 5 of replica 2 went to replicas 0 and 1

    # Step 2, no fault: the Spare computes Major 0's ids but contributes zeros.
    reduced = job.step(2)
    job.assert_full_batch(2, reduced)
    assert job.engine.batches == [[16, 17, 18]]
    assert reduced.extra == {"world_epoch": 1, "g_cur": 3, "g_ext": 0}

    # Step 3: Major 0 is lost mid-reduction. Its ids are our shadow ids: promotion, nothing redone.
    reduced = job.step(3)
    job.assert_full_batch(3, reduced)
    assert job.engine.batches == [[32, 33, 34]]
    assert reduced.extra == {"world_epoch": 2, "g_cur": 3, "g_ext": 0}
    assert job.comm.alive_replicas == [1, 3, 4, 5, 6, 7]
    # Replica 0 logged step 1's incident; nobody alive here logs: replica 1 is now the logger.
    assert not job.fr.is_logger() and job.incidents == []


# -- coverage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [1.0, -1.0], ids=["counted_twice", "missing"])
def test_bookkeeping_that_does_not_count_each_id_once_raises(tmp_path, delta):
    job = Replica(tmp_path, W=4, G=2, me=0)
    job.comm.count_errors = {5: delta}  # another replica's bookkeeping is wrong about id 5
    with pytest.raises(CoverageError, match=r"step 1: ids \[5\] were not summed exactly once"):
        job.step(1)


# -- where the step's time goes ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("faults", "reductions"),
    [
        ([], 1),
        # Torn in the second bucket: the failed attempt is recovery; only the redo counts as reduced.
        ([Fault(1, "allreduce", 1, (3,))], 1),
        # Lost at the agree: the completed reduction counts, and the redo counts again.
        ([Fault(1, "agree", 0, (3,))], 2),
    ],
)
def test_the_step_times_its_phases(tmp_path, faults, reductions):
    job = Replica(tmp_path, W=4, G=2, me=0, faults=faults)
    times = job.fr.s.parts.times = PhaseTimes(clock=itertools.count().__next__)  # +1 s per reading
    job.step(1)
    record = times.record()
    assert all(record[f"{p}_s"] > 0 for p in ("compute", "gate", "reduce", "agree"))
    assert (record["recovery_s"] > 0) == bool(faults)
    assert record["optimizer_s"] == record["checkpoint_s"] == 0  # the trainer's
    assert record["reduce_bytes"] == reductions * (N * 4 + (2 * job.B + 2 * job.W) * 8)
    assert sum(record[f"{p}_s"] for p in PHASES) <= record["wall_s"]


# -- the gate off gloo ------------------------------------------------------------------------------


class Left(BaseException):
    """What ``members.leave`` raises here instead of ending the test process."""


@pytest.mark.parametrize("peer_arrives", [True, False])
def test_the_gate_on_nccl_goes_through_the_store_with_the_gate_timeout(tmp_path, monkeypatch, peer_arrives):
    # A replica of 2 ranks on NCCL (as the step sees it: no monitored barrier there): rank 0 waits
    # for rank 1's key in the replica's store, at most recover.gate_timeout_s.
    job = Replica(tmp_path, W=2, G=1, me=0, sets=["recover.gate_timeout_s=0.2"])
    store = dist.HashStore()
    job.fr.s.parts.world = World(0, 2, 0, torch.device("cpu"), "nccl", store=store)
    left: list[tuple[str, str]] = []

    def leave(kind, why, **extra):
        left.append((kind, why))
        raise Left()

    monkeypatch.setattr(job.fr.steps.members, "leave", leave)
    if peer_arrives:
        store.set(StoreGate(store, 1, 2).key(1, 1), b"1")  # rank 1 is at gate 1 already
        job.fr.steps._gate()
        assert left == [] and store.check(["nanotron_recover/gate/1/0"])
    else:
        with pytest.raises(Left):
            job.fr.steps._gate()
        assert left == [
            (
                "peer_error",
                "replica-consistency gate failed: gate 1 timed out after 0.2s: "
                "rank(s) [1] of the replica did not arrive",
            )
        ]


# -- a failure after the others committed the step --------------------------------------------------


def test_a_failure_after_the_others_committed_the_step_commits_it_here_too(tmp_path):
    """Replica 3 dies right after contributing to step 1's agree: the others returned from it
    (committed step 1) and this replica's agree raised. The recovery says a survivor committed
    step 1, so this replica commits it with the sums it holds instead of redoing it, and plans
    step 2 in the world of 4, repaired without replica 3, as the others do: every step is still
    the full batch, and the two sides never sum different steps."""
    job = Replica(tmp_path, W=4, G=2, me=0, faults=[Fault(1, "agree", 0, (3,), committed_elsewhere=True)])
    reduced = job.step(1)
    job.assert_full_batch(1, reduced)
    assert job.engine.batches == [[0, 1]]  # nothing redone
    assert job.incidents == []  # the failure is the next step's incident, as the others log it

    reduced = job.step(2)
    job.assert_full_batch(2, reduced)
    # Planned for 4 replicas (ids 8, 9 are ours), then replica 3's ids 14, 15 spread: 14 is ours.
    assert job.engine.batches == [[8, 9], [14]]
    assert reduced.extra == {"world_epoch": 1, "g_cur": 2, "g_ext": 1}
    (incident,) = job.incidents
    assert incident["step"] == 2 and incident["failed_replicas"] == [3]
    assert incident["lost_ids"] == [14, 15] and incident["alive_replicas"] == [0, 1, 2]

    reduced = job.step(3)  # then the steady plan of the 3 survivors
    job.assert_full_batch(3, reduced)
    assert job.engine.batches == [[16, 17, 18]]
