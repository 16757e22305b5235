"""ForwardRecovery: the fault-tolerant data-parallel mode, built from small parts.

Each replica (``tp*pp`` ranks) is its own torch world; across replicas there is only the ULFM
communicator (``ft/comm.py``). The mode builds its parts around one per-rank state
(``rank_state.py``) and answers the trainer's few questions (``data_parallel/protocol.py``):

====================  ==========================================================================
part                  job
====================  ==========================================================================
``members.py``        roles, leaving (record + SIGKILL), failure notices, fences, spawned
                      processes' liveness, the rank table
``incidents.py``      the kind and cost of each recovery; incidents.jsonl and W&B
``stops.py``          stop requests and agreed stops, the verdict after a failure, the exit
``rejoin.py``         parking, following, the join point, a spawned process's start
``step.py``           the step transaction: plan, compute, gate, reduce, agree, repair, commit
``buckets.py``        snapshotted, epoch-tagged bucketed reduction (``streams.py``: CUDA restores)
``state_transfer.py`` a re-joining replica's state from a healthy one
====================  ==========================================================================

Each part imports only the ones above it in this table's reverse order (members < incidents <
stops < rejoin < step < mode). A part that must end the job raises
:class:`~.stops.StopJob`; this module is the only place where it becomes an exit, and where a
:class:`~nanotron_recover.data_parallel.protocol.Parked` gets its way back (``wait_for_rejoin``).
"""

from __future__ import annotations

import contextlib
import functools
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from ...checkpoint import checkpoints_root, resume_step
from ...config import Config, launched_replicas
from ...errors import StopRun
from ...failures import Phase, classify
from ...ft.failstop import Watchdog
from ...ft.faults import FaultInjector
from ...ft.replica_world import init_replica_world
from ...ft.topology import Topology
from ...ft.world import AllReplicasFailed, RecoveryResult, WorldChanged
from ...generation import Relaunch, read_generation, read_relaunch
from ...parallel.context import ParallelContext
from ...parallel.world import World
from ..protocol import JoinedState, Parked, ReducedStep, ReplicaParts
from .incidents import Incidents
from .members import Members
from .rank_state import RankState
from .rejoin import Rejoin
from .restore import restore_from_snapshots, snapshot_layout_id
from .snapshot_folder import snapshot_run_id
from .snapshots import NodeSnapshots, SnapshotSkipped
from .step import StepTransaction
from .stops import StopJob, Stops

T = TypeVar("T")

# The re-join stages of ft/join.py where an injected ``phase: rejoin`` fault may fire (its microbatch).
JOIN_FAULT_POINTS = {"join:spawned": 2, "join:merged": 3}
# The communicator's points while it builds the first world: ``phase: start`` faults of a first
# launch (``step: 0``), by micro-batch index.
START_FAULT_POINTS = {"start:dup": 0, "start:split": 1, "start:gathered": 2}


def _ends_here(method: Callable[..., T]) -> Callable[..., T]:
    """A stop raised by a part becomes the exit here; a parked rank gets its way back."""

    @functools.wraps(method)
    def run(self: ForwardRecovery, *args: Any, **kwargs: Any) -> T:
        try:
            return method(self, *args, **kwargs)
        except StopJob as job:
            self._snapshots_at_stop(job)
            self.stops.exit(job)
        except Parked as parked:
            parked.wait_for_rejoin = self._wait_for_rejoin
            raise

    return run


