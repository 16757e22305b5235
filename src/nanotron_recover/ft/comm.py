"""The fault-tolerant communicator: membership, world epochs and DP reductions over ULFM MPI.

One :class:`FaultTolerantComm` per rank owns three kinds of MPI communicator,
all with ``MPI.ERRORS_RETURN`` so a failure raises ``MPI.Exception`` in Python
instead of aborting the job:

- the *global* communicator, a ``Dup`` of the launch communicator and the single
  source of truth for membership: a rank is in the job iff it is in it;
- the *replica* communicator (``Split(color=replica)``): this replica's TP*PP
  ranks, used e.g. to broadcast the replica's torch.distributed store address;
- the *DP* communicator of this rank's (pp, tp) coordinate
  (``Split(color=local_rank, key=replica)``): one member per alive replica, over
  which that coordinate's gradient shard is summed.

Every configuration of these communicators is a *world*, numbered by ``epoch``
(0 at start). A reduction is tagged with the epoch it ran in; a reduction from
an older world may be torn (some peers added a contribution that has since
died) and must be redone from the caller's snapshot in the current world.

Protocol of a step, as seen from here
-------------------------------------
1. The caller reduces its buckets with :meth:`FaultTolerantComm.allreduce_`
   (DP communicator only; nothing touches the global communicator).
2. The caller commits the step with :meth:`FaultTolerantComm.agree`, exactly one
   ``MPI_Comm_agree`` on the global communicator per step. The agreed value is
   the bitwise AND of ``flag | NO_RECOVERY | ~stop`` over the survivors: besides
   committing, the agree carries *stop requests*. A rank that must stop the job
   (a full disk, a deterministic error) clears its stop bit, and every survivor
   learns it from the same agree, so the whole job stops together, once.
3. The step commits iff ``agree`` returns True *without* raising. ULFM's agree is
   uniform even with failures: either every survivor gets the same value, or
   every survivor gets ``MPI_ERR_PROC_FAILED`` (we never acknowledge failures
   on the global communicator, so any failure since it was created makes every
   later agree on it fail, everywhere). So the rule is: *a step commits only if
   agree returns True on a world without new failures*.

Protocol of a recovery (:meth:`FaultTolerantComm.recover`)
---------------------------------------------------------
A rank enters recovery when an ``allreduce_`` fails (``ERR_PROC_FAILED``,
``ERR_PROC_FAILED_PENDING`` or ``ERR_REVOKED``), when the step agree fails or
reports that some rank is recovering, or when the caller asks for it.

1. *Revoke* every communicator this rank owns. Revoking one communicator does
   not interrupt operations pending on another, so a peer blocked in a DP
   allreduce with us only wakes up if we revoke that DP communicator.
2. *Entry agree* (skipped when entering from the step agree): ``Agree(0)`` on the
   old global communicator. This is the subtle part. ``Agree`` and ``Shrink``
   are *not* interrupted by a revoke, so a peer that finished its reductions
   and sits in the step agree would never match a ``Shrink`` we call; the two
   ranks would wait for each other forever. Instead every rank reaches recovery
   through exactly one agree on the old global communicator: peers in the step
   agree are matched by our entry agree, and since our contribution clears the
   ``NO_RECOVERY`` bit (or the agree fails on the failed process), they all
   learn uniformly that the world is changing and follow into step 3.
3. *Rounds*, on ``cur`` = the old global communicator, until one commits
   (steps 1-3 are :func:`.membership.shrink_world`):

   a. ``shrunk = cur.Shrink()`` (retried after ``Ack_failed`` if it raises);
   b. translate ``shrunk``'s group into the initial group: the alive ranks.
      A replica is alive iff all its ranks are alive; the failed ranks and
      failed replicas are what the previous world had and this one lacks.
      Every member of ``shrunk`` computes the same sets from the same group,
      without any extra message;
   c. ``new_global = shrunk.Split(color)`` with ``color = UNDEFINED`` for the
      *leavers* (alive ranks of failed replicas) and 0 for the survivors, keyed
      by initial rank. Leavers take part in the split, so nobody has to wait for
      a failure detector to notice them; the survivors then split
      ``new_global`` into the new replica and DP communicators. A failure here
      makes the rank revoke ``new_global`` (waking peers blocked in its splits)
      and vote 0;
   d. *commit agree* ``shrunk.Agree(ok)`` by every member of ``shrunk``, leavers
      included. ``shrunk`` contains every member of the new communicators, so
      any failure among them before this point makes the agree fail, uniformly.
      Agreed 1: the round commits. Anything else: retire what the round built,
      ``cur = shrunk`` and run another round; the failed sets are recomputed
      against the *pre-recovery* world, so they only grow.

4. After the commit, leavers call the ``on_leave`` hook and :func:`fail_stop`
   (SIGKILL; a non-zero exit would not be reported, see docs/architecture.md, "How each kind of
   fault ends").
   Survivors retire the old communicators (held, never freed: ``ulfm.retire_comm``),
   install the new ones and bump ``epoch`` by one. A failed rank whose process still runs on a survivor's
   host (frozen: the heartbeat detector declared it) is SIGKILLed there
   (:mod:`.processes`), so it never wakes up into a world that moved on. Every survivor took part in the same committed round, so
   they all hold the same epoch and alive set. If no replica is left, every rank
   raises :class:`~.world.AllReplicasFailed` instead.

*Parked ranks.* With ``park_orphans`` (``recover.rejoin.mode: spawn``) the alive ranks of a failed
replica do not leave: they stay members of the global communicator (not of any replica or DP
communicator), take part in every later agree and recovery, and are reused when their replica
re-joins.

Re-join (:mod:`.join`)
----------------------
A job that lost a replica grows back by a re-join: the join protocol spawns processes for the dead
ranks, merges them into a new global communicator and installs the grown world only after an agree
on it (stages, agrees and aborts are in :mod:`.join`'s docstring). It uses this class through
:meth:`~FaultTolerantComm.membership` (who is in the job, which the header carries),
:meth:`~FaultTolerantComm.spawned` and :meth:`~FaultTolerantComm.adopt` (a spawned process's
communicator before it joins), :meth:`~FaultTolerantComm.install` (the commit, as after a
recovery) and :meth:`~FaultTolerantComm.abandon` (a spawned process's abort).

Failures during shrink, split or the commit agree just cost another round;
failures after the commit are the next step's business (they are detected by
that step's reductions or agree).

Liveness assumption: every alive rank reaches ``allreduce_``, ``agree`` or
``recover`` in bounded time (one global agree per step, matched one-to-one
across ranks), or fails. Three mechanisms make that true:

- a rank that *stops responding* (frozen, or a node gone silent) is declared
  failed by ULFM's heartbeat detector (:mod:`.heartbeat`): nobody waits on another
  replica longer than the heartbeat timeout, and nobody kills itself for it;
- a rank stuck in its own replica's torch world, waiting for a TP/PP peer that
  failed, learns of the failure from the :class:`~.watch.FailureWatch` thread and
  leaves (``on_failure_notice``): its replica is lost anyway;
- a rank stuck in local work (a hung kernel, a save that never ends) is ended by
  its :class:`~.failstop.Watchdog`, whose deadlines cover only local phases.

Importing this module imports MPI through :mod:`.ulfm`, which defaults
``OMPI_MCA_async_mpi_finalize=1``: without it the survivors' ``MPI_Finalize`` can hang on a dead
rank at exit.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from .failstop import fail_stop
from .first_world import build_first_world
from .grid_position import GridPosition
from .membership import Membership, shrink_world
from .partition import PartitionGuard
from .processes import ProcessInfo, fill_in, this_process
from .step_bits import NO_RECOVERY, decode_follow, decode_step, encode_follow, encode_step
from .topology import RankCoords, Topology
from .transport import eager_slices
from .ulfm import FAULT_ERROR_CLASSES, MPI, agree, is_fault, retire_comm
from .watch import ensure_watch, stop_watch
from .world import AllReplicasFailed, FTError, JoinFailed, JoinPlan, RecoveryResult, StaleEpoch, WorldChanged


def _as_numpy(buf: Any) -> np.ndarray:
    """A writeable, contiguous NumPy view of ``buf`` (NumPy array or CPU torch tensor), sharing memory."""
    torch = sys.modules.get("torch")  # no torch import here: this module must work without it
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise TypeError(f"allreduce_ needs a CPU tensor, got device {buf.device}")
        if buf.dtype in (torch.bfloat16, torch.float16):
            raise TypeError(f"allreduce_ reduces in fp32/fp64; got {buf.dtype} (MPI has no such SUM)")
        if not buf.is_contiguous():
            raise ValueError("allreduce_ needs a contiguous tensor (it reduces in place)")
        arr = buf.detach().numpy()
    elif isinstance(buf, np.ndarray):
        arr = buf
    else:
        raise TypeError(f"allreduce_ takes a numpy array or a torch CPU tensor, got {type(buf).__name__}")
    if not (arr.flags.c_contiguous and arr.flags.writeable):
        raise ValueError("allreduce_ needs a C-contiguous, writeable buffer (it reduces in place)")
    return arr


def _launched(tp: int, pp: int, n_replicas: int, launched_replicas: int | None, size: int) -> int:
    """The replicas a launch communicator of ``size`` ranks holds (see ``launched_replicas``)."""
    launched = n_replicas if launched_replicas is None else launched_replicas
    if not 1 <= launched <= n_replicas:
        raise ValueError(f"launched_replicas must be in 1..{n_replicas}, got {launched}")
    if size != launched * pp * tp:
        raise ValueError(
            f"communicator has {size} ranks, expected "
            f"replicas*pp*tp = {launched}*{pp}*{tp} = {launched * pp * tp}"
        )
    return launched


class FaultTolerantComm(GridPosition):
    """Membership, world epochs and fault-tolerant DP reductions for one rank.

    Args:
        tp, pp, n_replicas: the grid at full width, laid out as in :mod:`.topology`.
        launched_replicas: how many replicas the launch communicator holds (default
            ``n_replicas``): it must have ``tp * pp * launched_replicas`` ranks, which take
            replicas ``0 .. launched_replicas - 1``; the others start out lost. A job relaunched
            on fewer hosts than it had starts narrower this way, with the same grid.
        comm: the launch communicator (default ``MPI.COMM_WORLD``); it is
            ``Dup``-ed, not modified.
        on_leave: called with the :class:`RecoveryResult` on a rank that must leave
            because its replica failed, just before it SIGKILLs itself
            (e.g. to log the incident). Exceptions from it are ignored.
        fault_hook: fault injection; called with a point name (``"start:dup"``,
            ``"start:split"``, ``"start:gathered"``) while the first world is built,
            (``"recover:enter"``, ``"recover:revoked"``, ``"recover:shrunk"``,
            ``"recover:split"``, ``"recover:committed"``) during recovery, and
            (``"join:spawned"``, ``"join:merged"``) on a member during a re-join.
        on_failure_notice: if given, a :class:`~.watch.FailureWatch` thread calls it
            with ``(newly failed initial ranks, wall time)`` as soon as this process
            learns of a failure, even while it computes outside MPI.
        park_orphans: keep the alive ranks of a failed replica in the job, parked, for a
            later re-join (instead of letting them leave).

    Construction is collective over ``comm``. A process lost while the first world is built (a
    crash, or one the heartbeat declared dead by mistake on a busy node) is repaired like any later
    failure (:mod:`.first_world`); the repair is in :attr:`startup_repair`.
    """

    def __init__(
        self,
        tp: int,
        pp: int,
        n_replicas: int,
        comm: MPI.Comm | None = None,
        *,
        on_leave: Callable[[RecoveryResult], None] | None = None,
        fault_hook: Callable[[str], None] | None = None,
        on_failure_notice: Callable[[list[int], float], None] | None = None,
        park_orphans: bool = False,
        launched_replicas: int | None = None,
    ) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        launched = _launched(tp, pp, n_replicas, launched_replicas, base.Get_size())
        self._setup(tp, pp, n_replicas, on_leave, fault_hook, park_orphans, launched)
        # The watch (it also carries the heartbeats, see .heartbeat) runs since MPI_Init in a job
        # (.heartbeat.start_mpi); a program that starts it here makes its Dup of ``base`` before
        # the first world's, outside that world's repair.
        ensure_watch(base, on_failure_notice)
        self.coords: RankCoords = self.topology.coords(base.Get_rank())
        first = build_first_world(base, self.coords, self.fault_point)
        self._global, self._replica_comm, self._dp_comm = first.global_comm, first.replica_comm, first.dp_comm
        # Logical rank (the place in the grid) of each rank of the global communicator. At launch
        # it is the launch rank; a process spawned by a re-join takes the logical rank of the dead
        # process it replaces. Failed ranks are always reported as logical ranks.
        self._logical: list[int] = first.logical
        # Who is who: (host, pid) of every logical rank, to tell a hung failed rank from a crashed
        # one and to remove it for good (replaced when a re-join spawns a new process there).
        self.processes: list[ProcessInfo] = first.processes
        # The recovery that repaired a process lost while the first world was built (None: none
        # was lost then); the caller records it as an incident of the start. Nothing to park yet.
        self.startup_repair: RecoveryResult | None = None
        if not first.built:
            park, self._park_orphans = self._park_orphans, False
            try:
                self.startup_repair = self._recover(
                    "start-up", detect_s=0.0, entry_agree=False, share_table=True
                )
            finally:
                self._park_orphans = park

    @classmethod
    def spawned(
        cls,
        tp: int,
        pp: int,
        n_replicas: int,
        *,
        on_leave: Callable[[RecoveryResult], None] | None = None,
        fault_hook: Callable[[str], None] | None = None,
        on_failure_notice: Callable[[list[int], float], None] | None = None,
        park_orphans: bool = True,
    ) -> FaultTolerantComm:
        """The communicator of a process spawned by a re-join (:func:`.join.join_parent`), before it
        joins: no place in the grid until :meth:`adopt`, no communicators until the join commits
        (:meth:`install`). Its failure watch starts at once, on the spawned processes'
        ``MPI.COMM_WORLD``: it carries the heartbeats until the commit moves it."""
        self = cls.__new__(cls)
        self._setup(tp, pp, n_replicas, on_leave, fault_hook, park_orphans)
        self._global = self._replica_comm = self._dp_comm = None
        ensure_watch(MPI.COMM_WORLD, on_failure_notice)
        return self

    def _setup(
        self,
        tp: int,
        pp: int,
        n_replicas: int,
        on_leave: Callable[[RecoveryResult], None] | None,
        fault_hook: Callable[[str], None] | None,
        park_orphans: bool,
        launched_replicas: int | None = None,
    ) -> None:
        self.topology = Topology(tp=tp, pp=pp, n_replicas=n_replicas)
        launched = n_replicas if launched_replicas is None else launched_replicas
        self._on_leave = on_leave
        self._fault_hook = fault_hook
        self._park_orphans = park_orphans
        self._epoch = 0
        self._alive_replicas: list[int] = list(range(launched))
        self._alive_ranks: list[int] = list(range(launched * self.topology.replica_size))
        self._parked_ranks: list[int] = []
        # Epoch since which each replica has been alive without interruption: the longest-serving
        # replica keeps the logging and checkpoint-writing roles when others re-join.
        self._alive_since: dict[int, int] = {r: 0 for r in range(launched)}
        self._closed = False
        # True while this rank is inside allreduce_/agree/recover: MPI itself will tell it about
        # failures then, so the failure watch leaves it alone.
        self.in_ft_operation = False
        # The last step this rank committed (set by the step transaction): gathered at the end of
        # every recovery, so that a rank whose commit agree raised learns whether others returned.
        self.last_commit = -1
        # Set by the training mode: judges which side of a cut network goes on (.partition).
        self.partition_guard: PartitionGuard | None = None

    # ----------------------------------------------------------------- accessors
    @property
    def epoch(self) -> int:
        """The current world epoch (0 at start, +1 per committed recovery, same on all survivors)."""
        return self._epoch

    @property
    def alive_replicas(self) -> list[int]:
        """Sorted initial ids of the replicas in the current world."""
        return list(self._alive_replicas)

    @property
    def alive_ranks(self) -> list[int]:
        """Sorted logical ranks of the alive replicas."""
        return list(self._alive_ranks)

    @property
    def parked(self) -> bool:
        """This rank's replica failed; the rank stays in the job to be reused by a re-join."""
        return self.coords.rank in self._parked_ranks

    @property
    def parked_ranks(self) -> list[int]:
        """Sorted logical ranks of parked members (alive ranks of failed replicas)."""
        return list(self._parked_ranks)

    @property
    def members(self) -> list[int]:
        """Sorted logical ranks of every member of the global communicator."""
        return sorted(self._alive_ranks + self._parked_ranks)

    @property
    def senior_replica(self) -> int:
        """The alive replica that has been alive the longest (lowest id among equals): it logs and
        writes checkpoints, so a replica that re-joins never takes those roles over mid-run."""
        return min(self._alive_replicas, key=lambda r: (self._alive_since.get(r, 0), r))

    @property
    def alive_since(self) -> dict[int, int]:
        return dict(self._alive_since)

    @property
    def global_comm(self) -> MPI.Comm:
        return self._global

    @property
    def replica_comm(self) -> MPI.Comm:
        return self._replica_comm

    @property
    def dp_comm(self) -> MPI.Comm:
        return self._dp_comm

    @property
    def park_orphans(self) -> bool:
        """The alive ranks of a failed replica park instead of leaving (``recover.rejoin``)."""
        return self._park_orphans

    # ------------------------------------------------------- re-join (see .join)
    def membership(self) -> Membership:
        """Who is in the job, as this member sees it (the same on every member)."""
        return Membership(
            epoch=self._epoch,
            alive_replicas=list(self._alive_replicas),
            parked_ranks=list(self._parked_ranks),
            alive_since=dict(self._alive_since),
            processes=list(self.processes),
            logical=list(self._logical),
        )

    def adopt(self, rank: int, membership: Membership) -> None:
        """A spawned process (:meth:`spawned`) takes logical rank ``rank``, the place of a dead
        rank, in the world ``membership`` describes; it has communicators once the join commits."""
        self.coords = self.topology.coords(rank)
        self.install(None, None, None, membership)

    def install(
        self,
        global_comm: MPI.Comm | None,
        replica_comm: MPI.Comm | None,
        dp_comm: MPI.Comm | None,
        membership: Membership,
    ) -> None:
        """Move to a new world (a committed recovery or re-join): retire the old communicators and
        take these, and ``membership``; the alive ranks follow from the alive replicas."""
        for comm in (self._dp_comm, self._replica_comm, self._global):
            retire_comm(comm)
        self._global, self._replica_comm, self._dp_comm = global_comm, replica_comm, dp_comm
        self._epoch = membership.epoch
        self._alive_replicas = list(membership.alive_replicas)
        self._alive_ranks = [r for rep in self._alive_replicas for r in self.topology.ranks_of_replica(rep)]
        self._parked_ranks = list(membership.parked_ranks)
        self._alive_since = dict(membership.alive_since)
        self.processes = list(membership.processes)
        self._logical = list(membership.logical)

    def abandon(self, reason: str) -> NoReturn:
        """Give this process up for good (a spawned process whose join aborted): closed, then
        SIGKILLed, which the runtime reports like any crash."""
        self._closed = True
        fail_stop(reason)

    # --------------------------------------------------------------- operations
    def allreduce_(self, buf: Any, epoch: int, out: Any = None) -> None:
        """In-place SUM of ``buf`` over the DP communicator of the world ``epoch`` (with ``out``:
        the sum goes there and ``buf`` is only read, so it stays this rank's contribution).

        Raises :class:`StaleEpoch` (without communicating) if ``epoch`` is not the
        current one. On a process failure or revoke it runs :meth:`recover` and
        raises :class:`WorldChanged`; ``buf`` is then torn (partially reduced) and
        must be restored from the caller's snapshot before it is reduced again.
        """
        self.check_open()
        if epoch != self._epoch:
            raise StaleEpoch(epoch, self._epoch)
        recv = _as_numpy(buf if out is None else out).reshape(-1)
        send = None if out is None else _as_numpy(buf).reshape(-1)
        t0 = time.perf_counter()
        self.in_ft_operation = True
        try:
            # One call per slice below the TCP eager limit: a rendezvous torn by a fault can deadlock
            # Open MPI's TCP transport (see transport.py).
            for part in eager_slices(recv.size, recv.itemsize):
                self._dp_comm.Allreduce(MPI.IN_PLACE if send is None else send[part], recv[part], op=MPI.SUM)
        except MPI.Exception as exc:
            if not is_fault(exc):
                raise
            result = self._recover("allreduce", detect_s=time.perf_counter() - t0, entry_agree=True)
            raise WorldChanged(result) from exc
        finally:
            self.in_ft_operation = False

    def agree(self, flag: bool, stop: int = 0, kind: str = "step") -> tuple[bool, int]:
        """The commit point of a step: logical AND of ``flag``, and OR of ``stop``, over the survivors.

        ``stop`` is a small bit set (0..255) of stop requests: any bit one rank sets, every
        survivor gets back. ``kind`` tells parked ranks (:meth:`follow`) what this agree is: a
        step's commit, the boundary of a re-join, the end of the run, or a stop that follows.
        Returns ``(flag, stop)`` only if no rank failed and no rank is recovering; otherwise runs
        :meth:`recover` on every survivor and raises :class:`WorldChanged` (uniformly: either all
        survivors return the same value or all raise).
        """
        return decode_step(self._agree_value(encode_step(flag, stop, kind)))

    def follow(self, stop: int = 0) -> tuple[int, str]:
        """A parked rank's side of the next global agree: ``(stop bits, kind)`` of what the active
        ranks agreed (plus ``stop``, a stop this rank requested before it parked); raises
        :class:`WorldChanged` like :meth:`agree`."""
        return decode_follow(self._agree_value(encode_follow(stop)))

    def _agree_value(self, mine: int) -> int:
        self.check_open()
        t0 = time.perf_counter()
        self.in_ft_operation = True
        try:
            try:
                value = agree(self._global, mine, "step")
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                value = 0  # failure seen by the agree itself: uniform across survivors
            if not value & NO_RECOVERY:
                # Either the agree failed, or some rank's entry agree (which contributes 0)
                # matched ours: it is already past its revokes and waits for us in the rounds.
                result = self._recover("agree", detect_s=time.perf_counter() - t0, entry_agree=False)
                raise WorldChanged(result)
        finally:
            self.in_ft_operation = False
        return value

    def recover(self) -> RecoveryResult:
        """Move every survivor to a new world without the failed replicas (see module docstring).

        Collective in effect: every other rank is pulled in through its next
        DP reduction or step agree. Returns on survivors; SIGKILLs leavers;
        raises :class:`AllReplicasFailed` if no replica is left.
        """
        self.check_open()
        self.in_ft_operation = True
        try:
            return self._recover("manual", detect_s=0.0, entry_agree=True)
        finally:
            self.in_ft_operation = False

    def barrier(self) -> None:
        """A barrier over the current world's survivors; raises ``MPI.Exception`` on a failure."""
        self._global.Barrier()

    def stop_watch(self) -> None:
        stop_watch()

    def close(self) -> None:
        """Retire the owned communicators (end of job). Idempotent."""
        self.stop_watch()
        if self._closed:
            return
        self._closed = True
        for comm in (self._dp_comm, self._replica_comm, self._global):
            retire_comm(comm)

    # --------------------------------------- for .membership and .join, and internals
    def check_open(self) -> None:
        """Raise :class:`FTError` if this communicator was closed (or its rank left)."""
        if self._closed:
            raise FTError("FaultTolerantComm is closed")

    def fault_point(self, point: str) -> None:
        """Call the ``fault_hook`` (if any) at a named point of a recovery or a re-join."""
        if self._fault_hook is not None:
            self._fault_hook(point)

    def _recover(
        self, trigger: str, *, detect_s: float, entry_agree: bool, share_table: bool = False
    ) -> RecoveryResult:
        # 1-3. Revoke, entry agree, rounds until one commits (.membership; changes nothing here).
        new = shrink_world(self, trigger, detect_s=detect_s, entry_agree=entry_agree)
        result = new.result

        # 4. Leave, give up, or install the new world.
        if not result.alive_replicas:
            self._closed = True
            self.stop_watch()
            raise AllReplicasFailed(result)
        if result.left:
            self._closed = True
            self.stop_watch()
            if self._on_leave is not None:
                try:
                    self._on_leave(result)
                except Exception:
                    pass  # logging must not keep a leaver alive
            fail_stop(
                f"rank {self.rank} (replica {self.coords.replica}) leaves: replica failed, "
                f"epoch {result.old_epoch} -> {result.new_epoch}"
            )

        if self.partition_guard is not None:
            # The members before the failure: ranks of alive replicas and parked ranks alike.
            before = sorted(set(self._alive_ranks) | set(self._parked_ranks))
            self.partition_guard.stop_if_smaller_side(self.rank, before, result, self.processes)
        assert new.global_comm is not None and new.membership is not None
        self.install(new.global_comm, new.replica_comm, new.dp_comm, new.membership)
        for comm in new.spent:
            retire_comm(comm)
        # 5. The newest commit among the survivors. A process that dies right after it contributed
        # to the step agree may leave the agree returning on one survivor and raising
        # ERR_PROC_FAILED on another (the man page promises a uniform error only for a process
        # that fails before contributing). Seen on the emulated cluster in exact mode: the logging
        # rank returned from step N's agree and wrote N, was killed there, and from N+1 on the run
        # left the fault-free curve with the same ids: survivors summing different steps. The one
        # that raised is one step behind; it learns it here and commits the step it holds
        # (step.py) instead of redoing it.
        # Each member's own process entry comes along, and with ``share_table`` (the recovery of
        # the first world, :mod:`.first_world`) its whole table: a member that gathered it before
        # the failure tells the others what the failed processes were.
        shared = self.processes if share_table else []
        try:
            gathered = self._global.allgather((self.last_commit, this_process(self.coords.rank), shared))
        except MPI.Exception as exc:
            if not is_fault(exc):
                raise
            return self._recover(trigger, detect_s=detect_s, entry_agree=True, share_table=share_table)
        commits, own, tables = zip(*gathered, strict=True)
        fill_in(self.processes, list(own), list(tables))
        newest = max(commits)
        return dataclasses.replace(result, newest_commit=newest)


__all__ = [
    "FAULT_ERROR_CLASSES",
    "AllReplicasFailed",
    "FTError",
    "FaultTolerantComm",
    "JoinFailed",
    "JoinPlan",
    "Membership",
    "RecoveryResult",
    "StaleEpoch",
    "WorldChanged",
    "is_fault",
]
