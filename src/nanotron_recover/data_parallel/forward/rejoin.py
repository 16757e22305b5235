"""Re-join (``recover.rejoin.mode: spawn``): park the healthy ranks of a failed replica, follow the
job, and bring the replica back at a step boundary with a healthy replica's state.

- **Parking.** A rank learns that a peer of its replica failed from its torch world (a gloo/NCCL
  error) or from the failure watch; it enters the recovery itself (which wakes the survivors
  waiting on it) and comes out parked: a member of the global communicator, of no replica
  (:meth:`Rejoin.park_now` raises :class:`~nanotron_recover.data_parallel.protocol.Parked`).
- **Following.** A parked rank runs no steps; it follows the global agrees, which carry their kind
  (step, join, finish, stop), so it needs no step count of its own (:meth:`Rejoin.wait`).
- **When.** At the boundary after step ``t`` the re-join policy (``policy/rejoin.py``) says which
  replicas are due; every member computes the same answer from the same book.
- **The join.** The active ranks agree (kind ``join``), then the join protocol (``ft/join.py``)
  spawns the dead ranks, merges and re-splits; every rank of a re-joining replica receives a
  healthy replica's state over its coordinate's DP communicator (``state_transfer.py``); the commit
  agree makes it all or nothing. A spawned process starts in :meth:`Rejoin.start_spawned`.
Every join, failed or not, is an incident of kind ``rejoin``.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, NoReturn

import torch.distributed as dist

from ... import fencing
from ...errors import StopRun
from ...failures import Kind, Phase
from ...ft import abandoned_join, prrte_fix, rank_fixes, spawn_start
from ...ft.faults import FaultInjector
from ...ft.liveness import JoinWatch, start_heartbeat
from ...ft.replica_world import init_replica_world
from ...ft.watch import current_watch
from ...ft.world import AllReplicasFailed, JoinFailed, JoinPlan, RecoveryResult, WorldChanged
from ...outcome import RELAUNCHES_LEFT_ENV, SUPERVISED_ENV
from ...parallel.context import ParallelContext
from ...policy.rejoin import RejoinBook, due_replicas
from ..protocol import JoinedState, Parked
from .incidents import Incidents
from .members import REJOIN_PHASE, Members
from .rank_state import RankState
from .state_transfer import TransferResult, transfer_state
from .stops import Stops


class Rejoin:
    def __init__(self, state: RankState, members: Members, incidents: Incidents, stops: Stops):
        self.s, self.members, self.incidents, self.stops = state, members, incidents, stops
        # The policy's book (alike on every member) and when each replica was lost (for join_s).
        self.book = RejoinBook()
        self.lost_wall: dict[int, float] = {}
        self.told_out_of_spawns = False
        # Open MPI's runtime spawns across hosts as often as needed (read once: alike on every member).
        self.spawn_fix = prrte_fix.active()

    def note_failure(self, step: int, result: RecoveryResult) -> None:
        """Every member notes the replicas lost in this step alike (the re-join policy's input)."""
        self.book.lost(result.failed_replicas, step)
        for r in result.failed_replicas:
            self.lost_wall[r] = result.detected_at

    # -- parking -----------------------------------------------------------------------------
    def park_now(self, why: str) -> NoReturn:
        """My replica lost a member while this rank is healthy: enter the recovery myself (which
        wakes the peers waiting on me) and stay in the job, parked; raises :class:`Parked`."""
        s = self.s
        s.parking = True
        # The shrink must see the peer's failure, or the replica would look whole: wait until this
        # process's MPI knows of it (the runtime reports a crash within milliseconds).
        watch = current_watch()
        deadline = time.time() + s.park_grace_s
        while watch is not None and not watch.known_failed() & s.my_replica_ranks and time.time() < deadline:
            time.sleep(0.02)
        try:
            result = s.ftc.recover()
        except AllReplicasFailed as gone:
            raise Stops.no_replica_left(s.last_step, gone) from None
        self.note_failure(s.step, result)
        if not result.parked:
            self.members.leave(Kind.PEER_ERROR, why)  # my replica still stands but my torch world broke
        print(f"[nanotron-recover] rank {s.ftc.rank} parked: {why[:160]}", file=sys.stderr, flush=True)
        raise Parked(why)

    def wait(self) -> JoinedState:
        """A parked rank: drop the broken replica world and follow the job until the replica re-joins."""
        s = self.s
        s.parking, s.in_recovery, s.restore_handle = True, False, None
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass  # the world is broken anyway; a new one is built on re-join
        joined = self.follow()
        s.parking = False
        return joined

    def follow(self) -> JoinedState:
        """Follow the active ranks' global agrees: stop, end or re-join with them."""
        s = self.s
        while True:
            try:
                stop, kind = s.ftc.follow(self.stops.bits())
            except WorldChanged:
                continue
            except AllReplicasFailed as gone:
                raise Stops.no_replica_left(s.last_step, gone) from None
            if stop:
                raise self.stops.agreed(stop, s.last_step)
            if kind == "finish":
                self.stops.close()
            if kind == "join":
                joined = self._join(None, s.last_step)
                if joined is not None:
                    return joined

    # -- the join point ------------------------------------------------------------------------
    def join_point(self, step: int) -> None:
        """At the boundary after ``step``: bring back the replicas the policy says are due."""
        s, r = self.s, self.s.args.rejoin
        while True:
            decision = due_replicas(
                self.book,
                step,
                s.parts.target_step(),
                s.ftc.alive_replicas,
                after_steps=r.after_steps,
                max_spawns=r.max_spawns,
                max_failures_per_replica=r.max_failures_per_replica,
            )
            for replica in decision.give_up:
                self.book.given_up.append(replica)
                losses = self.book.losses.get(replica, 0)
                reason = (
                    f"replica {replica} was lost {losses} times "
                    f"(recover.rejoin.max_failures_per_replica={r.max_failures_per_replica})"
                )
                self.incidents.rejoin(step, {"status": "given_up", "replicas": [replica], "reason": reason})
            if decision.out_of_spawns and not self.told_out_of_spawns:
                self.told_out_of_spawns = True
                reason = f"recover.rejoin.max_spawns={r.max_spawns} spawn attempts used; the job stays at its width"
                self.incidents.rejoin(
                    step, {"status": "given_up", "replicas": sorted(self.book.lost_at), "reason": reason}
                )
            if not decision.replicas:
                return
            if self._regrow_instead_of_spawn(decision.replicas, step):
                return
            try:
                s.phase = Phase.REJOIN
                _, stop = s.ftc.agree(True, stop=self.stops.bits(), kind="join")
                if stop:  # a stop is pending (e.g. a failed save): no join for a job that ends
                    raise self.stops.agreed(stop, step)
                break
            except WorldChanged as changed:
                self.note_failure(step, changed.result)
                if changed.result.parked:
                    raise Parked(f"replica {s.ftc.replica} failed after step {step}") from None
                incident, records = self.incidents.of_recovery(step, changed.result)
                self.members.fence(changed.result.failed_ranks)
                self.incidents.write([incident])
                self.stops.after_failure(step, records, [])
            except AllReplicasFailed as gone:
                raise Stops.no_replica_left(step, gone) from None
        self._join(decision.replicas, step)

    def _join(self, replicas: tuple[int, ...] | None, step: int) -> JoinedState | None:
        """One re-join on a member: active ranks pass the due ``replicas``, parked ranks None (the
        root's plan reaches them). Returns the new state on a reused parked rank of a replica that
        came back, None elsewhere and on an abort."""
        from ...ft.join import begin_join  # MPI only here: the parts need none at import

        s = self.s
        plan = None
        if replicas is not None:
            members = set(s.ftc.members)
            ranks = [r for rep in replicas for r in s.ftc.topology.ranks_of_replica(rep)]
            plan = JoinPlan(
                replicas=tuple(replicas),
                new_ranks=tuple(r for r in ranks if r not in members),
                reused_ranks=tuple(r for r in ranks if r in members),
            )
        payload = {
            "step": step,
            "started": s.started,
            "book": self.book.as_dict(),
            "donors": s.ftc.alive_replicas,
        }
        s.phase = Phase.REJOIN
        # Alike on the active members (the root is one): the root's spawn command carries it.
        join = abandoned_join.join_id(s.generation, s.ftc.epoch, step)
        if not s.ftc.parked:
            s.injector.maybe_fail(Phase.REJOIN, 0)
        # No failure detector watches a spawned process before its join commits: its heartbeat
        # file does (a process lost in the join gives the job up at once), and a deadline.
        watch = JoinWatch(
            s.run_dir,
            expected=len(plan.new_ranks) if plan is not None else 0,
            period_s=s.args.heartbeat_period_s,
            timeout_s=s.args.heartbeat_timeout_s,
            start_s=spawn_start_s(s.args),
            on_lost=self.members.give_up_join,
        )
        with s.watchdog.phase(REJOIN_PHASE, s.args.rejoin.join_timeout_s), watch:
            try:
                command = spawn_command(s.run_dir, s.args.heartbeat_period_s, join)
                pending = begin_join(s.ftc, plan, command, self._spawn_info(), payload)
            except JoinFailed as failed:
                if replicas is not None:
                    # Its spawned processes may still be connecting to the members, in MPI_Init,
                    # which nothing interrupts: their watchers end them.
                    abandoned_join.abandon(s.run_dir, join)
                    self.book.attempted(
                        list(replicas), step, joined=False, spawn_failed=failed.could_not_start
                    )
                    self.incidents.rejoin(
                        step, {"status": "failed", "replicas": list(replicas), "reason": str(failed)}
                    )
                if failed.could_not_start and self.may_regrow():
                    # Every member met the same refusal: each asks alike, and the next agree stops
                    # the job after this step, its snapshots published, for a full-width relaunch.
                    lost = sorted(self.book.lost_at)
                    self.stops.request(
                        StopRun(
                            Kind.REGROW,
                            f"the re-join of replicas {lost} could not be placed ({failed}): the job stops "
                            "after this step to be relaunched at full width from node memory",
                        )
                    )
                return None
            return self._finish_join(pending)

    def _regrow_instead_of_spawn(self, replicas: tuple[int, ...], step: int) -> bool:
        """Whether ``replicas`` come back by a full-width relaunch rather than a spawn: once the
        launch spans hosts and has used ``recover.rejoin.spawns_across_hosts`` spawns, a further
        spawn of Open MPI 5.0.x cannot reach the job, unless its runtime runs with the project's
        fix (``ft/prrte_fix.py``). Decided alike on every member (the book, the processes' hosts
        and the launch's environment are alike); the stop is asked once."""
        s = self.s
        hosts = {p.host for p in s.ftc.processes if p.host}  # no host: never known (ft/comm.py)
        if self.spawn_fix or len(hosts) < 2 or not self.may_regrow():
            return False
        if self.book.spawns < s.args.rejoin.spawns_across_hosts:
            return False
        self.stops.request(
            StopRun(
                Kind.REGROW,
                f"replicas {list(replicas)} come back by a full-width relaunch from node memory after step "
                f"{step}: this launch spans {len(hosts)} hosts and used its {self.book.spawns} spawn(s) "
                "(recover.rejoin.spawns_across_hosts)",
            )
        )
        return True

    def may_regrow(self) -> bool:
        """Whether a re-join that cannot be placed is made good by a relaunch at full width: only
        under a supervisor with a relaunch left, with node-memory snapshots to restore from."""
        s = self.s
        left = os.environ.get(RELAUNCHES_LEFT_ENV, "0")
        return (
            s.args.rejoin.regrow_by_relaunch
            and os.environ.get(SUPERVISED_ENV) == "1"
            and left.isdigit()
            and int(left) > 0
            and s.args.snapshot.interval > 0
        )

    def _spawn_info(self) -> dict[str, str]:
        """``MPI_Comm_spawn``'s info: where the process starts, and where it may run.

        ``bind_to: none`` as the launch (``launcher.mpirun_command``): otherwise Open MPI's runtime
        binds a spawned process by its default policy, to one core, taken from the CPUs ``mpirun``
        saw on its own host (measured on the emulated cluster, each node on its own CPU: every
        spawned process was bound to the batch host's CPU, whatever its node, beside that host's
        rank, while its own node's CPU stood idle)."""
        rejoin = self.s.args.rejoin
        info = {"wdir": os.getcwd(), "bind_to": "none"}
        if rejoin.hosts:
            info["host"] = ",".join(rejoin.hosts)
        if rejoin.hostfile:
            info["hostfile"] = str(rejoin.hostfile)
        return info

    def _finish_join(self, pending: Any) -> JoinedState | None:
        """The last stages of a re-join, alike on members and spawned processes: move the state,
        commit, and on the re-joining replica build its torch world."""
        from mpi4py import MPI

        from ...ft.join import commit_join

        s = self.s
        plan, payload, me = pending.plan, pending.payload, s.ftc.replica
        donors, rejoining = list(payload["donors"]), list(plan.replicas)
        transfer = TransferResult(pending.ok, None, 0, 0.0)
        if pending.ok and pending.dp_comm is not None:
            transfer = transfer_state(
                pending.dp_comm,
                me,
                donors,
                rejoining,
                export=lambda: s.parts.engine.export_state(),
                fault_point=lambda: s.injector.maybe_fail(Phase.REJOIN, 1),
            )
        ok, stats = transfer.ok, []
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
        committed = commit_join(s.ftc, pending, ok)  # a spawned process dies here on an abort
        if committed and me in rejoining:
            # A member now: the failure watch's grace applies again (a peer may die while the
            # replica's world is being built).
            s.joining = s.parking = False
        self.book = RejoinBook.from_dict(payload["book"])
        self.book.attempted(rejoining, payload["step"], committed)
        record: dict[str, Any] = {"status": "joined" if committed else "failed", "replicas": rejoining}
        if committed:
            now = time.time()
            record.update(
                spawned_ranks=list(plan.new_ranks),
                orphans_reused=list(plan.reused_ranks),
                state_bytes=int(sum(b for b, _ in stats)),
                transfer_s=max((t for _, t in stats), default=0.0),
                spawn_s=pending.spawn_s,
                join_s=now - min((self.lost_wall.get(r, now) for r in rejoining), default=now),
                epoch=s.ftc.epoch,
            )
        else:
            record["reason"] = "a member failed during the re-join"
        self.incidents.rejoin(payload["step"], record)
        if committed:
            self.incidents.flush_rejoins()
            if self.members.is_logger():
                self.members.write_rank_table()
        if not committed or me not in rejoining:
            return None
        world = init_replica_world(s.ftc)
        p = s.cfg.parallelism
        ctx = ParallelContext.create(p.inner, p.pp, 1, world.device)
        s.my_replica_ranks = s.replica_ranks()
        s.step = s.last_step = payload["step"]
        return JoinedState(step=payload["step"], engine_state=transfer.received, world=world, ctx=ctx)

    # -- a spawned process ---------------------------------------------------------------------
    def start_spawned(self, callbacks: dict[str, Any]) -> JoinedState:
        """A process spawned by a re-join: take a dead rank's place, receive its replica's state
        from a healthy replica, commit the join (or die with it), then build the replica's world."""
        from ...ft.join import join_parent

        s, p = self.s, self.s.cfg.parallelism
        s.joining = True
        start_heartbeat(s.run_dir, s.args.heartbeat_period_s)  # nobody else watches this process
        # A parent frozen during the join would hold this process forever: it dies at the deadline.
        with s.watchdog.phase(REJOIN_PHASE, s.args.rejoin.join_timeout_s):
            # The members merge and send the header right after two stage agrees, which end within
            # a failure detection. A join they abandoned leaves this process in Merge, which no
            # revoke interrupts (Open MPI 5.0 allocates the merged communicator's id in a loop
            # that does not look at failures): it dies at this shorter deadline instead.
            with s.watchdog.phase(MEMBERS_WAIT_PHASE, members_wait_s(s.args)):
                s.ftc, pending = join_parent(p.inner, p.pp, p.dp, **callbacks)
            spawn_start.joined_members()
            payload = pending.payload
            s.started = payload["started"]
            s.step = s.last_step = payload["step"]
            s.phase = Phase.REJOIN
            s.my_replica_ranks = s.replica_ranks()
            s.injector = FaultInjector(s.args, s.ftc.rank, s.ftc.replica, s.run_dir)
            s.injector.begin_step(s.step, list(payload["donors"]))
            joined = self._finish_join(pending)
        assert joined is not None  # an aborted join SIGKILLs a spawned process
        return joined


MEMBERS_WAIT_PHASE = "rejoin: waiting for the members"


def members_wait_s(args: Any) -> float:
    """How long a spawned process waits for the members to merge with it and send the join's
    header: several failure detections (at least 30 s), at most the join's own deadline."""
    return min(args.rejoin.join_timeout_s, max(30.0, 6 * args.heartbeat_timeout_s))


# Processes spawned together form a world of their own, whose ring ULFM's detector watches: in a
# pair spawned onto two nodes, each observes the other. When one node's link is cut, each side
# declares the other failed, and once the link is back the cut-off process's report reaches the
# healthy one, which aborts ("I have been reported dead by someone else"): a healthy replica lost.
# The 60-fault cluster campaign lost 2 that way, in 3 link cuts of a node that held one of a pair.
# A spawned process's freeze is found by its heartbeat file instead (ft/liveness.py,
# frozen_processes.py), as for a process spawned alone, whose world has no ring; its crash by the
# runtime, as for every process.
SPAWNED_DETECTOR_OFF = "OMPI_MCA_mpi_ft_detector=false"


def spawn_start_s(args: Any) -> float:
    """How long the members of a re-join wait for each spawned process's first heartbeat: it
    beats before its imports (``ft/spawn_start.py``), so two heartbeat timeouts (at least 15 s)
    cover its launch on a busy node; at most the join's own deadline."""
    return min(args.rejoin.join_timeout_s, max(15.0, 2 * args.heartbeat_timeout_s))


def spawn_command(run_dir: Any, period_s: float, join: str | None = None) -> list[str]:
    """How a replacement process starts: this rank's own command line, through the CLI, with its
    heartbeat file and period (it beats from its first moments: ``ft/spawn_start.py``), the name
    of its ``join`` (it dies if the members give that join up: ``ft/abandoned_join.py``) and this
    job's fencing token (``fencing.py``) in its environment: the runtime does not pass the job's
    environment on to spawned processes on every launcher, and a replacement must not adopt a
    token newer than the job that made it.

    ULFM's heartbeat detector off in the spawned world (:data:`SPAWNED_DETECTOR_OFF`)."""
    from ...ft.spawn_start import ENV as BEAT_ENV
    from ...ft.spawn_start import beat_value

    cmd = [sys.executable, "-m", "nanotron_recover.cli", *sys.argv[1:]]
    env = [f"{BEAT_ENV}={beat_value(run_dir, period_s)}", SPAWNED_DETECTOR_OFF]
    if join is not None:
        env.append(f"{abandoned_join.ENV}={join}")
    token = fencing.mine()
    if token is not None:
        env.append(f"{fencing.ENV}={token}")
    # The Open MPI fixes this rank runs with (ft/rank_fixes.py): a spawned process without it crashed
    # in a later recovery's Shrink (the long chaos campaign), as the launch ranks did before it.
    fix = os.environ.get(rank_fixes.ENV)
    if fix:
        env.append(f"{rank_fixes.ENV}={fix}")
    return ["env", *env, *cmd]
