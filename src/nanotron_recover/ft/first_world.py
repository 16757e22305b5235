"""The first world of a launch, built so that a process lost meanwhile is repaired, not a failed launch.

:class:`~.comm.FaultTolerantComm`'s construction is collective over the launch communicator
``base``. Every rank tries to build the world of epoch 0: the global communicator (a ``Dup`` of
``base``), its replica and DP communicators, and the process table. Then all agree on ``base``
whether every rank did (:func:`.ulfm.all_ok`). A ``Dup`` or ``Split`` torn by a failure can fail
on some ranks and return on others; a rank whose creation returned still fails in the next one, or
in the allgather, since the failed process is a member; and the agreement raises on every rank
when a process of ``base`` failed, as no rank acknowledges failures on it.

Without a failure, that is the world of epoch 0. Otherwise the survivors shrink ``base``, and the
communicator runs an ordinary recovery on the result (``FaultTolerantComm._recover``): the replicas
the lost processes belonged to are lost, their other ranks leave (nothing to park: no state yet),
and the world of epoch 1 is the job's first. A rank lost at start-up (a crash, or one the heartbeat
declared dead by mistake on a busy node) then is an incident like any later one.

A rank that did not gather the table knows the failed processes of its own host from ``/proc``
(:func:`.processes.launch_mates`: a frozen one is then reaped after the repair, as in any
recovery); a process of another host is a placeholder (pid 0, no host) until a survivor that has
the table shares it at the end of that recovery (:func:`.processes.fill_in`).

Not covered: a process that dies inside the deciding agreement after it contributed can leave it
returning on some survivors and raising on others (the exposure a recovery round's commit has too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .failstop import fail_stop
from .membership import logical_members, shrink, split_derived
from .processes import ProcessInfo, launch_mates, this_process
from .topology import RankCoords
from .ulfm import MPI, all_ok, creation_failed, is_fault, retire_comm, revoke_comm


@dataclass
class FirstWorld:
    global_comm: MPI.Comm
    replica_comm: MPI.Comm | None  # None when ``built`` is False: the recovery makes them
    dp_comm: MPI.Comm | None
    processes: list[ProcessInfo]
    # Logical rank of each rank of ``global_comm`` (the launch ranks that are in it).
    logical: list[int]
    # False: a process was lost, ``global_comm`` is ``base`` shrunk and a recovery must follow.
    built: bool


def build_first_world(base: MPI.Comm, coords: RankCoords, fault_point: Callable[[str], None]) -> FirstWorld:
    """Build the world of epoch 0 over ``base`` (collective), or the survivors' shrunk ``base``.
    ``fault_point`` is called at ``start:dup``, ``start:split`` and ``start:gathered``."""
    ok = True
    glob = replica = dp = None
    processes: list[ProcessInfo] | None = None
    dup_failed = False
    try:
        fault_point("start:dup")
        try:
            glob = base.Dup()
        except MPI.Exception:
            dup_failed = True
            raise
        glob.Set_errhandler(MPI.ERRORS_RETURN)
        fault_point("start:split")
        replica, dp = split_derived(glob, coords, active=True)
        processes = glob.allgather(this_process(coords.rank))
        fault_point("start:gathered")
    except MPI.Exception as exc:
        # A torn creation from ``base`` (context id 0 for MPI_COMM_WORLD) leaves Open MPI's
        # context-id allocator open to ``base`` only (.ulfm.reset_cid_gate): the Shrink of ``base``
        # below passes it and reopens it; a local Dup of MPI_COMM_SELF would wait. ``Dup`` runs on
        # libnbc, which may say ERR_OTHER for a fault.
        if not (is_fault(exc, libnbc=True) if dup_failed else creation_failed(exc)):
            raise
        ok = False
        revoke_comm(glob)  # wake ranks still blocked in the derived splits
    n = base.Get_size()
    if all_ok(base, ok, "first world's"):
        assert glob is not None and processes is not None
        return FirstWorld(glob, replica, dp, processes, list(range(n)), built=True)
    for c in (dp, replica, glob):
        retire_comm(c)
    if processes is None:
        # No table over MPI: the node-mates are known from /proc (so that a frozen one is reaped
        # after the repair, as in any recovery); a process of another host is unknown (pid 0).
        mates = launch_mates()
        processes = [mates.get(r, ProcessInfo(rank=r, host="", pid=0, start_ticks=None)) for r in range(n)]
        processes[coords.rank] = this_process(coords.rank)
    # The retried Shrink passes the gate a failed Dup of ``base`` left behind; its reset would not.
    shrunk = shrink(base, coords.rank, reset_gate=not dup_failed)
    base_group = base.Get_group()
    try:
        logical = logical_members(shrunk, base_group, list(range(n)))
    finally:
        base_group.Free()
    _stop_unless_majority(coords.rank, len(logical), n, 0 in logical)
    return FirstWorld(shrunk, None, None, processes, logical, built=False)


def _stop_unless_majority(rank: int, kept: int, launched: int, with_rank0: bool) -> None:
    """No side of a network cut at start-up may go on alone (partition guards start later, with the
    heartbeat files): the survivors must be more than half the launch, or half with launch rank 0.
    The other side stops here, before it writes anything."""
    if 2 * kept > launched or (2 * kept == launched and with_rank0):
        return
    from .watch import stop_watch

    stop_watch()
    fail_stop(
        f"rank {rank}: {kept} of {launched} launch ranks left while the first world was built, not a "
        "majority: stopping rather than going on as one side of a cut"
    )


__all__ = ["FirstWorld", "build_first_world"]
