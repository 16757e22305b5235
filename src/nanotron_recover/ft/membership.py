"""Who is in the job, and the shrink-and-resplit recovery round that changes it.

A :class:`Membership` is what every member of the global communicator knows alike about the job:
the world epoch, the alive replicas, the parked ranks, which process is behind each logical rank,
and the logical rank of each rank of the global communicator. :class:`~.comm.FaultTolerantComm`
installs one with its communicators after a committed recovery or re-join; a re-join's header
carries one to the spawned processes (:mod:`.join`).

:func:`shrink_world` is steps 1-3 of :meth:`~.comm.FaultTolerantComm.recover`: it revokes the
rank's communicators, meets its peers through the entry agree, and runs shrink / split /
commit-agree rounds until one commits (the protocol, and why each step is there, is in
:mod:`.comm`'s docstring). It returns the committed round as a :class:`NewWorld` and changes
nothing on the communicator it was given: step 4 (leave, give up, or install the new world) is the
communicator's. What it uses of the communicator is public: ``membership()``, ``members``,
``global_comm``, ``replica_comm``, ``dp_comm``, ``topology``, ``coords``, ``rank``,
``park_orphans`` and ``fault_point()``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .failstop import fail_stop
from .processes import ProcessInfo, reap, still_running
from .topology import RankCoords
from .ulfm import MPI, agree, agreement, all_ok, creation_failed, is_fault, retire_comm, revoke_comm
from .world import RecoveryResult

if TYPE_CHECKING:
    from .comm import FaultTolerantComm

# A shrink that keeps raising is not a failure we can recover from by retrying.
MAX_SHRINK_ATTEMPTS = 64


@dataclass(frozen=True)
class Membership:
    """Who is in the job, the same on every member of the global communicator."""

    epoch: int  # the world epoch: 0 at start, +1 per committed recovery or re-join
    alive_replicas: list[int]  # sorted
    parked_ranks: list[int]  # sorted logical ranks of the alive ranks of failed replicas
    alive_since: dict[int, int]  # replica -> epoch since which it has been alive without interruption
    processes: list[ProcessInfo]  # (host, pid) of every logical rank
    logical: list[int]  # logical rank of each rank of the global communicator, in its rank order


@dataclass
class NewWorld:
    """The committed round of a recovery, as this rank sees it.

    On a rank that stays (survivor or parked) the communicators and ``membership`` are the new
    world's; on a leaver (``result.left``) and when no replica is left they are None."""

    result: RecoveryResult
    global_comm: MPI.Comm | None
    replica_comm: MPI.Comm | None  # None on a parked rank too
    dp_comm: MPI.Comm | None  # None on a parked rank too
    membership: Membership | None
    spent: list[MPI.Comm]  # the rounds' shrunk communicators: retired once the new world is installed


def split_derived(
    glob: MPI.Comm, coords: RankCoords, active: bool
) -> tuple[MPI.Comm | None, MPI.Comm | None]:
    """The replica and DP communicators of ``glob`` for the rank at ``coords`` (collective over
    ``glob``); a parked rank (not ``active``) takes part in the splits but gets neither."""
    replica = glob.Split(color=coords.replica if active else MPI.UNDEFINED, key=coords.local_rank)
    dp = glob.Split(color=coords.local_rank if active else MPI.UNDEFINED, key=coords.replica)
    if not active:
        return None, None
    replica.Set_errhandler(MPI.ERRORS_RETURN)
    dp.Set_errhandler(MPI.ERRORS_RETURN)
    return replica, dp


