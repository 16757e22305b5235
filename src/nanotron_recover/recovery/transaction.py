"""ForwardRecovery: the fault-tolerant data-parallel mode, one step as a transaction.

Each replica (``tp*pp`` ranks) is its own torch world; across replicas there is only the ULFM
communicator (``ft.comm``). A step ``s`` runs as follows on every rank:

1. *Plan.* ``steady_plan`` assigns the step's ``B`` ids to the alive replicas: Majors take
   ``G = ceil(B/W)`` each, a Minor the remainder, Spares shadow a Major (or idle).
2. *Compute.* The replica runs its ids through the pipeline; gradients accumulate in the local
   fp32 buffer. No cross-replica traffic. A Spare moves its shadow gradients aside: it contributes
   zeros unless promoted.
3. *Gate.* A barrier in the replica's torch world: if a member of this replica died, every other
   member learns it here (or earlier, from a broken gloo/NCCL call, or from the failure watch) and
   leaves, so a replica is always whole or gone.
4. *Reduce.* The gradient buffer, plus a bookkeeping vector (per id: how many replicas contributed
   it, and its loss; per replica: when it saw the last failure), is summed over the DP communicator
   in snapshotted, epoch-tagged buckets.
5. *Commit.* ``agree`` on the global communicator. It returns only if no rank failed; it also
   carries stop requests (below).

A failure anywhere in 2-5 surfaces on the survivors as ``WorldChanged`` from the reduction or the
agree, after the communicator has shrunk to the survivors (members of a failed replica leave by
SIGKILL). The survivors then ``repair`` the plan: a Spare shadowing a lost Major is promoted (its
gradients join the contribution, no extra compute), the other lost ids are redistributed over the
survivors (``G_ext = ceil(|L|/W)`` extra micro-batches each at most). Every stale bucket is restored
from its snapshot, the extra micro-batches are computed into the buffer, and 3-5 run again in the
new epoch. This repeats for failures during recovery. At commit the bookkeeping vector must show
every id of the step exactly once: the summed gradient is exactly the fault-free run's, divided by
the same ``B``. The next step plans again for the replicas that are left.

Hangs and deadlines. Waits on other replicas (reduce, agree, recovery) have no deadline here: a
frozen rank elsewhere is declared failed by ULFM's heartbeat detector, and killing ourselves for it
would take a healthy replica down with it. Everything only this replica can see -- compute, the
gate, the optimizer and its local reductions, the loss reduction, checkpoint saves -- runs under
the watchdog (``recover.watchdog_timeout_s``): when a local phase outlives it, the stuck replica is
the one that leaves.

Failure kinds. A rank that leaves for a reason it knows writes a failure record first
(``ft/records.py``): ``hang`` (watchdog), ``peer_error`` (gloo/NCCL error in its replica, or a
replica peer reported failed by the watch), ``oom``, ``io``, ``error`` (an exception while
computing micro-batch ``i``). When a replica computing a lost id ``i`` raises the same exception
(type and message) that an earlier replica raised on ``i``, the error is ``deterministic``: redoing
it elsewhere cannot help. Records of kind ``io`` or ``deterministic`` stop the job instead of being
repaired. Failures without a record are ``crash`` (the process is gone) or ``hang`` (it still ran
on a survivor's host at the commit; it is SIGKILLed there).

Stops. A fault that is not a replica failure -- a full disk when saving, a deterministic error --
stops the whole job once: the rank that meets it requests a stop, the request rides on the next
step agree (or the final one), every survivor learns it from the same agree, the logging rank
writes ``outcome.json``, one line names the cause, and every rank exits with the same non-zero
status. Below ``recover.min_replicas`` the survivors checkpoint the last committed step
(synchronously) and stop the same way; that checkpoint resumes in either mode.

Re-join (``recover.rejoin.mode: spawn``). The healthy ranks of a failed replica do not leave: they
park (``ft/comm.py``): they stay in the global communicator and follow its agrees
(:meth:`~nanotron_recover.ft.comm.FaultTolerantComm.follow`), which carry their kind -- a step's
commit, a re-join, the end, a stop -- so a parked rank needs no step count of its own. A rank
learns that its replica failed from its torch world (a gloo/NCCL error) or from the failure watch;
it then enters the recovery itself and parks (a rank stuck on a frozen peer leaves after a grace
period instead). At a step boundary where ``policy.rejoin`` says a replica is due, the active ranks
agree (kind ``join``), spawn the replica's dead ranks, and every rank of the replica receives a
healthy replica's state (``recovery/state_transfer.py``); the commit agree of the join makes it all or
nothing. The next step plans over the larger set of replicas; ``B`` and the ids do not change.
Every join, failed or not, is an incident of kind ``rejoin``.

``detect_s`` of an incident: from the failure to the first survivor that saw it surface in MPI.
The time of the failure is the failed rank's record when it left one (injected faults, watchdog,
errors); otherwise (a process killed or frozen from outside) it is the moment the first survivor
began the operation that then failed, i.e. the first sign of the failure on any survivor
(``detect_method``: ``record`` or ``first_wait``). ``recover_s`` runs from noticing to the commit,
minus ``redo_s``, the time spent recomputing lost micro-batches.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config, check_world_size
from ..data_parallel.protocol import JoinedState, Parked, ReducedStep, ReplicaParts
from ..errors import STOP_KINDS, StopRun
from ..ft.failstop import Watchdog, fail_stop
from ..ft.faults import FaultInjector
from ..ft.liveness import SpawnedMonitor, start_heartbeat
from ..ft.processes import ProcessInfo, reap
from ..ft.records import STOP_KINDS as RECORD_STOP_KINDS
from ..ft.records import read_records, write_record
from ..ft.replica_world import init_replica_world
from ..ft.watch import current_watch
from ..ft.world import AllReplicasFailed, JoinFailed, JoinPlan, RecoveryResult, WorldChanged
from ..logging import IncidentLog
from ..outcome import SUPERVISED_ENV
from ..parallel.context import ParallelContext
from ..parallel.world import World
from ..policy import CoverageError, StepPlan, adaptive_plan, check_coverage, repair, steady_plan
from ..policy.rejoin import RejoinBook, due_replicas
from .buckets import BucketedReduction
from .state_transfer import TransferResult, transfer_state

# Each stop kind is one bit of the step agree's stop set.
STOP_BITS = {kind: 1 << i for i, kind in enumerate(sorted(STOP_KINDS))}
# Which kind wins when several stops are agreed at once (the most specific cause first).
STOP_ORDER = ("deterministic", "io", "input", "too_few_replicas")
# Incident kind from the kinds of the records (and the unrecorded failures) of one recovery.
KIND_PRIORITY = ("deterministic", "io", "oom", "error", "hang", "crash", "peer_error")


@dataclass
class Incident:
    step: int
    phase: str
    kind: str
    result: RecoveryResult
    action: str
    lost_ids: list[int]
    extra_microbatches: int
    noticed: float  # perf_counter when this survivor learned of the failure
    failed_at: float | None  # wall clock of the failure, from a failure record
    compute_s: float = 0.0  # redone micro-batches after noticing (excluded from recover_s)


@dataclass
class StepState:
    plan: StepPlan
    computed: dict[int, float] = field(default_factory=dict)  # id -> loss (0 off the last stage)
    shadow: torch.Tensor | None = None
    incidents: list[Incident] = field(default_factory=list)
    g_ext: int = 0


def is_peer_error(error: BaseException) -> bool:
    """An error of the replica's own collectives (a peer died or the link broke), not of the math."""
    if isinstance(error, getattr(dist, "DistBackendError", ())) or isinstance(
        error, getattr(dist, "DistError", ())
    ):
        return True
    text = str(error).lower()
    return any(
        word in text for word in ("gloo", "nccl", "connection reset", "connection closed", "broken pipe")
    )


