"""The step transaction (``ForwardRecovery``) in one process, without MPI jobs or torch.distributed.

This process is one replica of ``tp = pp = 1`` (its torch world has size 1, so the replica gate is
a no-op); ``tests/fake_comm.py`` plays the other replicas and the fault-tolerant communicator,
including failures that surface as ``WorldChanged`` at a chosen reduction or agree. The model
engine is a fake too: micro-batch ``i`` adds ``grad_of(i) / B`` to the gradient buffer and has the
loss ``loss_of(i)``. Gradients are small integers, losses multiples of 1/4 and ``B`` a power of two,
so every sum here is exact whatever its order, and is compared bit for bit with the full batch's.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_comm import OTHERS_BEGAN_S, OTHERS_SURFACED_S, RECORD_LAG_S, FakeComm, Fault

from nanotron_recover.config import load_config
from nanotron_recover.data_parallel.protocol import ReducedStep, ReplicaParts
from nanotron_recover.errors import ExitCode, StopRun
from nanotron_recover.ft.faults import FaultInjector
from nanotron_recover.logging import read_incidents
from nanotron_recover.parallel.world import World
from nanotron_recover.policy import CoverageError
from nanotron_recover.recovery import transaction
from nanotron_recover.recovery.transaction import STOP_BITS, ForwardRecovery

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tiny_cpu.yaml"
N = 20  # gradient elements
BUCKET = 8  # elements per bucket: gradients in 3 buckets (8, 8, 4), the bookkeeping in 2B+2W / 8


def grad_of(i: int) -> torch.Tensor:
    """The gradient of micro-batch ``i`` before the 1/B loss scale: small integers, fixed by ``i``."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(-8, 9, (N,), generator=g).to(torch.float64)


def loss_of(i: int) -> float:
    return 1.0 + 0.25 * i


class Source:
    """The micro-batch source of one step: micro-batch ``i`` is a tensor that carries ``i``."""

    def __init__(self, step: int, B: int) -> None:
        self.ids = range((step - 1) * B, step * B)

    def get(self, i: int) -> torch.Tensor:
        assert i in self.ids, f"micro-batch {i} is not in this step ({self.ids})"
        return torch.tensor([i])


class Engine:
    holds_loss = True
    digest_name = "pp0_tp0"

    def __init__(self) -> None:
        self.grads_flat = torch.zeros(N, dtype=torch.float32)
        self.event_hook = None
        self.batches: list[list[int]] = []  # the ids of each train_batch call

    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[float]:
        ids = [int(mb[0]) for mb in microbatches]
        self.batches.append(ids)
        for k, i in enumerate(ids):
            self.event_hook("forward", k)
            self.event_hook("backward", k)
            self.grads_flat.add_(grad_of(i).to(torch.float32), alpha=loss_scale)
        return [loss_of(i) for i in ids]


