"""
Re-join
=======

This module implements the join protocol that grows a job back to full width after it lost
replicas: it spawns one process per dead rank of the replicas that come back, merges them with the
members of the global communicator, builds the communicators of the grown world, and installs that
world on every member and every spawned process, or on none.

It works on a :class:`~.comm.FaultTolerantComm` through a few of its public members only:
``membership()``, ``spawned()``, ``adopt()``, ``install()`` and ``abandon()`` (which exist for it),
``check_open()``, ``global_comm``, ``coords``, ``rank``, ``alive_ranks``, ``alive_replicas`` and
``in_ft_operation``. The communicator does not import this module.

Who calls what
--------------
A *member* is a rank of the global communicator: an active rank, or a parked one (an alive rank of
a failed replica, kept in the job for this). A member calls :func:`begin_join`, moves the replica
state over the new DP communicators (``data_parallel/forward/state_transfer.py``), then calls
:func:`commit_join`, also when the :class:`PendingJoin` is not ``ok``: the commit agree is
collective. A *spawned* process calls :func:`join_parent`, receives its state the same way, then
calls :func:`commit_join`.

Stages
------
0. *Decision.* At a step boundary the active ranks decide, from state they all hold, which replicas
   come back: a :class:`~.world.JoinPlan` (the replicas, the logical ranks to spawn, i.e. their
   ranks that are not members any more, and the parked ranks reused). The step's global agree, of
   kind ``join`` (:meth:`~.comm.FaultTolerantComm.agree`), tells the parked ranks, which follow
   (:meth:`~.comm.FaultTolerantComm.follow`) and have no plan of their own.
1. *Header.* The root, the lowest alive rank, broadcasts over the global communicator the plan, the
   spawn command and its MPI info, its :class:`~.membership.Membership` (epoch, alive replicas,
   parked ranks, processes, logical ranks) and the caller's payload; parked ranks learn the plan
   here. Agreed: stage "before the spawn".
2. *Spawn.* ``MPI_Comm_spawn`` from the root of one process per rank to spawn, with the job's own
   command line. Agreed: stage "during the spawn".
3. *Merge.* ``Merge`` of the intercommunicator into ``merged``: the members first, in their global
   communicator's order, then the spawned processes. Agreed: stage "while merging". Then the
   header goes to the spawned processes (a broadcast on ``merged``); spawned process ``k`` takes
   logical rank ``new_ranks[k]``, the place of a dead rank in the grid (the grid of
   :mod:`.topology` never changes, only the process behind a logical rank does).
4. *Build*, alike on members and spawned processes, on ``merged``: an allgather of logical ranks,
   one of processes (host, pid), the replica and DP splits with the re-joining replicas' ranks
   active, and a duplicate for the failure watch. Not agreed: a failure here marks the
   :class:`PendingJoin` not ``ok`` and revokes what was built, and the commit then aborts.
5. *State.* The caller moves the replica state over the new DP communicators.
6. *Commit.* ``merged.Agree(ok)``. It is uniform over ``merged``, so either every member and
   spawned process installs the new world (epoch + 1, the replicas alive again and alive since
   that epoch, the reused parked ranks active, the failure watch moved onto ``merged``) or none
   does.

``Spawn`` and ``Merge`` are not uniform: they can fail on some members only, and a spawn that cannot
start (no free slot, unknown host, missing command) fails without any process failure. So after the
header, the spawn and the merge the members agree on the stage's outcome, on the global
communicator: every member leaves the join at the same stage, with the same reason. A member's death
makes the stage agree itself fail, which is uniform too. Spawned processes take no part in these
agrees; they wait in ``Merge`` or in the header's broadcast.

Aborts
------
On members, an abort before the commit is :class:`~.world.JoinFailed`, raised by
:func:`begin_join` on every member alike once it revoked and freed what the stage built;
``could_not_start`` says that the spawn itself could not start, a lack of resources rather than a
fault (the caller tries again later). Nothing changed: the members keep their communicators and
epoch. An abort at the commit is :func:`commit_join` returning False on every member: it revokes
and retires the join's communicators and keeps the old world; a member that died is then found by
the next step's agree, like any failure. Either way the job goes on at its width.

On spawned processes an abort never returns. A spawned process whose ``Merge`` or header broadcast
fails (the members revoked the intercommunicator or ``merged`` when a stage failed, or one of them
died) SIGKILLs itself in :func:`join_parent`; one whose commit agree does not commit SIGKILLs
itself in :func:`commit_join`. The runtime reports its death like any crash. One still in
``MPI_Init`` when the members left (the root died during the spawn) is reached by nothing in MPI:
the members name the join given up in a marker file, and the process's watcher ends it
(``abandoned_join.py``, started by the spawn command's environment).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .comm import FaultTolerantComm
from .failstop import fail_stop
from .membership import Membership, split_derived
from .processes import ProcessInfo, this_process
from .ulfm import MPI, agree, creation_failed, is_fault, reset_cid_gate, retire_comm, revoke_comm
from .watch import rebase_watch
from .world import FTError, JoinFailed, JoinPlan, RecoveryResult


@dataclass
class PendingJoin:
    """The communicators a re-join built (stage 4); installed by :func:`commit_join`."""

    plan: JoinPlan
    merged: Any
    replica_comm: Any
    dp_comm: Any
    watch_comm: Any
    logical: list[int]  # logical rank of each rank of ``merged``
    processes: list[ProcessInfo]  # of the spawned ranks
    payload: Any  # the caller's header payload (from merged rank 0)
    ok: bool = True  # False once a member failed while the join was being built
    spawn_s: float = 0.0

    def free(self) -> None:
        for comm in (self.dp_comm, self.replica_comm, self.watch_comm, self.merged):
            revoke_comm(comm)
            retire_comm(comm)


def begin_join(
    ftc: FaultTolerantComm, plan: JoinPlan | None, command: list[str], info: dict[str, str], payload: Any
) -> PendingJoin:
    """Stages 1-4 of a re-join on a member (collective over ``ftc``'s global communicator).

    The lowest alive rank is the root: its ``plan``, ``command``, ``info`` and ``payload`` count; a
    parked rank passes None and learns them from the root. Raises :class:`JoinFailed` if a stage
    failed anywhere (on every member alike). Otherwise returns a :class:`PendingJoin`, whose ``ok``
    is False if a member failed while it was being built; the caller then moves state and calls
    :func:`commit_join` in any case."""
    ftc.check_open()
    t0 = time.perf_counter()
    glob = ftc.global_comm
    membership = ftc.membership()
    root = membership.logical.index(min(ftc.alive_ranks))
    is_root = glob.Get_rank() == root
    # MPI reports failures to this rank while it is in the join: the failure watch leaves it alone.
    ftc.in_ft_operation = True
    try:
        header = None
        if is_root:
            assert plan is not None
            header = {
                "plan": plan,
                "command": command,
                "info": info,
                "membership": membership,
                "payload": payload,
            }
        # Spawn and Merge are not uniform (they can fail on some members only): after each
        # stage the members agree on its outcome on the global communicator before going on,
        # so every member leaves the join at the same stage, with the same reason.
        error = None
        try:
            header = glob.bcast(header, root=root)
        except MPI.Exception as exc:
            if not is_fault(exc):
                raise
            error = exc
        _stage_agree(glob, error is None, "before the spawn", error)
        plan = header["plan"]
        mpi_info = MPI.Info.Create()
        for key, value in header["info"].items():
            mpi_info.Set(key, value)
        inter = None
        try:
            cmd = header["command"]
            inter = glob.Spawn(cmd[0], cmd[1:], maxprocs=len(plan.new_ranks), info=mpi_info, root=root)
            inter.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception as exc:
            # Any error counts here (the stage agree decides); a spawn torn by a failure leaves
            # Open MPI's context-id allocator closed (.ulfm.reset_cid_gate).
            reset_cid_gate()
            error = exc
        finally:
            mpi_info.Free()
        ftc.fault_point("join:spawned")
        try:
            _stage_agree(glob, error is None, "during the spawn", error, could_not_start=True)
        except JoinFailed:
            revoke_comm(inter)  # spawned processes waiting in their Merge die (fail_stop)
            retire_comm(inter)
            raise
        merged = None
        try:
            merged = inter.Merge(high=False)
            merged.Set_errhandler(MPI.ERRORS_RETURN)
        except MPI.Exception as exc:
            reset_cid_gate()  # as after the spawn
            error = exc
        ftc.fault_point("join:merged")
        try:
            _stage_agree(glob, error is None, "while merging", error)
        except JoinFailed:
            for comm in (merged, inter):
                revoke_comm(comm)
                retire_comm(comm)
            raise
        retire_comm(inter)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        try:
            merged.bcast(header if merged.Get_rank() == 0 else None, root=0)  # to the spawned ones
        except MPI.Exception as exc:
            if not is_fault(exc):
                raise
            revoke_comm(merged)  # carry on to the commit agree, which then aborts uniformly
        pending = _build_join(ftc, merged, header, ftc.rank)
        pending.spawn_s = time.perf_counter() - t0
        return pending
    finally:
        ftc.in_ft_operation = False


def join_parent(
    tp: int,
    pp: int,
    n_replicas: int,
    *,
    on_leave: Callable[[RecoveryResult], None] | None = None,
    fault_hook: Callable[[str], None] | None = None,
    on_failure_notice: Callable[[list[int], float], None] | None = None,
    park_orphans: bool = True,
) -> tuple[FaultTolerantComm, PendingJoin]:
    """The spawned side of a re-join: this process was started by :func:`begin_join`.

    The arguments are :class:`~.comm.FaultTolerantComm`'s. Returns this rank's (not yet
    committed) communicator and the pending join; the caller receives its state and calls
    :func:`commit_join`, which SIGKILLs this process on an abort."""
    parent = MPI.Comm.Get_parent()
    if parent == MPI.COMM_NULL:
        raise FTError("join_parent: this process was not spawned by a running job")
    ftc = FaultTolerantComm.spawned(
        tp,
        pp,
        n_replicas,
        on_leave=on_leave,
        fault_hook=fault_hook,
        on_failure_notice=on_failure_notice,
        park_orphans=park_orphans,
    )
    parent.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        merged = parent.Merge(high=True)
    except MPI.Exception as exc:
        fail_stop(f"spawned process: merging with the job failed: {exc.Get_error_string()}")
    merged.Set_errhandler(MPI.ERRORS_RETURN)
    try:
        header = merged.bcast(None, root=0)
    except MPI.Exception as exc:
        fail_stop(f"spawned process: the job failed during the re-join: {exc.Get_error_string()}")
    plan: JoinPlan = header["plan"]
    membership: Membership = header["membership"]
    # The members come first in ``merged``, then the spawned processes in spawn order.
    logical = plan.new_ranks[merged.Get_rank() - len(membership.logical)]
    ftc.adopt(logical, membership)
    return ftc, _build_join(ftc, merged, header, logical)


def commit_join(ftc: FaultTolerantComm, pending: PendingJoin, ok: bool) -> bool:
    """Stage 6: the commit agree of a re-join (``ok``: this rank's state moved). True: the new world
    is installed (epoch + 1). False: nothing changed here; a spawned process SIGKILLs itself
    instead of returning."""
    spawned = ftc.global_comm is None
    try:
        committed = agree(pending.merged, 1 if (ok and pending.ok) else 0, "re-join's commit") == 1
    except MPI.Exception as exc:
        if not is_fault(exc):
            raise
        committed = False
    if not committed:
        pending.free()
        if spawned:
            ftc.abandon(f"spawned rank {ftc.rank}: the re-join was aborted")
        return False
    plan, before = pending.plan, ftc.membership()
    epoch = before.epoch + 1
    processes = list(before.processes)
    for info in pending.processes:
        processes[info.rank] = info
    alive_since = dict(before.alive_since)
    for rep in plan.replicas:
        alive_since[rep] = epoch
    after = Membership(
        epoch=epoch,
        alive_replicas=sorted(set(before.alive_replicas) | set(plan.replicas)),
        parked_ranks=[r for r in before.parked_ranks if r not in plan.reused_ranks],
        alive_since=alive_since,
        processes=processes,
        logical=pending.logical,
    )
    ftc.install(pending.merged, pending.replica_comm, pending.dp_comm, after)
    rebase_watch(pending.watch_comm, pending.logical)
    return True


def _stage_agree(
    glob: MPI.Comm, ok: bool, stage: str, error: BaseException | None, could_not_start: bool = False
) -> None:
    """One stage of a join, agreed over the global communicator ``glob``: returns on every member,
    or raises :class:`JoinFailed` on every member. A member's death makes the agree itself fail
    (uniformly); a stage that failed without one (a spawn that cannot start) gives 0 to all."""
    why = f": {error.Get_error_string()}" if isinstance(error, MPI.Exception) else ""
    try:
        agreed = agree(glob, 1 if ok else 0, f"re-join's ({stage})")
    except MPI.Exception as exc:
        if not is_fault(exc):
            raise
        raise JoinFailed(f"a member failed {stage}{why}") from exc
    if not agreed:
        raise JoinFailed(
            f"{'the spawn could not start' if could_not_start else 'a member failed ' + stage}{why}",
            could_not_start=could_not_start,
        )


def _build_join(ftc: FaultTolerantComm, merged: MPI.Comm, header: dict, logical: int) -> PendingJoin:
    """Stage 4, alike on members and spawned processes (after the header's broadcast)."""
    plan: JoinPlan = header["plan"]
    pending = PendingJoin(
        plan=plan,
        merged=merged,
        replica_comm=None,
        dp_comm=None,
        watch_comm=None,
        logical=[],
        processes=[],
        payload=header["payload"],
    )
    active = ftc.coords.replica in set(ftc.alive_replicas) | set(plan.replicas)
    try:
        pending.logical = [int(r) for r in merged.allgather(logical)]
        infos = merged.allgather(this_process(logical))
        pending.processes = [infos[i] for i, r in enumerate(pending.logical) if r in plan.new_ranks]
    except MPI.Exception as exc:
        if not is_fault(exc):
            raise
        pending.ok = False
    if pending.ok:
        try:
            pending.replica_comm, pending.dp_comm = split_derived(merged, ftc.coords, active)
            pending.watch_comm = merged.Dup()
        except MPI.Exception as exc:
            # Creations: ERR_OTHER (libnbc) is a fault too, and the context-id allocator is
            # reopened (.ulfm.reset_cid_gate).
            if not creation_failed(exc):
                raise
            pending.ok = False
    if not pending.ok:
        for comm in (pending.dp_comm, pending.replica_comm, merged):
            revoke_comm(comm)  # wake members blocked in the join's collectives
    return pending


__all__ = ["PendingJoin", "begin_join", "commit_join", "join_parent"]