class ForwardRecovery:
    def __init__(self, cfg: Config, run_dir: Path):
        self.s = s = RankState(cfg=cfg, run_dir=Path(run_dir), watchdog=None)  # type: ignore[arg-type]
        self.members = Members(s)
        s.watchdog = Watchdog(on_expire=self.members.on_watchdog_expire)
        self.incidents = Incidents(s, self.members)
        self.stops = Stops(s, self.members, self.incidents)
        self.rejoin = Rejoin(s, self.members, self.incidents, self.stops)
        self.steps = StepTransaction(s, self.members, self.incidents, self.stops, self.rejoin)
        self.snapshots: NodeSnapshots | None = None
        self._snapshot_warned = ""  # the last snapshot failure reported, not repeated every step
        self.relaunch: Relaunch | None = None  # this job's relaunch record, until its incident
        self.state_from: str | None = None  # where a relaunched job's state came from
        self.restored_at: float | None = None  # wall clock when a relaunched job had its state

    # -- set-up ----------------------------------------------------------------------------
    def setup_world(self) -> tuple[World, ParallelContext, JoinedState | None]:
        from mpi4py import MPI

        from ...ft.comm import FaultTolerantComm  # MPI only here: the parts need none at import

        s, p = self.s, self.s.cfg.parallelism
        callbacks: dict[str, Any] = {
            "on_leave": self.members.on_leave,
            "on_failure_notice": self.members.on_failure_notice,
            "park_orphans": s.rejoin_on,
            "fault_hook": self._comm_fault_point,
        }
        s.generation = read_generation(s.run_dir)
        if MPI.Comm.Get_parent() != MPI.COMM_NULL:
            try:
                joined = self.rejoin.start_spawned(callbacks)
            except BaseException as error:
                # An exception exit would not be reported to the job, which would wait for this process.
                self.abort(error)
                raise
            self._name_failures_during_agreements()
            self.members.watch_spawned_processes()
            self._guard_partitions()
            return joined.world, joined.ctx, joined
        launched = launched_replicas(s.cfg, MPI.COMM_WORLD.Get_size(), relaunched=s.generation > 0)
        if s.generation == 0:
            # Injected ``phase: start`` faults of a first launch strike while the first world is
            # built (_comm_fault_point); the injector of the job proper is made below.
            rank = MPI.COMM_WORLD.Get_rank()
            replica = Topology(tp=p.inner, pp=p.pp, n_replicas=p.dp).coords(rank).replica
            s.injector = FaultInjector(s.args, rank, replica, s.run_dir)
            s.injector.begin_step(0, list(range(launched)))
        # A replica is p.inner x p.pp ranks: tp ranks (3D) or shard ranks (HSDP) along the inside.
        s.ftc = FaultTolerantComm(p.inner, p.pp, p.dp, launched_replicas=launched, **callbacks)
        s.my_replica_ranks = s.replica_ranks()
        self._name_failures_during_agreements()
        world = init_replica_world(s.ftc)
        ctx = ParallelContext.create(p.inner, p.pp, 1, world.device)
        s.injector = FaultInjector(s.args, s.ftc.rank, s.ftc.replica, s.run_dir)
        if s.ftc.rank == min(s.ftc.alive_ranks):  # rank 0 unless it was lost at start-up
            self.members.write_rank_table()
        self.members.watch_spawned_processes()
        self._guard_partitions()
        return world, ctx, self._restore(world, ctx) if s.generation > 0 else None

    def _name_failures_during_agreements(self) -> None:
        """A failure the main thread's progress learns while it waits in an agreement (a step's or
        a recovery's) is named for the supervisor at once (``ft/watch.py``): a frozen rank whose
        peers wait in an agreement is then removed within the heartbeat timeout, like one whose
        peers compute. Only from here: the names need the process table."""
        from ...ft.watch import current_watch

        watch = current_watch()
        if watch is not None:
            watch.subscribe_during_agreement(self.members.name_suspects)

    def _guard_partitions(self) -> None:
        """Every process beats a heartbeat file from here on: a recovery can tell a cut-off side
        of the job from a dead one (``ft/partition.py``)."""
        from ...ft.partition import PartitionGuard

        self.s.ftc.partition_guard = PartitionGuard(self.s.run_dir, self.s.args.heartbeat_period_s)

    def _comm_fault_point(self, point: str) -> None:
        """Injected faults at the communicator's own points: a member dying inside the re-join's
        spawn and merge stages (``phase: rejoin``, ``microbatch`` 2 and 3)."""
        if self.s.injector is None:
            return
        if point in JOIN_FAULT_POINTS:
            self.s.injector.maybe_fail(Phase.REJOIN, JOIN_FAULT_POINTS[point])
        elif point in START_FAULT_POINTS:
            self.s.injector.maybe_fail(Phase.START, START_FAULT_POINTS[point])

    # -- node-memory snapshots and relaunches ------------------------------------------------
    def _snapshot_store(self) -> NodeSnapshots | None:
        """This rank's node-memory snapshots (``snapshots.py``), None when they are off."""
        s, n = self.s, self.s.args.snapshot
        if not n.interval:
            return None
        if self.snapshots is None:
            self.snapshots = NodeSnapshots(
                Path(n.dir),
                snapshot_run_id(s.cfg, s.run_dir),
                snapshot_layout_id(s.cfg),
                coordinate=s.ftc.local_rank,
                replica=s.ftc.replica,
                generation=s.generation,
                max_bytes=None if n.max_mb is None else int(n.max_mb * 2**20),
                may_publish=self.members.current_generation,
            )
        return self.snapshots

    def _restore(self, world: World, ctx: ParallelContext) -> JoinedState | None:
        """A relaunched job: the newest step every coordinate holds in some node's snapshot, or
        None (the trainer resumes from the latest disk checkpoint, and says so)."""
        s, store = self.s, self._snapshot_store()
        self.relaunch = read_relaunch(s.run_dir)
        at_most = None if self.relaunch is None else self.relaunch.last_committed
        found = None
        if store is not None:
            disk = resume_step(s.cfg, checkpoints_root(s.cfg, s.run_dir))
            found = self._restore_repairing(store, at_most, disk)
        self.restored_at = time.time()
        if found is None:
            if s.ftc.rank == 0:
                print(
                    "[nanotron-recover] relaunched: no newer step is held by every coordinate in the "
                    "nodes' snapshots; resuming from the latest disk checkpoint",
                    flush=True,
                )
            return None
        step, state = found
        s.step = s.last_step = step
        self.state_from = "snapshot"
        return JoinedState(step=step, engine_state=state, world=world, ctx=ctx)

    def _restore_repairing(
        self, store: NodeSnapshots, at_most: int | None, disk: int | None
    ) -> tuple[int, Any] | None:
        """:func:`restore_from_snapshots` until every survivor got through it: a rank lost during
        the restore is repaired like one lost at start-up (:meth:`_repair_start`), and the
        survivors restore again among themselves. A rank that saw the failure enters the recovery
        at once (its revokes pull out the ranks still in the restore's collectives); one that got
        through meets it in the agree that closes the restore, which either returns on every
        survivor or recovers on every survivor (``FaultTolerantComm.agree``)."""
        from ...ft.ulfm import MPI, is_fault

        s = self.s
        while True:
            try:
                if at_most is not None:
                    # Injected ``phase: start`` faults of a relaunch strike here, keyed by the step
                    # the job would start with.
                    s.injector.begin_step(at_most + 1, s.ftc.alive_replicas)
                    s.injector.maybe_fail(Phase.START, 0)
                found = restore_from_snapshots(s.ftc, store, s.cfg.parallelism.replica_size, at_most, disk)
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                self._repair_start(s.ftc.recover(), "while the job restored its state")
                continue
            try:
                s.ftc.agree(True)
            except WorldChanged as changed:
                self._repair_start(changed.result, "while the job restored its state")
                continue
            return found

    def _repair_start(self, result: RecoveryResult, when: str) -> None:
        """A recovery before the first step: an incident like any other, written with the first
        commit (phase ``start``); a process declared dead by mistake is fenced off the run
        directory like one lost later."""
        incident, _ = self.incidents.of_recovery(self.s.step + 1, result)
        incident.phase = Phase.START
        self.steps.carried.append(incident)
        self.members.fence(result.failed_ranks)
        self.rejoin.note_failure(self.s.step, result)  # with re-join on, the lost replicas come back
        ftc = self.s.ftc
        if ftc.rank == min(ftc.alive_ranks):
            print(
                f"[nanotron-recover] replicas {list(result.failed_replicas)} lost {when}; going on "
                f"with {len(result.alive_replicas)}",
                flush=True,
            )

    def _snapshot(self, step: int) -> None:
        """After the commit of ``step``: this rank's state into node memory, on a thread."""
        s, store = self.s, self._snapshot_store()
        n = s.args.snapshot
        if store is None or step % n.interval:
            return
        keep = n.replicas_per_coordinate
        if keep is not None and s.ftc.alive_replicas.index(s.ftc.replica) >= keep:
            return
        if store.error is not None and str(store.error) != self._snapshot_warned:
            # Said once per reason, not at every step: a full tmpfs stays full.
            self._snapshot_warned = str(store.error)
            what = "" if isinstance(store.error, SnapshotSkipped) else "node snapshot failed: "
            print(f"[nanotron-recover] rank {s.ftc.rank}: warning: {what}{store.error}", flush=True)
        # Called after the optimizer step: on CUDA the copy is ordered after the compute stream's
        # work so far, and the next optimizer step after the copy (snapshot_copy.py).
        store.write(step, export=lambda: s.parts.engine.export_state(copy=False), device=s.parts.world.device)

    def attach(self, parts: ReplicaParts) -> None:
        self.s.parts = parts
        self.steps.attach()

    def agree_startup(self, error: str | None) -> str | None:
        """Every rank's start-up went well, or every rank gets the first error (lowest rank).

        A process lost while the job starts (a crash, or one the heartbeat declared dead by mistake
        while a busy node imported and built) is repaired like any later failure: the survivors move
        to a world without its replica and ask again. A rank that got through before the failure
        surfaced is pulled into the same repair by its first step's reduction or agree."""
        from ...ft.ulfm import MPI, is_fault

        ftc = self.s.ftc
        if ftc.startup_repair is not None:
            # A process was lost while the first world was built (ft/comm.py): repaired there.
            self._repair_start(ftc.startup_repair, "while the job started")
            ftc.startup_repair = None
        while True:
            try:
                errors = ftc.global_comm.allgather(error)
                return next((e for e in errors if e is not None), None)
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                # Raises AllReplicasFailed if none is left.
                self._repair_start(ftc.recover(), "while the job started")

    # -- the loop's questions --------------------------------------------------------------
    @_ends_here
    def reduced_gradients(self, step: int) -> ReducedStep:
        return self.steps.run(step)

    def fault_point(self, phase: str) -> None:
        self.s.injector.maybe_fail(phase, 0)

    @_ends_here
    def after_step(self, step: int) -> None:
        s = self.s
        s.last_step = step
        if self.relaunch is not None and self.relaunch.generation == s.generation:
            # The first commit of a relaunched job: its incident (the first step is restored + 1).
            state_from = self.state_from or ("checkpoint" if step > 1 else "start")
            self.incidents.relaunched(step, self.relaunch, state_from, self.restored_at)
            self.relaunch = None
        with s.parts.times.phase("checkpoint"):
            self._snapshot(step)
        if s.rejoin_on:
            self.rejoin.join_point(step)

    @contextlib.contextmanager
    def local_phase(self, name: str) -> Iterator[None]:
        if name == Phase.OPTIMIZER and self.snapshots is not None:
            with self.s.parts.times.phase("checkpoint"):
                # The snapshot's copy first (on CUDA: the compute stream ordered after it): the
                # optimizer step changes the state.
                self.snapshots.wait_exported()
        try:
            with self.steps.local_phase(name):
                yield
        except StopJob as job:
            self._snapshots_at_stop(job)
            self.stops.exit(job)
        except Parked as parked:
            parked.wait_for_rejoin = self._wait_for_rejoin
            raise

    @_ends_here
    def _wait_for_rejoin(self) -> JoinedState:
        if self.snapshots is not None:
            self.snapshots.wait()  # the engine is about to be replaced
        return self.rejoin.wait()

    def request_stop(self, stop: StopRun) -> None:
        self.stops.request(stop)

    def check_member(self) -> None:
        self.members.check_member()

    def is_logger(self) -> bool:
        return self.members.is_logger()

    def is_checkpoint_writer(self) -> bool:
        return self.members.is_checkpoint_writer()

    def replica_id(self) -> int:
        return self.s.ftc.replica

    # -- the end -----------------------------------------------------------------------------
    @_ends_here
    def finish(self, last_step: int, resave: Callable[[int], Any] | None = None) -> None:
        """End of training: one more agree, so that a stop requested after the last step (its save
        failed) or a failure during the final save is seen by everyone; then the outcome.

        ``resave(step)``, if given, saves ``last_step`` again on the new checkpoint writer when a
        failure struck during this last agree (the replica that was saving may be the one lost)."""
        s = self.s
        s.last_step = s.step = last_step
        if self.snapshots is not None:
            self.snapshots.wait()
        while True:
            try:
                s.phase = Phase.FINISH
                _, stop = s.ftc.agree(True, stop=self.stops.bits(), kind="finish")
                break
            except WorldChanged as changed:
                result = changed.result
                self.rejoin.note_failure(last_step, result)
                if result.parked:
                    self.rejoin.follow()  # never returns: the end (or a stop) comes through the agrees
                s.last_failure_view = (result.detected_at - result.detect_s, result.detected_at)
                incident, records = self.incidents.of_recovery(last_step, result)
                self.members.fence(result.failed_ranks)
                self.incidents.write([incident])
                self.stops.after_failure(last_step, records, [], check_width=False)
                if resave is not None and self.members.is_checkpoint_writer():
                    resave(last_step)
            except AllReplicasFailed as gone:
                raise Stops.no_replica_left(last_step, gone) from None
        if stop:
            raise self.stops.agreed(stop, last_step)
        self.incidents.flush_rejoins()
        self.stops.complete(last_step)
        self._end_snapshots()

    def _snapshots_at_stop(self, job: StopJob) -> None:
        """A job relaunched next (lost, or stopped to regrow) keeps its snapshots, every one of
        them published before the rank exits; any other stop gives them back.

        A rank never removes them on a signal: the supervisor's own SIGTERM ends a job it is about
        to relaunch (stalled, its lost hosts gone, given up), and a rank cannot tell it from a
        cancellation. What a cancelled or timed-out job leaves, the job script's last step removes
        (``nanotron-recover snapshots clean`` on every node)."""
        if not job.relaunched:
            self._end_snapshots()
        elif self.snapshots is not None:
            self.snapshots.wait()

    def _end_snapshots(self) -> None:
        """The job ended with an outcome (completed or stopped): nothing will be relaunched from
        this node's snapshots, so this rank removes the run's folder on its node (every rank of the
        node does, each after its own last write). Also when this process wrote none (an earlier
        generation's may be here); never by a process fenced off the job (``remove_run``)."""
        store = self.snapshots
        if store is None and self.s.ftc is not None:
            store = self._snapshot_store()  # None when snapshots are off
        if store is not None:
            store.wait()
            store.remove_run()

    def abort(self, error: BaseException) -> None:
        """Any other error escaping the step becomes a fail-stop: an exception exit would not be
        reported to the other replicas, which would then wait for this rank forever."""
        traceback.print_exception(error)
        kind, sig = classify(error)
        self.members.leave(kind, sig)

    def close(self) -> None:
        self.stops.close()