class Exited(BaseException):
    """What ``os._exit`` raises in these tests."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class Replica:
    """One ForwardRecovery wired to the fake engine, the fake data and the fake communicator."""

    def __init__(
        self,
        run_dir: Path,
        *,
        W: int,
        G: int,
        me: int,
        faults: Sequence[Fault] = (),
        sets: Sequence[str] = (),
    ) -> None:
        self.run_dir, self.B, self.W = run_dir, W * G, W
        cfg = load_config(
            CONFIG,
            [
                "recover.enabled=true",
                f"parallelism.dp={W}",
                f"tokens.batch_accumulation_per_replica={G}",
                "recover.watchdog_timeout_s=null",
                f"recover.bucket_size_mb={BUCKET * 4 / 2**20}",
                *sets,
            ],
        )
        self.fr = fr = ForwardRecovery(cfg, run_dir)
        self.comm = FakeComm(
            W=W,
            me=me,
            B=self.B,
            grad_of=grad_of,
            loss_of=loss_of,
            spares=cfg.recover.spares,
            faults=faults,
            run_dir=run_dir,
        )
        # What setup_world would set up, minus MPI and the replica's torch world.
        fr.ftc = self.comm
        fr.my_replica_ranks = {me}
        fr.injector = FaultInjector(cfg.recover, me, me, run_dir)
        self.engine = Engine()
        self.saves: list[tuple[int, bool]] = []
        self.incidents: list[dict] = []
        self.lines: list[str] = []
        self.outcomes: list[tuple[str, int, StopRun | None]] = []
        fr.attach(
            ReplicaParts(
                engine=self.engine,
                data=lambda step: Source(step, self.B),
                save=self._save,
                log_incident=self.incidents.append,
                write_line=self.lines.append,
                write_outcome=self._write_outcome,
                world=World(rank=0, size=1, local_rank=0, device=torch.device("cpu"), backend="gloo"),
                ctx=SimpleNamespace(),
                B=self.B,
                G=G,
            )
        )
        self.comm.bind(self.engine.grads_flat, fr.bookkeeping)

    def _save(self, step: int, synchronous: bool) -> Path:
        self.saves.append((step, synchronous))
        return self.run_dir / "checkpoints" / str(step)

    def _write_outcome(self, status: str, last_step: int, stop: StopRun | None) -> bool:
        self.outcomes.append((status, last_step, stop))
        return True

    def step(self, step: int) -> ReducedStep:
        """One step, from a zeroed buffer (the optimizer zeroes the summed gradients after a step)."""
        self.engine.grads_flat.zero_()
        self.engine.batches = []
        self.comm.begin_step(step)
        return self.fr.reduced_gradients(step)

    def step_ids(self, step: int) -> list[int]:
        return list(range((step - 1) * self.B, step * self.B))

    def full_batch_gradient(self, step: int) -> torch.Tensor:
        return (sum(grad_of(i) for i in self.step_ids(step)) / self.B).to(torch.float32)

    def assert_full_batch(self, step: int, reduced: ReducedStep) -> None:
        """The step's summed gradient and loss are exactly those of the fault-free full batch."""
        got = self.engine.grads_flat
        want = self.full_batch_gradient(step)
        assert torch.equal(got, want), f"step {step}: gradient differs by {(got - want).abs().max()}"
        assert reduced.ids == self.step_ids(step)
        assert reduced.loss == sum(loss_of(i) for i in self.step_ids(step)) / self.B
        assert reduced.replicas == len(self.comm.alive_replicas)


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """``os._exit`` raises :class:`Exited` instead of ending the test process."""

    def fake_exit(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(transaction.os, "_exit", fake_exit)


def bucket_calls(job: Replica) -> tuple[int, int]:
    """(gradient buckets, bookkeeping buckets): allreduce_ calls per full reduction."""
    grads = -(-N // BUCKET)
    return grads, -(-(2 * job.B + 2 * job.W) // BUCKET)


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


def test_lowest_survivor_logs_when_the_logging_replica_is_lost(tmp_path):
    job = Replica(tmp_path, W=4, G=2, me=1, faults=[Fault(1, "allreduce", 2, (0,))])
    assert not job.fr.is_logger()
    reduced = job.step(1)
    job.assert_full_batch(1, reduced)
    # Replica 0's ids 0, 1 go to the survivors 1, 2 (one each): id 0 to us.
    assert job.engine.batches == [[2, 3], [0]]
    assert job.fr.is_logger()
    (incident,) = job.incidents
    assert incident["failed_replicas"] == [0] and incident["lost_ids"] == [0, 1]


def test_failure_record_gives_kind_phase_and_detection_time(tmp_path):
    record = {"kind": "hang", "phase": "compute", "message": "watchdog: phase 'compute' hung"}
    job = Replica(tmp_path, W=4, G=2, me=0, faults=[Fault(1, "allreduce", 3, (2,), record)])
    job.assert_full_batch(1, job.step(1))
    (incident,) = job.incidents
    assert incident["kind"] == "hang" and incident["phase"] == "compute"
    # From the failure (the record's time) to the earliest survivor seeing it.
    assert incident["detect_method"] == "record"
    assert incident["detect_s"] == pytest.approx(RECORD_LAG_S - OTHERS_SURFACED_S, abs=0.05)


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
    assert job.comm.agrees[-1] == (True, STOP_BITS["io"])
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind) == ("stopped", 1, "io")
    assert stop.message == "No space left on device: checkpoints/1"
    assert job.comm.barriers == 1 and job.comm.watch_stopped


def test_stop_requested_by_another_replica(tmp_path, exits):
    # A save failed on another rank (a full disk): only that rank knows the message.
    job = Replica(tmp_path, W=4, G=2, me=0)
    job.comm.others_stop = STOP_BITS["io"]
    job.comm.others_gather = "No space left on device: checkpoints/1"

    with pytest.raises(Exited) as exited:
        job.step(1)

    assert exited.value.code == ExitCode.IO
    assert job.comm.agrees == [(True, 0)]
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind) == ("stopped", 0, "io")
    # The logging rank learns the message from the allgather; it does not know it itself.
    assert job.comm.global_comm.gathered == [None]
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


def test_every_replica_lost(tmp_path, exits):
    job = Replica(tmp_path, W=2, G=2, me=0, faults=[Fault(2, "agree", 0, (0, 1))])
    job.assert_full_batch(1, job.step(1))

    with pytest.raises(Exited) as exited:
        job.step(2)

    assert exited.value.code == ExitCode.TOO_FEW_REPLICAS
    assert job.saves == []
    ((status, last_step, stop),) = job.outcomes
    assert (status, last_step, stop.kind) == ("stopped", 1, "too_few_replicas")
    assert "no replica left alive" in stop.message


# -- coverage ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("delta", [1.0, -1.0], ids=["counted_twice", "missing"])
def test_bookkeeping_that_does_not_count_each_id_once_raises(tmp_path, delta):
    job = Replica(tmp_path, W=4, G=2, me=0)
    job.comm.count_errors = {5: delta}  # another replica's bookkeeping is wrong about id 5
    with pytest.raises(CoverageError, match=r"step 1: ids \[5\] were not summed exactly once"):
        job.step(1)