def error_kind(error: BaseException) -> str:
    if is_peer_error(error):
        return "peer_error"
    if isinstance(error, (MemoryError, getattr(torch.cuda, "OutOfMemoryError", MemoryError))):
        return "oom"
    if isinstance(error, OSError):
        return "io"
    return "error"


def signature(error: BaseException) -> str:
    """What makes two exceptions "the same": type and message, one line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]


class ForwardRecovery:
    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir, self.args = cfg, Path(run_dir), cfg.recover
        self.watchdog = Watchdog(on_expire=self._on_watchdog_expire)
        self.started = time.time()  # failure records older than this belong to an earlier run
        self.in_recovery = False
        self.restore_handle: Any = None
        self.step = 0
        self.phase = "start"
        self.computing: tuple[int, ...] = ()
        self.current_id: int | None = None
        self.pending_stop: StopRun | None = None
        # (began, surfaced) wall times of the operation in which this rank last saw a failure.
        self.last_failure_view: tuple[float, float] = (0.0, 0.0)
        self.last_step = 0
        self.target_step = cfg.tokens.train_steps
        # Re-join: the policy's book (alike on every member), when each replica was lost (for the
        # incident's join_s), and this process's start as a spawned replacement.
        self.rejoin = self.args.rejoin
        self.rejoin_on = self.rejoin.mode == "spawn"
        self.book = RejoinBook()
        self.lost_wall: dict[int, float] = {}
        self.joining = False
        self.parking = False
        self._joined: JoinedState | None = None
        # Re-join incidents wait for the next commit: the logging rank may be the one a failed
        # join lost, and its successor is known only then.
        self.rejoin_records: list[dict[str, Any]] = []
        self.told_out_of_spawns = False
        # A rank stuck on a frozen replica peer cannot park (it never gets out of its torch call):
        # past this grace it leaves, as without re-join.
        self.park_grace_s = max(5.0, 2 * self.args.heartbeat_timeout_s)

    # -- set-up ----------------------------------------------------------------------------
    def setup_world(self) -> tuple[World, ParallelContext]:
        from mpi4py import MPI

        from ..ft.comm import FaultTolerantComm  # MPI only here: the transaction itself needs none

        p = self.cfg.parallelism
        callbacks: dict[str, Any] = {
            "on_leave": self._on_leave,
            "on_failure_notice": self._on_failure_notice,
            "park_orphans": self.rejoin_on,
        }
        if MPI.Comm.Get_parent() != MPI.COMM_NULL:
            return self._setup_spawned(callbacks)
        check_world_size(self.cfg, MPI.COMM_WORLD.Get_size())
        # A replica is p.inner x p.pp ranks: tp ranks (3D) or shard ranks (HSDP) along the inside.
        self.ftc = FaultTolerantComm(p.inner, p.pp, p.dp, **callbacks)
        self.my_replica_ranks = set(self.ftc.topology.ranks_of_replica(self.ftc.replica))
        world = init_replica_world(self.ftc)
        ctx = ParallelContext.create(p.inner, p.pp, 1, world.device)
        self.injector = FaultInjector(self.args, self.ftc.rank, self.ftc.replica, self.run_dir)
        if self.ftc.rank == 0:
            self._write_rank_table()
        self._watch_spawned_processes()
        return world, ctx

    def _watch_spawned_processes(self) -> None:
        """With re-join, look after the spawned processes of this host, which ULFM's heartbeat
        detector does not watch (see ``ft/liveness.py``)."""
        if self.rejoin_on:
            SpawnedMonitor(
                self.run_dir,
                self.args.heartbeat_period_s,
                self.args.heartbeat_timeout_s,
                lambda: self.ftc.processes,
                self._on_frozen_spawned,
            ).start()

    def _on_frozen_spawned(self, info: ProcessInfo, last_beat: float, age: float) -> None:
        """Monitor thread: a spawned process of this host is frozen. Write the record it cannot
        write (a hang, at its last heartbeat), then SIGKILL it: the runtime reports the death to
        every rank, and the recovery that follows logs the incident from the record."""
        message = (
            f"spawned rank {info.rank} (pid {info.pid} on {info.host}) sent no heartbeat for {age:.1f} s"
        )
        # Its phase is this rank's when it found the freeze; its time, the last heartbeat.
        self._record("hang", rank=info.rank, pid=info.pid, time=last_beat, message=message)
        print(f"[nanotron-recover] {message}: removing it", file=sys.stderr, flush=True)
        reap(info)

    def _setup_spawned(self, callbacks: dict[str, Any]) -> tuple[World, ParallelContext]:
        """A process spawned by a re-join: take a dead rank's place, receive its replica's state
        from a healthy replica, commit the join (or die with it), then build the replica's world."""
        from ..ft.comm import FaultTolerantComm

        p = self.cfg.parallelism
        self.joining = True
        start_heartbeat(self.run_dir, self.args.heartbeat_period_s)  # nobody else watches this process
        self.ftc, pending = FaultTolerantComm.join_parent(p.inner, p.pp, p.dp, **callbacks)
        try:
            return self._join_as_spawned(pending)
        except BaseException as error:
            # An exception exit would not be reported to the job, which would wait for this process.
            self.abort(error)
            raise

    def _join_as_spawned(self, pending: Any) -> tuple[World, ParallelContext]:
        payload = pending.payload
        self.started = payload["started"]
        self.step = self.last_step = payload["step"]
        self.phase = "rejoin"
        self.my_replica_ranks = set(self.ftc.topology.ranks_of_replica(self.ftc.replica))
        self.injector = FaultInjector(self.args, self.ftc.rank, self.ftc.replica, self.run_dir)
        self.injector.begin_step(self.step, list(payload["donors"]))
        joined = self._finish_join(pending)
        assert joined is not None  # an aborted join SIGKILLs a spawned process
        self._joined = joined
        self._watch_spawned_processes()
        return joined.world, joined.ctx

    def joined_state(self) -> JoinedState | None:
        joined, self._joined = self._joined, None
        return joined

    def set_target(self, last_step: int) -> None:
        self.target_step = last_step

    def _write_rank_table(self) -> None:
        """``<run_dir>/ranks.json``: host and pid of every rank, for operators (and tests); rewritten
        (atomically) when a re-join puts new processes in the grid."""
        import json

        table = [
            {**info.as_dict(), "replica": self.ftc.topology.replica_of(info.rank)}
            for info in self.ftc.processes
        ]
        path = self.run_dir / "ranks.json"
        try:
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(table, indent=1) + "\n")
            os.replace(tmp, path)
        except OSError:
            pass

    def attach(self, parts: ReplicaParts) -> None:
        self.parts = parts
        self.B = parts.B
        self.W = self.cfg.parallelism.dp
        # [0, B): how many replicas contributed each id; [B, 2B): its loss; then per replica, when
        # it last saw a failure: [2B, 2B+W) the failing operation began, [2B+W, 2B+2W) it raised.
        self.bookkeeping = torch.zeros(2 * self.B + 2 * self.W, dtype=torch.float64)
        grads = parts.engine.grads_flat  # fp32, or int64 in exact mode: buckets keep their size in bytes
        numel = max(1, int(self.args.bucket_size_mb * 2**20) // grads.element_size())
        self.reduction = BucketedReduction([parts.engine.grads_flat, self.bookkeeping], numel)
        parts.engine.event_hook = self._engine_event
        self.incident_log = IncidentLog(self.run_dir / "incidents.jsonl")

    def agree_startup(self, error: str | None) -> str | None:
        """Every rank's start-up went well, or every rank gets the first error (lowest rank)."""
        errors = self.ftc.global_comm.allgather(error)
        return next((e for e in errors if e is not None), None)

    # -- leaving -------------------------------------------------------------------------------
    def _record(self, kind: str, rank: int | None = None, **extra: Any) -> None:
        """This rank's failure record, or (``rank``) the one a frozen process cannot write itself."""
        rank = self.ftc.rank if rank is None else rank
        record = {
            "rank": rank,
            "replica": self.ftc.topology.replica_of(rank),
            "step": self.step,
            "phase": self.phase,
        }
        write_record(self.run_dir, f"step{self.step}_{kind}_rank{rank}", {**record, **extra, "kind": kind})

    def _leave(self, kind: str, reason: str, **extra: Any) -> None:
        """This replica is lost (or stuck): record why, then fail-stop so the others recover."""
        self._record(kind, message=reason, **extra)
        # The full reason is in the record (and, for a stop, in the outcome): one short line here.
        fail_stop(f"rank {self.ftc.rank} (replica {self.ftc.replica}) leaves: {kind} during {self.phase}")

    def _on_leave(self, result: RecoveryResult) -> None:
        print(
            f"[nanotron-recover] rank {self.ftc.rank} leaves: replica {self.ftc.replica} failed "
            f"(epoch {result.old_epoch} -> {result.new_epoch})",
            file=sys.stderr,
            flush=True,
        )

    def _on_failure_notice(self, ranks: list[int], when: float) -> None:
        """Watch thread: a member of my replica failed while I was outside MPI: my replica is lost."""
        mine = getattr(self, "my_replica_ranks", set())
        lost = sorted(mine.intersection(ranks))
        if not lost or self.joining or self.ftc.in_ft_operation or self.ftc.parked:
            return
        why = f"replica peer rank(s) {lost} failed during {self.phase}"
        if not self.rejoin_on:
            self._leave("peer_error", why)
        # Re-join keeps this rank: its torch world reports a crashed peer at once and the main
        # thread parks. One stuck on a frozen peer never returns from torch: it leaves after a grace.
        timer = threading.Timer(self.park_grace_s, self._leave_unless_parked, args=(why, self.ftc.epoch))
        timer.daemon = True
        timer.start()

    def _leave_unless_parked(self, why: str, epoch: int) -> None:
        # The survivors cannot shrink past this (alive) rank: while it has not parked, the epoch
        # stays where it was. A changed epoch means it parked (and perhaps re-joined) meanwhile.
        if self.ftc.epoch == epoch and not (self.parking or self.ftc.parked or self.ftc.in_ft_operation):
            self._leave("peer_error", why + f"; not parked within {self.park_grace_s:.0f} s")

    def _on_watchdog_expire(self, reason: str) -> None:
        self._record("hang", message=reason)

    # -- roles -------------------------------------------------------------------------------
    def is_logger(self) -> bool:
        return self.is_checkpoint_writer() and self.ftc.local_rank == 0

    def is_checkpoint_writer(self) -> bool:
        # The longest-serving replica: a replica that re-joins never takes the roles over mid-run.
        return not self.ftc.parked and self.ftc.replica == self.ftc.senior_replica

    def replica_id(self) -> int:
        return self.ftc.replica

    @contextlib.contextmanager
    def local_phase(self, name: str) -> Iterator[None]:
        """A phase only this replica takes part in: under the watchdog's deadline."""
        previous, self.phase = self.phase, name
        try:
            with self.watchdog.phase(name, self.args.watchdog_timeout_s):
                yield
        except Exception as error:
            if self.rejoin_on and is_peer_error(error):
                self._park_now(f"{signature(error)} during {name}")
            raise
        finally:
            self.phase = previous

    def check_member(self) -> None:
        """Before writing shared files: a rank removed from the job (frozen, then woken up) must not."""
        if self._fence_path(self.ftc.processes[self.ftc.rank]).exists():
            fail_stop(f"rank {self.ftc.rank} was removed from the job; not writing")

    def _fence_path(self, info: Any) -> Path:
        # Per process, not per rank: after a re-join the rank belongs to a new process.
        return self.run_dir / "fence" / f"{info.host}-{info.pid}"

    def request_stop(self, stop: StopRun) -> None:
        """Stop the whole job at the next agree (the first request wins)."""
        if self.pending_stop is None:
            self.pending_stop = stop

    def abort(self, error: BaseException) -> None:
        """Any other error escaping the step becomes a fail-stop: an exception exit would not be
        reported to the other replicas, which would then wait for this rank forever."""
        traceback.print_exception(error)
        kind = (
            error.kind
            if isinstance(error, StopRun) and error.kind in RECORD_STOP_KINDS
            else error_kind(error)
        )
        self._leave(kind, f"{type(error).__name__}: {' '.join(str(error).split())}")

    # -- phases --------------------------------------------------------------------------------
    def _engine_event(self, kind: str, index: int) -> None:
        if kind == "forward" and index < len(self.computing):
            self.current_id = self.computing[index]
        if self.in_recovery:
            if kind == "forward":
                self.injector.maybe_fail("recovery", index)
        else:
            self.injector.maybe_fail(kind, index)
        if kind == "forward" and self.current_id is not None:
            self.injector.maybe_raise(self.current_id)
        if kind == "backward" and self.restore_handle is not None:
            # Asynchronous restore: gradients may accumulate only once the buffer is restored.
            self._wait_restore()

    def _wait_restore(self) -> None:
        if self.restore_handle is not None:
            self.restore_handle.wait()
            self.restore_handle = None

    def _compute(self, step: int, ids: tuple[int, ...], state: StepState) -> None:
        if not ids:
            return
        t = self.parts
        source = t.data(step)
        self.computing = ids
        try:
            with self.local_phase("recovery" if self.in_recovery else "compute"):
                losses = t.engine.train_batch([source.get(i) for i in ids], loss_scale=1.0 / self.B)
        except Exception as error:
            self.phase = "recovery" if self.in_recovery else "compute"
            self._compute_failed(step, error)
        finally:
            self.computing, self.current_id = (), None
        keep_loss = t.engine.holds_loss  # count each micro-batch's loss on one rank of the replica
        for k, i in enumerate(ids):
            state.computed[i] = losses[k] if keep_loss else 0.0

    def _compute_failed(self, step: int, error: BaseException) -> None:
        """An exception while computing: this replica's torch world can no longer be trusted, so the
        replica leaves; the record tells the survivors whether to repair forward or stop."""
        kind = error_kind(error)
        sig = signature(error)
        ids = [self.current_id] if self.current_id is not None else list(self.computing)
        message = f"{sig} (micro-batch {ids} of step {step})"
        if kind in ("error", "oom"):
            for earlier in read_records(self.run_dir, since=self.started):
                if (
                    earlier.get("replica") != self.ftc.replica
                    and earlier.get("error") == sig
                    and set(earlier.get("ids") or ()) & set(ids)
                ):
                    kind = "deterministic"
                    message = (
                        f"deterministic error: micro-batch {ids} of step {step} failed in replica "
                        f"{earlier['replica']} and again in replica {self.ftc.replica}: {sig}"
                    )
                    break
        if kind == "peer_error":
            print(f"[nanotron-recover] rank {self.ftc.rank}: {sig}", file=sys.stderr, flush=True)
            if self.rejoin_on:
                self._park_now(message)
        else:
            traceback.print_exception(error)
        if (
            kind in RECORD_STOP_KINDS
            and self.ftc.alive_replicas == [self.ftc.replica]
            and self.ftc.local_rank == 0
        ):
            # No other replica is left to stop the job: say it and record it here.
            self._end_with(self.last_step, StopRun(kind, message))
        self._leave(kind, message, ids=ids, error=sig)

    def _gate(self) -> None:
        self.injector.maybe_fail("gate", 0)
        world = self.parts.world
        if world.size == 1:
            return
        try:
            with self.local_phase("gate"):
                if world.backend == "gloo":
                    dist.monitored_barrier(timeout=timedelta(seconds=self.args.gate_timeout_s))
                else:
                    dist.barrier()
        except Exception as e:
            why = f"replica-consistency gate failed: {' '.join(str(e).split())[:300]}"
            if self.rejoin_on:
                self._park_now(why)
            self._leave("peer_error", why)

    def _fill_bookkeeping(self, state: StepState, first_id: int) -> None:
        self.bookkeeping.zero_()
        for i in state.plan.contributed_by(self.ftc.replica):
            if i not in state.computed:
                raise CoverageError(f"replica {self.ftc.replica} contributes id {i} it never computed")
            self.bookkeeping[i - first_id] += 1.0
            self.bookkeeping[self.B + i - first_id] += state.computed[i]
        began, surfaced = self.last_failure_view
        self.bookkeeping[2 * self.B + self.ftc.replica] = began
        self.bookkeeping[2 * self.B + self.W + self.ftc.replica] = surfaced

    def _stop_bits(self) -> int:
        return 0 if self.pending_stop is None else STOP_BITS[self.pending_stop.kind]

    # -- the step ------------------------------------------------------------------------------
    def reduced_gradients(self, step: int) -> ReducedStep:
        self.step = step
        alive = self.ftc.alive_replicas
        self.injector.begin_step(step, alive)
        # The policy counts steps from 0: its step t holds ids t*B .. t*B+B-1.
        if self.args.policy == "adaptive_world":
            state = StepState(plan=adaptive_plan(step - 1, self.B, self.W, alive))
        else:
            state = StepState(plan=steady_plan(step - 1, self.B, alive, self.args.spares))
        self.reduction.reset()
        self.last_failure_view = (0.0, 0.0)
        me = self.ftc.replica
        mine = state.plan.assignments[me]
        self._compute(step, mine.ids, state)
        if not mine.contributes:
            state.shadow = self.parts.engine.grads_flat.clone()  # a Spare's gradients count only if promoted
            self.parts.engine.grads_flat.zero_()
        first_id = (step - 1) * self.B

        while True:
            self._gate()
            self._fill_bookkeeping(state, first_id)
            try:
                # No deadline: the only waits here are on other replicas (see module docstring).
                self.phase = "reduce"
                self.reduction.reduce(
                    self.ftc,
                    self.ftc.epoch,
                    before_bucket=lambda b: self.injector.maybe_fail("reduce", b),
                )
                self.phase = "agree"
                self.injector.maybe_fail("agree", 0)
                _, stop = self.ftc.agree(True, stop=self._stop_bits())
                break
            except WorldChanged as changed:
                self._note_failure(step, changed.result)
                if changed.result.parked:
                    raise Parked(f"replica {self.ftc.replica} failed in step {step}") from None
                self._recover_step(step, state, changed)
            except AllReplicasFailed as gone:
                self._stop(step - 1, StopRun("too_few_replicas", str(gone)), announce=False)
        committed = time.perf_counter()
        if stop:
            self._log_incidents(state.incidents, committed)
            self._stop(step - 1, self._agreed_stop(stop), known=False, announce=False)

        counts = self.bookkeeping[: self.B]
        summed = [first_id + i for i, c in enumerate(counts.tolist()) if c == 1.0]
        if state.plan.policy == "adaptive_world":
            # The dropped ids are summed zero times; every other id exactly once, as the plan says.
            if summed != sorted(state.plan.contributed_ids()) or not torch.all((counts == 0) | (counts == 1)):
                raise CoverageError(f"step {step}: the ids summed differ from the adaptive plan's")
        elif len(summed) != self.B:
            bad = [first_id + i for i, c in enumerate(counts.tolist()) if c != 1.0]
            raise CoverageError(f"step {step}: ids {bad[:10]} were not summed exactly once")
        divisor = len(summed)
        if divisor != self.B:
            # Micro-batch gradients were scaled by 1/B as they were computed; the adaptive world
            # averages over what was summed.
            self.parts.engine.grads_flat.mul_(self.B / divisor)
        loss_sum = torch.tensor(
            [self.bookkeeping[self.B : 2 * self.B].sum().item()],
            dtype=torch.float64,
            device=self.parts.world.device,
        )
        if self.parts.world.size > 1:
            with self.local_phase("loss"):
                dist.all_reduce(loss_sum)  # only the last stage's tp rank 0 holds losses
        self._log_incidents(state.incidents, committed)
        self._flush_rejoin_records()
        extra: dict[str, Any] = {"world_epoch": self.ftc.epoch, "g_cur": state.plan.g, "g_ext": state.g_ext}
        return ReducedStep(
            loss=loss_sum.item() / divisor,
            ids=summed,
            replicas=len(self.ftc.alive_replicas),
            extra=extra,
        )

    def _agreed_stop(self, bits: int) -> StopRun:
        """The stop every survivor agreed on; the message is known only where it was requested."""
        kind = next(k for k in STOP_ORDER if bits & STOP_BITS[k])
        if self.pending_stop is not None and self.pending_stop.kind == kind:
            return self.pending_stop
        return StopRun(kind, f"stop requested by another replica ({kind})")

    def _incident_kind(self, result: RecoveryResult, records: list[dict]) -> str:
        kinds = {r["kind"] for r in records}
        recorded = {r["rank"] for r in records}
        unrecorded = set(result.failed_ranks) - recorded
        if unrecorded & set(result.hung_ranks):
            kinds.add("hang")
        elif unrecorded:
            kinds.add("crash")
        return next((k for k in KIND_PRIORITY if k in kinds), "crash")

    def _incident(
        self, step: int, result: RecoveryResult, action: str, lost: list[int], extra: int
    ) -> tuple[Incident, list[dict]]:
        pids = {r: self.ftc.processes[r].pid for r in result.failed_ranks}
        records = read_records(self.run_dir, list(result.failed_ranks), since=self.started, pids=pids)
        causes = [r for r in records if r["kind"] != "peer_error"]
        incident = Incident(
            step=step,
            phase=causes[0]["phase"] if causes else (records[0]["phase"] if records else result.trigger),
            kind=self._incident_kind(result, records),
            result=result,
            action=action,
            lost_ids=lost,
            extra_microbatches=extra,
            noticed=time.perf_counter(),
            failed_at=min(r["time"] for r in causes) if causes else None,
        )
        return incident, records

    def _recover_step(self, step: int, state: StepState, changed: WorldChanged) -> None:
        result = changed.result
        surfaced = result.detected_at
        self.last_failure_view = (surfaced - result.detect_s, surfaced)
        if not result.failed_replicas:
            # Only parked ranks failed: no contribution is lost, but the world (epoch) changed.
            self.restore_handle = self.reduction.restore(self.ftc.epoch, asynchronous=False)
            self._wait_restore()
            return
        rep = repair(state.plan, result.failed_replicas)
        check_coverage(rep.plan)  # a bad repair is caught before any extra micro-batch is computed
        state.plan = rep.plan
        state.g_ext += rep.g_ext
        incident, records = self._incident(
            step, result, rep.action.value, list(rep.lost_ids), len(rep.redistributed_ids)
        )
        state.incidents.append(incident)
        self._fence(result.failed_ranks)
        stopping = [r for r in records if r["kind"] in RECORD_STOP_KINDS]
        if stopping:
            self._log_incidents(state.incidents, time.perf_counter())
            self._stop(
                step - 1, StopRun(stopping[0]["kind"], stopping[0].get("message", stopping[0]["kind"]))
            )
        if len(self.ftc.alive_replicas) < self.args.min_replicas:
            self._log_incidents(state.incidents, time.perf_counter())
            why = (
                f"{len(self.ftc.alive_replicas)} replicas left, below "
                f"recover.min_replicas={self.args.min_replicas}"
            )
            self._stop(step - 1, StopRun("too_few_replicas", why), save=True)
        asynchronous = self.args.restore == "async" and self.parts.world.device.type == "cuda"
        self.restore_handle = self.reduction.restore(self.ftc.epoch, asynchronous=asynchronous)
        me = self.ftc.replica
        if me in rep.promoted.values() and state.shadow is not None:
            # The side stream may still be copying snapshots into this memory: wait first.
            self._wait_restore()
            self.parts.engine.grads_flat.add_(state.shadow)  # promoted: the shadow gradients now count
            state.shadow = None
        extra_ids = rep.extra.get(me, ())
        if not extra_ids:
            self.injector.maybe_fail("recovery", 0)
        started = time.perf_counter()
        self.in_recovery = True
        try:
            self._compute(step, extra_ids, state)
        finally:
            self.in_recovery = False
        self._wait_restore()
        spent = time.perf_counter() - started
        for inc in state.incidents:
            inc.compute_s += spent

    def _fence(self, failed_ranks: tuple[int, ...]) -> None:
        """Mark removed processes so that one that wakes up later writes nothing (see check_member)."""
        if not self.is_logger():
            return
        for r in failed_ranks:
            try:
                (self.run_dir / "fence").mkdir(exist_ok=True)
                self._fence_path(self.ftc.processes[r]).touch()
            except OSError:
                pass

    def before_optimizer(self) -> None:
        self.injector.maybe_fail("optimizer", 0)

    def fault_point(self, phase: str) -> None:
        self.injector.maybe_fail(phase, 0)

    def after_step(self, step: int) -> None:
        self.last_step = step
        if self.rejoin_on:
            self._join_point(step)

    # -- re-join -------------------------------------------------------------------------------
    def _note_failure(self, step: int, result: RecoveryResult) -> None:
        """Every member notes the replicas lost in this step alike (the re-join policy's input)."""
        self.book.lost(result.failed_replicas, step)
        for r in result.failed_replicas:
            self.lost_wall[r] = result.detected_at

    def _park_now(self, why: str) -> None:
        """My replica lost a member while this rank is healthy: enter the recovery myself (which
        wakes the peers waiting on me) and stay in the job, parked; raises :class:`Parked`."""
        self.parking = True
        # The shrink must see the peer's failure, or the replica would look whole: wait until this
        # process's MPI knows of it (the runtime reports a crash within milliseconds).
        watch = current_watch()
        deadline = time.time() + self.park_grace_s
        while (
            watch is not None and not watch.known_failed() & self.my_replica_ranks and time.time() < deadline
        ):
            time.sleep(0.02)
        try:
            result = self.ftc.recover()
        except AllReplicasFailed as gone:
            self._stop(self.last_step, StopRun("too_few_replicas", str(gone)), announce=False)
        self._note_failure(self.step, result)
        if not result.parked:
            self._leave("peer_error", why)  # my replica still stands but my torch world broke
        print(f"[nanotron-recover] rank {self.ftc.rank} parked: {why[:160]}", file=sys.stderr, flush=True)
        raise Parked(why)

    def park(self) -> JoinedState:
        """A parked rank: drop the broken replica world and follow the job until the replica re-joins."""
        self.parking = True
        self.in_recovery = False
        self.restore_handle = None
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass  # the world is broken anyway; a new one is built on re-join
        joined = self._follow()
        self.parking = False
        return joined

    def _follow(self) -> JoinedState:
        """Follow the active ranks' global agrees: stop, end or re-join with them."""
        while True:
            try:
                stop, kind = self.ftc.follow(self._stop_bits())
            except WorldChanged:
                continue
            except AllReplicasFailed as gone:
                self._stop(self.last_step, StopRun("too_few_replicas", str(gone)), announce=False)
            if stop:
                self._stop(self.last_step, self._agreed_stop(stop), known=False, announce=False)
            if kind == "finish":
                self.close()  # exits
            if kind == "join":
                joined = self._join(None, self.last_step)
                if joined is not None:
                    return joined

    def _join_point(self, step: int) -> None:
        """At the boundary after ``step``: bring back the replicas the policy says are due."""
        r = self.rejoin
        while True:
            decision = due_replicas(
                self.book,
                step,
                self.target_step,
                self.ftc.alive_replicas,
                after_steps=r.after_steps,
                max_spawns=r.max_spawns,
                max_failures_per_replica=r.max_failures_per_replica,
            )
            for replica in decision.give_up:
                self.book.given_up.append(replica)
                self._log_rejoin(
                    step,
                    {
                        "status": "given_up",
                        "replicas": [replica],
                        "reason": (
                            f"replica {replica} was lost {self.book.losses.get(replica, 0)} times "
                            f"(recover.rejoin.max_failures_per_replica={r.max_failures_per_replica})"
                        ),
                    },
                )
            if decision.out_of_spawns and not self.told_out_of_spawns:
                self.told_out_of_spawns = True
                self._log_rejoin(
                    step,
                    {
                        "status": "given_up",
                        "replicas": sorted(self.book.lost_at),
                        "reason": (
                            f"recover.rejoin.max_spawns={r.max_spawns} spawn attempts used; the job stays at its width"
                        ),
                    },
                )
            if not decision.replicas:
                return
            try:
                self.phase = "rejoin"
                _, stop = self.ftc.agree(True, stop=self._stop_bits(), kind="join")
                if stop:  # a stop is pending (e.g. a failed save): no join for a job that ends
                    self._stop(step, self._agreed_stop(stop), known=False, announce=False)
                break
            except WorldChanged as changed:
                self._note_failure(step, changed.result)
                if changed.result.parked:
                    raise Parked(f"replica {self.ftc.replica} failed after step {step}") from None
                incident, records = self._incident(step, changed.result, "none", [], 0)
                self._fence(changed.result.failed_ranks)
                self._log_incidents([incident], time.perf_counter())
                stopping = [rec for rec in records if rec["kind"] in RECORD_STOP_KINDS]
                if stopping:
                    self._stop(step, StopRun(stopping[0]["kind"], stopping[0].get("message", "")))
                if len(self.ftc.alive_replicas) < self.args.min_replicas:
                    why = (
                        f"{len(self.ftc.alive_replicas)} replicas left, below "
                        f"recover.min_replicas={self.args.min_replicas}"
                    )
                    self._stop(step, StopRun("too_few_replicas", why), save=True)
            except AllReplicasFailed as gone:
                self._stop(step, StopRun("too_few_replicas", str(gone)), announce=False)
        self._join(decision.replicas, step)

    def spawn_command(self) -> list[str]:
        """How a replacement process starts: this rank's own command line, through the CLI."""
        return [sys.executable, "-m", "nanotron_recover.cli", *sys.argv[1:]]

    def spawn_info(self) -> dict[str, str]:
        info = {"wdir": os.getcwd()}
        if self.rejoin.hosts:
            info["host"] = ",".join(self.rejoin.hosts)
        if self.rejoin.hostfile:
            info["hostfile"] = str(self.rejoin.hostfile)
        return info

    def _join(self, replicas: tuple[int, ...] | None, step: int) -> JoinedState | None:
        """One re-join on a member: active ranks pass the due ``replicas``, parked ranks None (the
        root's plan reaches them). Returns the new state on a reused parked rank of a replica that
        came back, None elsewhere and on an abort."""
        plan = None
        if replicas is not None:
            members = set(self.ftc.members)
            ranks = [r for rep in replicas for r in self.ftc.topology.ranks_of_replica(rep)]
            plan = JoinPlan(
                replicas=tuple(replicas),
                new_ranks=tuple(r for r in ranks if r not in members),
                reused_ranks=tuple(r for r in ranks if r in members),
            )
        payload = {
            "step": step,
            "started": self.started,
            "book": self.book.as_dict(),
            "donors": self.ftc.alive_replicas,
        }
        self.phase = "rejoin"
        if not self.ftc.parked:
            self.injector.maybe_fail("rejoin", 0)
        try:
            pending = self.ftc.begin_join(plan, self.spawn_command(), self.spawn_info(), payload)
        except JoinFailed as failed:
            if replicas is not None:
                self.book.attempted(list(replicas), step, joined=False, spawn_failed=failed.could_not_start)
                self._log_rejoin(
                    step, {"status": "failed", "replicas": list(replicas), "reason": str(failed)}
                )
            return None
        return self._finish_join(pending)

    def _finish_join(self, pending: Any) -> JoinedState | None:
        """Steps 4-5 of a re-join, alike on members and spawned processes: move the state, commit,
        and on the re-joining replica build its torch world."""
        from mpi4py import MPI

        plan, payload = pending.plan, pending.payload
        me = self.ftc.replica
        donors, rejoining = list(payload["donors"]), list(plan.replicas)
        transfer = TransferResult(pending.ok, None, 0, 0.0)
        if pending.ok and pending.dp_comm is not None:
            transfer = transfer_state(
                pending.dp_comm,
                me,
                donors,
                rejoining,
                export=lambda: self.parts.engine.export_state(),
                fault_point=lambda: self.injector.maybe_fail("rejoin", 1),
            )
        ok = transfer.ok
        stats = []
        if ok:
            try:
                received = transfer.state_bytes if me in rejoining else 0
                stats = pending.merged.allgather((received, transfer.seconds))
            except MPI.Exception:
                ok = False
                try:
                    pending.merged.Revoke()
                except MPI.Exception:
                    pass
        committed = self.ftc.commit_join(pending, ok)  # a spawned process dies here on an abort
        if committed and me in rejoining:
            # A member now: the failure watch's grace applies again (a peer may die while the
            # replica's world is being built).
            self.joining = self.parking = False
        self.book = RejoinBook.from_dict(payload["book"])
        self.book.attempted(rejoining, payload["step"], committed)
        record: dict[str, Any] = {"status": "joined" if committed else "failed", "replicas": rejoining}
        if committed:
            record.update(
                spawned_ranks=list(plan.new_ranks),
                orphans_reused=list(plan.reused_ranks),
                state_bytes=int(sum(b for b, _ in stats)),
                transfer_s=max((t for _, t in stats), default=0.0),
                spawn_s=pending.spawn_s,
                join_s=time.time()
                - min((self.lost_wall.get(r, time.time()) for r in rejoining), default=time.time()),
                epoch=self.ftc.epoch,
            )
        else:
            record["reason"] = "a member failed during the re-join"
        self._log_rejoin(payload["step"], record)
        if committed:
            self._flush_rejoin_records()
            if self.is_logger():
                self._write_rank_table()
        if not committed or me not in rejoining:
            return None
        world = init_replica_world(self.ftc)
        p = self.cfg.parallelism
        ctx = ParallelContext.create(p.inner, p.pp, 1, world.device)
        self.my_replica_ranks = set(self.ftc.topology.ranks_of_replica(me))
        self.step = self.last_step = payload["step"]
        return JoinedState(step=payload["step"], engine_state=transfer.received, world=world, ctx=ctx)

    def _log_rejoin(self, step: int, fields: dict[str, Any]) -> None:
        """A ``rejoin`` incident (joined, failed or given up), written at the next commit."""
        self.rejoin_records.append({"step": step, "kind": "rejoin", **fields})

    def _flush_rejoin_records(self) -> None:
        records, self.rejoin_records = self.rejoin_records, []
        if self.is_logger():
            for record in records:
                self._write_rejoin(record)

    def _write_rejoin(self, record: dict[str, Any]) -> None:
        fields, step = record, record["step"]
        record = {**record, "alive_replicas": self.ftc.alive_replicas}
        try:
            self.incident_log.write(record)
        except OSError as e:
            print(f"[nanotron-recover] incident not logged: {e}", file=sys.stderr, flush=True)
        self.parts.log_incident(record)
        if fields["status"] == "joined":
            line = (
                f"replicas {record['replicas']} re-joined after step {step}: {len(record['spawned_ranks'])} "
                f"spawned, {len(record['orphans_reused'])} reused, {record['state_bytes'] / 2**20:.1f} MiB in "
                f"{record['transfer_s']:.2f} s; {len(self.ftc.alive_replicas)} replicas"
            )
        else:
            line = f"re-join of replicas {record['replicas']} {fields['status'].replace('_', ' ')}: {fields.get('reason', '')}"
        self.parts.write_line(f"[nanotron-recover] step {step}: {line}")

    # -- reporting and stopping ----------------------------------------------------------------
    def _detect(self, inc: Incident) -> tuple[float | None, str]:
        """(detect_s, method) of an incident, from the per-replica views reduced in the bookkeeping."""
        alive = self.ftc.alive_replicas
        began = [float(self.bookkeeping[2 * self.B + r]) for r in alive]
        surfaced = [float(self.bookkeeping[2 * self.B + self.W + r]) for r in alive]
        began = [b for b in began if b > 0] or [inc.result.detected_at - inc.result.detect_s]
        surfaced = [s for s in surfaced if s > 0] or [inc.result.detected_at]
        if inc.failed_at is not None:
            return max(0.0, min(surfaced) - inc.failed_at), "record"
        return max(0.0, min(surfaced) - min(began)), "first_wait"

    def _log_incidents(self, incidents: list[Incident], committed: float) -> None:
        """Write these incidents (the logging rank only) and forget them."""
        incidents, taken = list(incidents), incidents
        taken.clear()
        if not self.is_logger():
            return
        self.check_member()
        for inc in incidents:
            r = inc.result
            detect_s, method = self._detect(inc)
            record = {
                "step": inc.step,
                "phase": inc.phase,
                "kind": inc.kind,
                "failed_replicas": list(r.failed_replicas),
                "failed_ranks": list(r.failed_ranks),
                "hung_ranks": list(r.hung_ranks),
                "epoch": r.new_epoch,
                "action": inc.action,
                "lost_ids": inc.lost_ids,
                "extra_microbatches": inc.extra_microbatches,
                "detect_s": detect_s,
                "detect_method": method,
                "recover_s": max(0.0, committed - inc.noticed - inc.compute_s),
                "redo_s": inc.compute_s,
                "shrink_s": r.shrink_s,
                "rounds": r.rounds,
                "alive_replicas": list(r.alive_replicas),
            }
            try:
                self.incident_log.write(record)
            except OSError as e:
                print(f"[nanotron-recover] incident not logged: {e}", file=sys.stderr, flush=True)
            self.parts.log_incident(record)
            self.parts.write_line(
                f"[nanotron-recover] step {inc.step}: replicas {record['failed_replicas']} failed "
                f"({inc.kind} in {inc.phase}), {inc.action}, {inc.extra_microbatches} micro-batches redone, "
                f"epoch {r.new_epoch}"
            )

    def _write_outcome(self, status: str, last_step: int, stop: StopRun | None) -> bool:
        return self.parts.write_outcome(status, last_step, stop)

    def _stop(
        self, last_step: int, stop: StopRun, save: bool = False, known: bool = True, announce: bool = True
    ) -> None:
        """Stop the whole job: every survivor calls this after the same agree or recovery.

        With ``save`` (too few replicas) the checkpoint writer first saves the last committed step
        synchronously, so the checkpoint the message names exists when the job has ended. The
        message is known only where the cause was met; one allgather gives it to everyone, the
        logging rank records the outcome and says it in one line, and all exit with its status."""
        if announce and self.rejoin_on:
            # Parked ranks learn of a stop the active ranks decided on their own from an agree.
            while True:
                try:
                    self.ftc.agree(True, stop=STOP_BITS[stop.kind], kind="stop")
                    break
                except WorldChanged:
                    continue
                except AllReplicasFailed:
                    break
        message = stop.message
        knows_cause = self.pending_stop is not None and self.pending_stop.kind == stop.kind
        # A stop agreed in the step agree (known=False) carries only its kind: the message is with the
        # rank(s) that requested it, and must not be replaced by this rank's placeholder.
        knows_cause = knows_cause or (
            known and (stop.kind in RECORD_STOP_KINDS or "no replica left" in message)
        )
        if save and self.is_checkpoint_writer():
            knows_cause = True
            try:
                path = self.parts.save(last_step, True)
                message += (
                    f". Saved step {last_step} to {path}; resume it in plain or recover mode with "
                    "checkpoints.resume_checkpoint_path"
                )
            except Exception as e:
                message += f". Could not save step {last_step}: {' '.join(str(e).split())}"
        try:
            known = self.ftc.global_comm.allgather(message if knows_cause else None)
            message = next((m for m in known if m), message)
        except Exception:
            pass  # a failure now: keep what this rank knows
        stop = StopRun(stop.kind, message)
        if self.is_logger():
            self._end_with(last_step, stop)
        self.watchdog.stop()
        self.ftc.stop_watch()
        try:
            self.ftc.barrier()  # nobody exits before the checkpoint and the outcome are on disk
        except Exception:
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(stop.exit_code))

    def _end_with(self, last_step: int, stop: StopRun) -> None:
        """Record a stop and say it once: here, unless a supervising launcher will print the record."""
        recorded = self._write_outcome("stopped", last_step, stop)
        if not (recorded and os.environ.get(SUPERVISED_ENV) == "1"):
            print(
                f"nanotron-recover: stopped after step {last_step}: {stop.message}",
                file=sys.stderr,
                flush=True,
            )

    def finish(self, last_step: int, resave: Any = None) -> None:
        """End of training: one more agree, so that a stop requested after the last step (its save
        failed) or a failure during the final save is seen by everyone; then the outcome.

        ``resave(step)``, if given, saves ``last_step`` again on the new checkpoint writer when a
        failure struck during this last agree (the replica that was saving may be the one lost)."""
        self.last_step = last_step
        self.step = last_step
        while True:
            try:
                self.phase = "finish"
                _, stop = self.ftc.agree(True, stop=self._stop_bits(), kind="finish")
                break
            except WorldChanged as changed:
                result = changed.result
                self._note_failure(last_step, result)
                if result.parked:
                    self._follow()  # never returns: the end (or a stop) comes through the agrees
                self.last_failure_view = (result.detected_at - result.detect_s, result.detected_at)
                incident, records = self._incident(last_step, result, "none", [], 0)
                self._fence(result.failed_ranks)
                self._log_incidents([incident], time.perf_counter())
                stopping = [r for r in records if r["kind"] in RECORD_STOP_KINDS]
                if stopping:
                    self._stop(last_step, StopRun(stopping[0]["kind"], stopping[0].get("message", "")))
                if resave is not None and self.is_checkpoint_writer():
                    resave(last_step)
            except AllReplicasFailed as gone:
                self._stop(last_step, StopRun("too_few_replicas", str(gone)), announce=False)
        if stop:
            self._stop(last_step, self._agreed_stop(stop), known=False, announce=False)
        self._flush_rejoin_records()
        if self.is_logger():
            self.check_member()
            self._write_outcome("completed", last_step, None)

    def close(self) -> None:
        """End of training: wait for every survivor, then leave without MPI_Finalize.

        Finalize in a world that lost processes can block on connections to the dead, and with the
        heartbeat detector on it blocked even without a failure (Open MPI 5.0.11); exit status 0
        without finalize is reported cleanly to mpirun. The barrier makes sure nobody leaves while
        a peer still needs it (a checkpoint being written, a last reduction).
        """
        self.watchdog.stop()
        self.ftc.stop_watch()
        try:
            self.ftc.barrier()
        except Exception as e:
            print(f"[nanotron-recover] rank {self.ftc.rank}: final barrier failed: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
