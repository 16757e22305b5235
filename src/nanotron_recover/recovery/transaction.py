"""ForwardRecovery: the fault-tolerant data-parallel mode, one step as a transaction.

Each replica (``tp*pp`` ranks) is its own torch world; across replicas there is only the ULFM
communicator (``ft.comm``). A step ``s`` runs as follows on every rank:

1. *Plan.* ``steady_plan`` assigns the step's ``B`` ids to the alive replicas: Majors take
   ``G = ceil(B/W)`` each, a Minor the remainder, Spares shadow a Major (or idle).
2. *Compute.* The replica runs its ids through the pipeline; gradients accumulate in the local
   fp32 buffer. No cross-replica traffic. A Spare moves its shadow gradients aside: it contributes
   zeros unless promoted.
3. *Gate.* A barrier in the replica's torch world: if a member of this replica died, every other
   member learns it here (or earlier, from a broken gloo/NCCL call) and kills itself, so a replica
   is always whole or gone.
4. *Reduce.* The gradient buffer, plus a bookkeeping vector (per id: how many replicas contributed
   it, and its loss), is summed over the DP communicator in snapshotted, epoch-tagged buckets.
5. *Commit.* ``agree`` on the global communicator. It returns only if no rank failed.

A failure anywhere in 2-5 surfaces on the survivors as ``WorldChanged`` from the reduction or the
agree, after the communicator has shrunk to the survivors (members of a failed replica leave by
SIGKILL). The survivors then ``repair`` the plan: a Spare shadowing a lost Major is promoted (its
gradients join the contribution, no extra compute), the other lost ids are redistributed over the
survivors (``G_ext = ceil(|L|/W)`` extra micro-batches each at most). Every stale bucket is restored
from its snapshot, the extra micro-batches are computed into the buffer, and 3-5 run again in the
new epoch. This repeats for failures during recovery. At commit the bookkeeping vector must show
every id of the step exactly once: the summed gradient is exactly the fault-free run's, divided by
the same ``B``. The next step plans again for the replicas that are left.

Below ``recover.min_replicas`` the survivors checkpoint the last committed step and stop with a
non-zero status; that checkpoint resumes in either mode.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..config import Config, check_world_size
from ..ft.comm import FaultTolerantComm, RecoveryResult, TooFewReplicas, WorldChanged
from ..ft.failstop import Watchdog, fail_stop
from ..ft.faults import FaultInjector, read_deaths
from ..ft.replica_world import init_replica_world
from ..logging import IncidentLog
from ..parallel.context import ParallelContext
from ..parallel.world import World
from ..policy import CoverageError, StepPlan, repair, steady_plan
from .buckets import BucketedReduction

if TYPE_CHECKING:
    from ..trainer import DistributedTrainer, ReducedStep

EXIT_TOO_FEW_REPLICAS = 3


@dataclass
class Incident:
    step: int
    phase: str
    result: RecoveryResult
    action: str
    lost_ids: list[int]
    extra_microbatches: int
    noticed: float  # perf_counter when this survivor learned of the failure
    detect_s: float | None
    compute_s: float = 0.0  # redone micro-batches after noticing (excluded from recover_s)


@dataclass
class StepState:
    plan: StepPlan
    computed: dict[int, float] = field(default_factory=dict)  # id -> loss (0 off the last stage)
    shadow: torch.Tensor | None = None
    incidents: list[Incident] = field(default_factory=list)
    g_ext: int = 0


class ForwardRecovery:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir, self.args = cfg, Path(run_dir), cfg.recover
        self.watchdog = Watchdog()
        self.started = time.time()  # death records older than this belong to an earlier run
        self.in_recovery = False
        self.restore_event: torch.cuda.Event | None = None

    # -- set-up ----------------------------------------------------------------------------
    def setup_world(self) -> tuple[World, ParallelContext]:
        from mpi4py import MPI

        check_world_size(self.cfg, MPI.COMM_WORLD.Get_size())
        p = self.cfg.parallelism
        self.ftc = FaultTolerantComm(p.tp, p.pp, p.dp, on_leave=self._on_leave)
        world = init_replica_world(self.ftc)
        ctx = ParallelContext.create(p.tp, p.pp, 1, world.device)
        self.injector = FaultInjector(self.args, self.ftc.rank, self.ftc.replica, self.run_dir)
        return world, ctx

    def attach(self, trainer: DistributedTrainer) -> None:
        self.t = trainer
        self.B = trainer.B
        # Per id of the step: [0, B) how many replicas contributed it, [B, 2B) its loss.
        self.bookkeeping = torch.zeros(2 * self.B, dtype=torch.float64)
        numel = max(1, int(self.args.bucket_size_mb * 2**20) // 4)
        self.reduction = BucketedReduction([trainer.grads.flat, self.bookkeeping], numel)
        trainer.engine.event_hook = self._engine_event
        self.incident_log = IncidentLog(self.run_dir / "incidents.jsonl")

    def _on_leave(self, result: RecoveryResult) -> None:
        print(
            f"[nanotron-recover] rank {self.ftc.rank} leaves: replica {self.ftc.replica} failed "
            f"(epoch {result.old_epoch} -> {result.new_epoch})",
            file=sys.stderr,
            flush=True,
        )

    # -- roles -------------------------------------------------------------------------------
    def is_logger(self) -> bool:
        return self.ftc.replica == min(self.ftc.alive_replicas) and self.ftc.local_rank == 0

    def is_checkpoint_writer(self) -> bool:
        return self.ftc.replica == min(self.ftc.alive_replicas)

    def replica_id(self) -> int:
        return self.ftc.replica

    def abort(self, error: BaseException) -> None:
        """Any error escaping the step becomes a fail-stop: an exception exit would not be reported
        to the other replicas (DESIGN.md section 4), which would then wait for this rank forever."""
        traceback.print_exception(error)
        fail_stop(f"rank {self.ftc.rank}: {type(error).__name__}: {error}")

    # -- phases --------------------------------------------------------------------------------
    def _engine_event(self, kind: str, index: int) -> None:
        if self.in_recovery:
            if kind == "forward":
                self.injector.maybe_fail("recovery", index)
        else:
            self.injector.maybe_fail(kind, index)
        if kind == "backward" and self.restore_event is not None:
            # Asynchronous restore: gradients may accumulate only once the buffer is restored.
            torch.cuda.current_stream().wait_event(self.restore_event)
            self.restore_event = None

    def _compute(self, step: int, ids: tuple[int, ...], state: StepState) -> None:
        if not ids:
            return
        t = self.t
        source = t.source_for(step)
        try:
            with self.watchdog.phase("compute", self.args.watchdog_timeout_s):
                losses = t.engine.train_batch([source.get(i) for i in ids], loss_scale=1.0 / self.B)
        except Exception:
            # A broken torch world means a member of this replica died: the replica is gone.
            traceback.print_exc()
            fail_stop(f"rank {self.ftc.rank}: compute failed in replica {self.ftc.replica}")
        keep_loss = t.ctx.is_last_stage and t.ctx.tp_rank == 0
        for k, i in enumerate(ids):
            state.computed[i] = float(losses[k]) if keep_loss else 0.0

    def _gate(self) -> None:
        self.injector.maybe_fail("gate", 0)
        world = self.t.world
        if world.size == 1:
            return
        try:
            with self.watchdog.phase("gate", self.args.gate_timeout_s * 2):
                if world.backend == "gloo":
                    dist.monitored_barrier(timeout=timedelta(seconds=self.args.gate_timeout_s))
                else:
                    dist.barrier()
        except Exception as e:
            fail_stop(f"rank {self.ftc.rank}: replica-consistency gate failed: {e}")

    def _fill_bookkeeping(self, state: StepState, first_id: int) -> None:
        self.bookkeeping.zero_()
        for i in state.plan.contributed_by(self.ftc.replica):
            if i not in state.computed:
                raise CoverageError(f"replica {self.ftc.replica} contributes id {i} it never computed")
            self.bookkeeping[i - first_id] += 1.0
            self.bookkeeping[self.B + i - first_id] += state.computed[i]

    # -- the step ------------------------------------------------------------------------------
    def reduced_gradients(self, step: int) -> ReducedStep:
        from ..trainer import ReducedStep

        alive = self.ftc.alive_replicas
        self.injector.begin_step(step, alive)
        # The policy counts steps from 0: its step t holds ids t*B .. t*B+B-1.
        state = StepState(plan=steady_plan(step - 1, self.B, alive, self.args.spares))
        self.reduction.reset()
        me = self.ftc.replica
        mine = state.plan.assignments[me]
        self._compute(step, mine.ids, state)
        if not mine.contributes:
            state.shadow = self.t.grads.flat.clone()  # a Spare's gradients count only if promoted
            self.t.grads.flat.zero_()
        first_id = (step - 1) * self.B

        while True:
            self._gate()
            self._fill_bookkeeping(state, first_id)
            try:
                with self.watchdog.phase("reduce", self.args.watchdog_timeout_s):
                    self.reduction.reduce(
                        self.ftc,
                        self.ftc.epoch,
                        before_bucket=lambda b: self.injector.maybe_fail("reduce", b),
                    )
                self.ftc.agree(True)
                break
            except WorldChanged as changed:
                self._recover_step(step, state, changed)
            except TooFewReplicas as gone:
                self._stop(step, f"no replica left alive ({gone})", save=False)
        committed = time.perf_counter()

        counts = self.bookkeeping[: self.B]
        if not torch.all(counts == 1.0):
            bad = [first_id + i for i, c in enumerate(counts.tolist()) if c != 1.0]
            raise CoverageError(f"step {step}: ids {bad[:10]} were not summed exactly once")
        loss_sum = torch.tensor(
            [self.bookkeeping[self.B :].sum().item()], dtype=torch.float64, device=self.t.world.device
        )
        if self.t.world.size > 1:
            dist.all_reduce(loss_sum)  # only the last stage's tp rank 0 holds losses
        self._log_incidents(state, committed)
        extra: dict[str, Any] = {"world_epoch": self.ftc.epoch, "g_cur": state.plan.g, "g_ext": state.g_ext}
        return ReducedStep(
            loss=loss_sum.item() / self.B,
            ids=list(range(first_id, first_id + self.B)),
            replicas=len(self.ftc.alive_replicas),
            extra=extra,
        )

    def _recover_step(self, step: int, state: StepState, changed: WorldChanged) -> None:
        noticed = time.perf_counter()
        result = changed.result
        rep = repair(state.plan, result.failed_replicas)
        state.plan = rep.plan
        state.g_ext += rep.g_ext
        deaths = read_deaths(self.run_dir, list(result.failed_ranks), since=self.started)
        incident = Incident(
            step=step,
            phase=deaths[0]["phase"] if deaths else result.trigger,
            result=result,
            action=rep.action.value,
            lost_ids=list(rep.lost_ids),
            extra_microbatches=len(rep.redistributed_ids),
            noticed=noticed,
            detect_s=(result.detected_at - min(d["time"] for d in deaths)) if deaths else None,
        )
        state.incidents.append(incident)
        if len(self.ftc.alive_replicas) < self.args.min_replicas:
            self._stop(
                step,
                f"{len(self.ftc.alive_replicas)} replicas left, below recover.min_replicas={self.args.min_replicas}",
            )
        asynchronous = self.args.restore == "async" and self.t.world.device.type == "cuda"
        self.restore_event = self.reduction.restore(self.ftc.epoch, asynchronous=asynchronous)
        me = self.ftc.replica
        if me in rep.promoted.values() and state.shadow is not None:
            self.t.grads.flat.add_(state.shadow)  # promoted: the shadow gradients now count
            state.shadow = None
        extra_ids = rep.extra.get(me, ())
        if not extra_ids:
            self.injector.maybe_fail("recovery", 0)
        started = time.perf_counter()
        self.in_recovery = True
        self._compute(step, extra_ids, state)
        self.in_recovery = False
        if self.restore_event is not None:
            torch.cuda.current_stream().wait_event(self.restore_event)
            self.restore_event = None
        spent = time.perf_counter() - started
        for inc in state.incidents:
            inc.compute_s += spent

    def before_optimizer(self) -> None:
        self.injector.maybe_fail("optimizer", 0)

    # -- reporting and stopping ----------------------------------------------------------------
    def _log_incidents(self, state: StepState, committed: float) -> None:
        if not self.is_logger():
            return
        for inc in state.incidents:
            r = inc.result
            record = {
                "step": inc.step,
                "phase": inc.phase,
                "failed_replicas": list(r.failed_replicas),
                "failed_ranks": list(r.failed_ranks),
                "epoch": r.new_epoch,
                "action": inc.action,
                "lost_ids": inc.lost_ids,
                "extra_microbatches": inc.extra_microbatches,
                "detect_s": inc.detect_s,
                "recover_s": committed - inc.noticed - inc.compute_s,
                "shrink_s": r.shrink_s,
                "rounds": r.rounds,
                "alive_replicas": list(r.alive_replicas),
            }
            self.incident_log.write(record)
            self.t.run_logger.log_incident(record)
            self.t.progress.write(
                f"[nanotron-recover] step {inc.step}: replicas {record['failed_replicas']} failed ({inc.phase}), "
                f"{inc.action}, {inc.extra_microbatches} micro-batches redone, epoch {r.new_epoch}",
                file=sys.stdout,
            )

    def _stop(self, step: int, why: str, save: bool = True) -> None:
        """Too few replicas: the first survivor checkpoints the last committed step; all exit != 0."""
        if save and self.is_checkpoint_writer():
            path = self.t.save(step - 1)
            if self.ftc.local_rank == 0:
                print(
                    f"[nanotron-recover] stopping at step {step}: {why}. Saved step {step - 1} to {path}; "
                    "resume it in plain or recover mode with checkpoints.resume_checkpoint_path.",
                    file=sys.stderr,
                    flush=True,
                )
        try:
            self.ftc.global_comm.Barrier()  # nobody exits before the checkpoint is on disk
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_TOO_FEW_REPLICAS)

    def close(self) -> None:
        """End of training: wait for every survivor, then leave without MPI_Finalize.

        Finalize in a world that lost processes can block on connections to the dead; exit status 0
        without finalize is reported cleanly to mpirun (DESIGN.md section 4). The barrier makes sure
        nobody leaves while a peer still needs it (a checkpoint being written, a last reduction).
        """
        self.watchdog.stop()
        try:
            self.ftc.global_comm.Barrier()
        except Exception as e:
            print(f"[nanotron-recover] rank {self.ftc.rank}: final barrier failed: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