def shrink_world(ftc: FaultTolerantComm, trigger: str, *, detect_s: float, entry_agree: bool) -> NewWorld:
    """Steps 1-3 of a recovery on ``ftc``'s current world (collective in effect, see :mod:`.comm`).

    ``trigger`` and ``detect_s`` go into the :class:`RecoveryResult`; ``entry_agree`` is False when
    the recovery was entered from the step agree, which then served as the entry agree."""
    detected_at = time.time()
    t_start = time.perf_counter()
    before = ftc.membership()
    old_epoch = before.epoch
    prev_replicas = before.alive_replicas
    prev_members = set(ftc.members)
    old_global = ftc.global_comm
    # Every group below is translated into the pre-recovery global communicator's group.
    base_group = old_global.Get_group()
    base_logical = before.logical
    ftc.fault_point("recover:enter")

    # 1. Revoke everything we own: peers blocked in any of them must wake up.
    for comm in (ftc.dp_comm, ftc.replica_comm, old_global):
        revoke_comm(comm)
    ftc.fault_point("recover:revoked")

    # 2. Entry agree: match the step agree of peers that are already there.
    if entry_agree:
        try:
            agree(old_global, 0, "recovery's entry")
        except MPI.Exception as exc:
            if not is_fault(exc):
                raise
    revoke_s = time.perf_counter() - t_start

    # 3. Rounds until one commits.
    cur = old_global
    discarded: list[MPI.Comm] = []  # shrunk communicators of failed rounds
    shrink_s = 0.0
    rounds = 0
    while True:
        rounds += 1
        t_shrink = time.perf_counter()
        shrunk = shrink(cur, ftc.rank)
        shrink_s += time.perf_counter() - t_shrink
        ftc.fault_point("recover:shrunk")

        members = logical_members(shrunk, base_group, base_logical)
        complete = set(ftc.topology.complete_replicas(members))
        alive_replicas = [r for r in prev_replicas if r in complete]
        active = ftc.coords.replica in alive_replicas
        leaving = not active and not ftc.park_orphans

        ok = True
        new_global: MPI.Comm | None = None
        new_replica: MPI.Comm | None = None
        new_dp: MPI.Comm | None = None
        try:
            new_global = shrunk.Split(MPI.UNDEFINED if leaving else 0, key=ftc.coords.rank)
            if not leaving:
                new_global.Set_errhandler(MPI.ERRORS_RETURN)
                new_replica, new_dp = split_derived(new_global, ftc.coords, active)
        except MPI.Exception as exc:
            # A split torn by a failure or a revoke may raise ERR_OTHER (libnbc) and leaves Open MPI's
            # context-id allocator closed to the next round's communicators (.ulfm.reset_cid_gate).
            if not creation_failed(exc):
                raise
            ok = False
            revoke_comm(new_global)  # wake survivors blocked in the derived splits
        ftc.fault_point("recover:split")
        # Which failed ranks still run on this host (frozen, not crashed): looked at before the
        # commit agree, so before any survivor kills them.
        seen_running = {r: still_running(before.processes[r]) for r in sorted(prev_members - set(members))}

        if all_ok(shrunk, ok, "recovery round's"):
            break
        for comm in (new_dp, new_replica, new_global):
            retire_comm(comm)
        discarded.append(shrunk)
        cur = shrunk
    base_group.Free()

    alive_set = set(alive_replicas)
    survivors = [r for r in members if ftc.topology.replica_of(r) in alive_set]
    parked = [r for r in members if ftc.topology.replica_of(r) not in alive_set] if ftc.park_orphans else []
    failed_ranks = sorted(prev_members - set(members))
    hung = [r for r in failed_ranks if seen_running.get(r)]
    unseen = [r for r in failed_ranks if seen_running.get(r, None) is None]
    if not leaving:
        # Remove a failed rank that still runs here for good (see .comm's docstring). Only after
        # the commit: every survivor looked at it before the commit agree, so none of them
        # mistakes a hung rank another survivor just killed for a crashed one.
        for r in hung:
            reap(before.processes[r])
    result = RecoveryResult(
        old_epoch=old_epoch,
        new_epoch=old_epoch + 1,
        failed_replicas=tuple(r for r in prev_replicas if r not in complete),
        failed_ranks=tuple(failed_ranks),
        alive_replicas=tuple(alive_replicas),
        trigger=trigger,
        detect_s=detect_s,
        detected_at=detected_at,
        revoke_s=revoke_s,
        shrink_s=shrink_s,
        recover_s=time.perf_counter() - t_start,
        rounds=rounds,
        left=leaving,
        hung_ranks=tuple(hung),
        unseen_ranks=tuple(unseen),
        parked=not active and not leaving,
    )
    ftc.fault_point("recover:committed")
    staying = None
    if not leaving and alive_replicas:
        staying = Membership(
            epoch=old_epoch + 1,
            alive_replicas=alive_replicas,
            parked_ranks=parked,
            alive_since=before.alive_since,
            processes=before.processes,
            # new_global is ordered by logical rank (the split key).
            logical=sorted(members) if ftc.park_orphans else survivors,
        )
    return NewWorld(
        result=result,
        global_comm=new_global,
        replica_comm=new_replica,
        dp_comm=new_dp,
        membership=staying,
        spent=[*discarded, shrunk],
    )


def shrink(comm: MPI.Comm, rank: int, *, reset_gate: bool = True) -> MPI.Comm:
    """``comm.Shrink()``, retried if a failure interrupts it; ``rank`` (logical) names this rank
    if it has to give up. ``reset_gate`` False: a creation from ``comm`` (the launch communicator,
    context id 0) failed before, so the context-id gate's reset would wait
    (:func:`.ulfm.reset_cid_gate`); the retried ``Shrink`` passes it without."""
    for _ in range(MAX_SHRINK_ATTEMPTS):
        try:
            with agreement():  # its context id is agreed (ulfm.agreement)
                shrunk = comm.Shrink()
        except MPI.Exception as exc:
            # Shrink allocates its context id through the same gate as every creation (not
            # through libnbc: its allreduces are agreements), so it is reopened here too.
            if not (creation_failed(exc, libnbc=False) if reset_gate else is_fault(exc)):
                raise
            # Open MPI's shrink completes despite failures (it agrees on the failed set
            # internally), so this is a belt-and-braces path: acknowledge what is known
            # and retry on the same communicator, as every survivor then does.
            try:
                comm.Ack_failed()
            except MPI.Exception:
                pass
            continue
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        return shrunk
    fail_stop(f"rank {rank}: Shrink failed {MAX_SHRINK_ATTEMPTS} times")


def logical_members(comm: MPI.Comm, base_group: MPI.Group, base_logical: list[int]) -> list[int]:
    """Logical ranks of ``comm``'s members, through the group of the communicator they came from."""
    group = comm.Get_group()
    try:
        ranks = group.Translate_ranks(list(range(group.Get_size())), base_group)
    finally:
        group.Free()
    return sorted(base_logical[int(r)] for r in ranks)


__all__ = [
    "MAX_SHRINK_ATTEMPTS",
    "Membership",
    "NewWorld",
    "logical_members",
    "shrink",
    "shrink_world",
    "split_derived",
]
