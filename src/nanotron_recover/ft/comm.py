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
3. *Rounds*, on ``cur`` = the old global communicator, until one commits:

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
      Agreed 1: the round commits. Anything else: free what the round built,
      ``cur = shrunk`` and run another round; the failed sets are recomputed
      against the *pre-recovery* world, so they only grow.

4. After the commit, leavers call the ``on_leave`` hook and :func:`fail_stop`
   (SIGKILL; a non-zero exit would not be reported, see docs/architecture.md, "How each kind of
   fault ends").
   Survivors free the old communicators, install the new ones and bump
   ``epoch`` by one. A failed rank whose process still runs on a survivor's
   host (frozen: the heartbeat detector declared it) is SIGKILLed there
   (:mod:`.processes`), so it never wakes up into a world that moved on. Every survivor took part in the same committed round, so
   they all hold the same epoch and alive set. If no replica is left, every rank
   raises :class:`~.world.AllReplicasFailed` instead.

*Parked ranks.* With ``park_orphans`` (``recover.rejoin.mode: spawn``) the alive ranks of a failed
replica do not leave: they stay members of the global communicator (not of any replica or DP
communicator), take part in every later agree and recovery, and are reused when their replica
re-joins.

Protocol of a re-join (:meth:`FaultTolerantComm.begin_join`, :meth:`commit_join`)
------------------------------------------------------------------------------
At a step boundary the active ranks decide, from state they all hold, which replicas come back and
which logical ranks to spawn (the ranks of those replicas that are not members any more); an agree
of kind ``join`` tells the parked ranks. Then, collectively over the global communicator:

1. the *header* (the plan, the epoch, the membership and the caller's payload) is broadcast from the
   root, the lowest alive rank, so parked ranks learn the plan;
2. ``Spawn`` of one process per missing rank from the root, then ``Merge`` of the
   intercommunicator into ``merged`` (the spawned processes come last) and the header broadcast to
   them; spawned process ``k`` takes logical rank ``new_ranks[k]``, i.e. the place of a dead rank
   in the grid (the grid of :mod:`.topology` never changes; only the process behind a logical rank
   does). Spawn and Merge can fail on some members only, so after the header, the spawn and the
   merge the members agree on the stage's outcome: a stage that failed anywhere raises
   :class:`JoinFailed` everywhere (``could_not_start`` when the spawn itself could not start: no
   free slot, unknown host, missing command), and nothing changed;
3. an allgather of (logical rank, process) and the replica and DP splits of ``merged``, with the
   re-joining replicas' ranks now active, plus the failure watch's own duplicate;
4. the caller moves the replica state over the new DP communicators (``data_parallel/forward/state_transfer.py``);
5. *commit agree* ``merged.Agree(ok)``: uniform, so either every member installs the new world
   (epoch + 1, the replicas alive again) or none does. On an abort the parents keep their old
   communicators (a dead parent is then found by the next step's agree, as any failure) and the
   spawned processes SIGKILL themselves; the job goes on at its width.

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

Importing this module defaults ``OMPI_MCA_async_mpi_finalize=1`` (see below):
without it the survivors' ``MPI_Finalize`` can hang on a dead rank at exit.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .failstop import fail_stop
from .processes import ProcessInfo, reap, still_running, this_process
from .topology import RankCoords, Topology
from .world import AllReplicasFailed, FTError, JoinFailed, JoinPlan, RecoveryResult, StaleEpoch, WorldChanged

# Skip the PMIx fence in MPI_Finalize. Seen here with Open MPI 5.0.11 + ULFM: after a
# rank was SIGKILLed, the survivors' MPI_Finalize waited on the dead rank in that fence
# in 20-40% of runs, forever (usleep loop in ompi_mpi_finalize); with the fence off,
# 0 hangs in 50 runs. The fence only guards messages still buffered at exit, and every
# exchange here ends in a completed collective. Must be set before MPI is initialized
# (i.e. before mpi4py.MPI is first imported); setdefault keeps a launcher's choice.
os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")

import mpi4py  # noqa: E402

# No MPI_Finalize at interpreter exit: with the heartbeat detector on it blocked even after a clean
# run (Open MPI 5.0.11), and after a failure it can wait on the dead. Every rank ends with a
# barrier of the survivors and an exit without Finalize, which mpirun reports cleanly.
mpi4py.rc.finalize = False

from mpi4py import MPI  # noqa: E402  (must come after the MCA default above)

# Error classes that mean "the world changed" (vs. a programming error).
FAULT_ERROR_CLASSES: frozenset[int] = frozenset(
    {MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED}
)

# Bits of the step agree. The agree is a bitwise AND, so a single rank that clears
# NO_RECOVERY (the entry agree of a recovering rank contributes 0) pulls everyone in, and a single
# rank that clears a stop bit stops everyone. Stop requests are small non-negative ints whose bits
# live above _STOP_SHIFT.
_FLAG = 0x1
_NO_RECOVERY = 0x2
_STOP_SHIFT = 2
_STOP_BITS = 0xFF
# What kind of global agree this is, for parked ranks (which contribute all ones and only follow):
# each kind but "step" is one bit that the active ranks clear.
_KIND_SHIFT = 10
AGREE_KINDS = ("join", "finish", "stop")
_KIND_MASK = (1 << len(AGREE_KINDS)) - 1

# A shrink that keeps raising is not a failure we can recover from by retrying.
_MAX_SHRINK_ATTEMPTS = 64


def is_fault(exc: BaseException) -> bool:
    """True if ``exc`` is an MPI error caused by a process failure or a revoke."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAULT_ERROR_CLASSES


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


def _revoke(comm: MPI.Comm | None) -> None:
    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        comm.Revoke()
    except MPI.Exception:
        pass  # already revoked, or its peers are gone: the revoke is best effort by design


def _free(comm: MPI.Comm | None) -> None:
    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        comm.Free()
    except MPI.Exception:
        pass  # a communicator with dead members may refuse; leaking one handle is harmless


@dataclass
class PendingJoin:
    """The communicators a re-join built; installed by :meth:`FaultTolerantComm.commit_join`."""

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
            _revoke(comm)
            _free(comm)


class FaultTolerantComm:
    """Membership, world epochs and fault-tolerant DP reductions for one rank.

    Args:
        tp, pp, n_replicas: the initial grid; the launch communicator must have
            ``tp * pp * n_replicas`` ranks, laid out as in :mod:`.topology`.
        comm: the launch communicator (default ``MPI.COMM_WORLD``); it is
            ``Dup``-ed, not modified.
        on_leave: called with the :class:`RecoveryResult` on a rank that must leave
            because its replica failed, just before it SIGKILLs itself
            (e.g. to log the incident). Exceptions from it are ignored.
        fault_hook: test-only fault injection; called with a point name
            (``"recover:enter"``, ``"recover:revoked"``, ``"recover:shrunk"``,
            ``"recover:split"``, ``"recover:committed"``) during recovery.
        on_failure_notice: if given, a :class:`~.watch.FailureWatch` thread calls it
            with ``(newly failed initial ranks, wall time)`` as soon as this process
            learns of a failure, even while it computes outside MPI.
        park_orphans: keep the alive ranks of a failed replica in the job, parked, for a
            later re-join (instead of letting them leave).

    Construction is collective over ``comm`` and is not itself fault tolerant:
    a failure before the first epoch exists is a failed launch.
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
    ) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        self._setup(tp, pp, n_replicas, on_leave, fault_hook, park_orphans)
        if base.Get_size() != self.topology.world_size:
            raise ValueError(
                f"communicator has {base.Get_size()} ranks, expected "
                f"n_replicas*pp*tp = {n_replicas}*{pp}*{tp} = {self.topology.world_size}"
            )
        self._global: MPI.Comm = base.Dup()
        self._global.Set_errhandler(MPI.ERRORS_RETURN)
        # Logical rank (the place in the grid) of each rank of the global communicator. At launch
        # it is the launch rank; a process spawned by a re-join takes the logical rank of the dead
        # process it replaces. Failed ranks are always reported as logical ranks.
        self._logical: list[int] = list(range(self.topology.world_size))
        self.coords: RankCoords = self.topology.coords(self._global.Get_rank())
        self._replica_comm, self._dp_comm = self._split_derived(self._global, active=True)
        # Who is who: (host, pid) of every logical rank, to tell a hung failed rank from a crashed
        # one and to remove it for good (replaced when a re-join spawns a new process there).
        self.processes: list[ProcessInfo] = self._global.allgather(this_process(self.coords.rank))
        self._start_watch(base, on_failure_notice)

    def _setup(
        self,
        tp: int,
        pp: int,
        n_replicas: int,
        on_leave: Callable[[RecoveryResult], None] | None,
        fault_hook: Callable[[str], None] | None,
        park_orphans: bool,
    ) -> None:
        self.topology = Topology(tp=tp, pp=pp, n_replicas=n_replicas)
        self._on_leave = on_leave
        self._fault_hook = fault_hook
        self._park_orphans = park_orphans
        self._epoch = 0
        self._alive_replicas: list[int] = list(range(n_replicas))
        self._alive_ranks: list[int] = list(range(self.topology.world_size))
        self._parked_ranks: list[int] = []
        # Epoch since which each replica has been alive without interruption: the longest-serving
        # replica keeps the logging and checkpoint-writing roles when others re-join.
        self._alive_since: dict[int, int] = {r: 0 for r in range(n_replicas)}
        self._closed = False
        # True while this rank is inside allreduce_/agree/recover: MPI itself will tell it about
        # failures then, so the failure watch leaves it alone.
        self.in_ft_operation = False

    def _start_watch(
        self, base: MPI.Comm, on_failure_notice: Callable[[list[int], float], None] | None
    ) -> None:
        # The process's failure watch: it also carries the heartbeats (see .heartbeat).
        from .watch import ensure_watch

        watch = ensure_watch(base)
        if on_failure_notice is not None:
            watch.subscribe(on_failure_notice)

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
    def rank(self) -> int:
        """This process's logical rank: its place in the grid (never changes)."""
        return self.coords.rank

    @property
    def replica(self) -> int:
        return self.coords.replica

    @property
    def local_rank(self) -> int:
        return self.coords.local_rank

    @property
    def pp_rank(self) -> int:
        return self.coords.pp

    @property
    def tp_rank(self) -> int:
        return self.coords.tp

    @property
    def dp_rank(self) -> int:
        """Rank in the current DP communicator (position of this replica among the alive ones)."""
        return self._dp_comm.Get_rank()

    @property
    def dp_size(self) -> int:
        """Members of the current DP communicator (= number of alive replicas)."""
        return self._dp_comm.Get_size()

    # --------------------------------------------------------------- operations
    def allreduce_(self, buf: Any, epoch: int) -> None:
        """In-place SUM of ``buf`` over the DP communicator of the world ``epoch``.

        Raises :class:`StaleEpoch` (without communicating) if ``epoch`` is not the
        current one. On a process failure or revoke it runs :meth:`recover` and
        raises :class:`WorldChanged`; ``buf`` is then torn (partially reduced) and
        must be restored from the caller's snapshot before it is reduced again.
        """
        self._check_open()
        if epoch != self._epoch:
            raise StaleEpoch(epoch, self._epoch)
        arr = _as_numpy(buf)
        t0 = time.perf_counter()
        self.in_ft_operation = True
        try:
            self._dp_comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)
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
        if not 0 <= stop <= _STOP_BITS:
            raise ValueError(f"stop bits must be in 0..{_STOP_BITS}, got {stop}")
        kind_bits = _KIND_MASK & ~(1 << AGREE_KINDS.index(kind)) if kind != "step" else _KIND_MASK
        value = self._agree_value(
            (_FLAG if flag else 0)
            | _NO_RECOVERY
            | ((_STOP_BITS & ~stop) << _STOP_SHIFT)
            | (kind_bits << _KIND_SHIFT)
        )
        return bool(value & _FLAG), _STOP_BITS & ~(value >> _STOP_SHIFT)

    def follow(self, stop: int = 0) -> tuple[int, str]:
        """A parked rank's side of the next global agree: ``(stop bits, kind)`` of what the active
        ranks agreed (plus ``stop``, a stop this rank requested before it parked); raises
        :class:`WorldChanged` like :meth:`agree`."""
        value = self._agree_value(
            _FLAG | _NO_RECOVERY | ((_STOP_BITS & ~stop) << _STOP_SHIFT) | (_KIND_MASK << _KIND_SHIFT)
        )
        kinds = ~(value >> _KIND_SHIFT) & _KIND_MASK
        kind = next((k for i, k in enumerate(AGREE_KINDS) if kinds & (1 << i)), "step")
        return _STOP_BITS & ~(value >> _STOP_SHIFT), kind

    def _agree_value(self, mine: int) -> int:
        self._check_open()
        t0 = time.perf_counter()
        self.in_ft_operation = True
        try:
            try:
                value = self._global.Agree(mine)
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                value = 0  # failure seen by the agree itself: uniform across survivors
            if not value & _NO_RECOVERY:
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
        self._check_open()
        self.in_ft_operation = True
        try:
            return self._recover("manual", detect_s=0.0, entry_agree=True)
        finally:
            self.in_ft_operation = False

    def barrier(self) -> None:
        """A barrier over the current world's survivors; raises ``MPI.Exception`` on a failure."""
        self._global.Barrier()

    def stop_watch(self) -> None:
        from .watch import stop_watch

        stop_watch()

    def close(self) -> None:
        """Free the owned communicators (end of job). Idempotent."""
        self.stop_watch()
        if self._closed:
            return
        self._closed = True
        for comm in (self._dp_comm, self._replica_comm, self._global):
            _free(comm)

    # ----------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closed:
            raise FTError("FaultTolerantComm is closed")

    def _hook(self, point: str) -> None:
        if self._fault_hook is not None:
            self._fault_hook(point)

    def _split_derived(self, glob: MPI.Comm, active: bool) -> tuple[MPI.Comm | None, MPI.Comm | None]:
        """The replica and DP communicators of ``glob`` (collective over ``glob``); a parked rank
        takes part in the splits but gets neither."""
        c = self.coords
        replica = glob.Split(color=c.replica if active else MPI.UNDEFINED, key=c.local_rank)
        dp = glob.Split(color=c.local_rank if active else MPI.UNDEFINED, key=c.replica)
        if not active:
            return None, None
        replica.Set_errhandler(MPI.ERRORS_RETURN)
        dp.Set_errhandler(MPI.ERRORS_RETURN)
        return replica, dp

    def _shrink(self, comm: MPI.Comm) -> MPI.Comm:
        """``comm.Shrink()``, retried if a failure interrupts it."""
        for _ in range(_MAX_SHRINK_ATTEMPTS):
            try:
                shrunk = comm.Shrink()
            except MPI.Exception as exc:
                if not is_fault(exc):
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
        fail_stop(f"rank {self.rank}: Shrink failed {_MAX_SHRINK_ATTEMPTS} times")

    @staticmethod
    def _logical_members(comm: MPI.Comm, base_group: MPI.Group, base_logical: list[int]) -> list[int]:
        """Logical ranks of ``comm``'s members, through the group of the communicator they came from."""
        group = comm.Get_group()
        try:
            ranks = group.Translate_ranks(list(range(group.Get_size())), base_group)
        finally:
            group.Free()
        return sorted(base_logical[int(r)] for r in ranks)

    def _recover(self, trigger: str, *, detect_s: float, entry_agree: bool) -> RecoveryResult:
        detected_at = time.time()
        t_start = time.perf_counter()
        old_epoch = self._epoch
        prev_replicas = list(self._alive_replicas)
        prev_members = set(self.members)
        # Every group below is translated into the pre-recovery global communicator's group.
        base_group = self._global.Get_group()
        base_logical = list(self._logical)
        self._hook("recover:enter")

        # 1. Revoke everything we own: peers blocked in any of them must wake up.
        for comm in (self._dp_comm, self._replica_comm, self._global):
            _revoke(comm)
        self._hook("recover:revoked")

        # 2. Entry agree: match the step agree of peers that are already there.
        if entry_agree:
            try:
                self._global.Agree(0)
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
        revoke_s = time.perf_counter() - t_start

        # 3. Rounds until one commits.
        cur = self._global
        discarded: list[MPI.Comm] = []  # shrunk communicators of failed rounds
        shrink_s = 0.0
        rounds = 0
        while True:
            rounds += 1
            t_shrink = time.perf_counter()
            shrunk = self._shrink(cur)
            shrink_s += time.perf_counter() - t_shrink
            self._hook("recover:shrunk")

            members = self._logical_members(shrunk, base_group, base_logical)
            complete = set(self.topology.complete_replicas(members))
            alive_replicas = [r for r in prev_replicas if r in complete]
            active = self.coords.replica in alive_replicas
            leaving = not active and not self._park_orphans

            ok = 1
            new_global: MPI.Comm | None = None
            new_replica: MPI.Comm | None = None
            new_dp: MPI.Comm | None = None
            try:
                new_global = shrunk.Split(MPI.UNDEFINED if leaving else 0, key=self.coords.rank)
                if not leaving:
                    new_global.Set_errhandler(MPI.ERRORS_RETURN)
                    new_replica, new_dp = self._split_derived(new_global, active)
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                ok = 0
                _revoke(new_global)  # wake survivors blocked in the derived splits
            self._hook("recover:split")
            # Which failed ranks still run on this host (frozen, not crashed): looked at before the
            # commit agree, so before any survivor kills them.
            seen_running = {r: still_running(self.processes[r]) for r in sorted(prev_members - set(members))}

            try:
                committed = shrunk.Agree(ok) == 1
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                committed = False
            if committed:
                break
            for comm in (new_dp, new_replica, new_global):
                _free(comm)
            discarded.append(shrunk)
            cur = shrunk
        base_group.Free()

        alive_set = set(alive_replicas)
        survivors = [r for r in members if self.topology.replica_of(r) in alive_set]
        parked = (
            [r for r in members if self.topology.replica_of(r) not in alive_set] if self._park_orphans else []
        )
        failed_ranks = sorted(prev_members - set(members))
        hung = [r for r in failed_ranks if seen_running.get(r)]
        unseen = [r for r in failed_ranks if seen_running.get(r, None) is None]
        if not leaving:
            # Remove a failed rank that still runs here for good (see module docstring). Only after
            # the commit: every survivor looked at it before the commit agree, so none of them
            # mistakes a hung rank another survivor just killed for a crashed one.
            for r in hung:
                reap(self.processes[r])
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
        self._hook("recover:committed")

        # 4. Leave, give up, or install the new world.
        if not alive_replicas:
            self._closed = True
            self.stop_watch()
            raise AllReplicasFailed(result)
        if leaving:
            self._closed = True
            self.stop_watch()
            if self._on_leave is not None:
                try:
                    self._on_leave(result)
                except Exception:
                    pass  # logging must not keep a leaver alive
            fail_stop(
                f"rank {self.rank} (replica {self.coords.replica}) leaves: replica failed, "
                f"epoch {old_epoch} -> {old_epoch + 1}"
            )

        assert new_global is not None
        for comm in (self._dp_comm, self._replica_comm, self._global, *discarded, shrunk):
            _free(comm)
        self._global, self._replica_comm, self._dp_comm = new_global, new_replica, new_dp
        # new_global is ordered by logical rank (the split key).
        self._logical = sorted(members) if self._park_orphans else survivors
        self._alive_replicas = alive_replicas
        self._alive_ranks = survivors
        self._parked_ranks = parked
        self._epoch = old_epoch + 1
        return result

    # ------------------------------------------------------------------- re-join
    def _join_stage_agree(
        self, ok: bool, stage: str, error: BaseException | None, could_not_start: bool = False
    ) -> None:
        """One stage of a join, agreed: returns on every member, or raises :class:`JoinFailed` on
        every member. A member's death makes the agree itself fail (uniformly); a stage that failed
        without one (a spawn that cannot start) gives 0 to all."""
        why = f": {error.Get_error_string()}" if isinstance(error, MPI.Exception) else ""
        try:
            agreed = self._global.Agree(1 if ok else 0) & 1
        except MPI.Exception as exc:
            if not is_fault(exc):
                raise
            raise JoinFailed(f"a member failed {stage}{why}") from exc
        if not agreed:
            raise JoinFailed(
                f"{'the spawn could not start' if could_not_start else 'a member failed ' + stage}{why}",
                could_not_start=could_not_start,
            )

    def begin_join(
        self, plan: JoinPlan | None, command: list[str], info: dict[str, str], payload: Any
    ) -> PendingJoin:
        """Steps 1-3 of a re-join on a member (collective over the global communicator).

        The lowest alive rank is the root: its ``plan``, ``command``, ``info`` and ``payload``
        count; a parked rank passes None and learns them from the root. Raises
        :class:`JoinFailed` if the spawn fails (on every member alike). Otherwise returns a
        :class:`PendingJoin`, whose ``ok`` is False if a member failed while it was being built;
        the caller then moves state and calls :meth:`commit_join` in any case."""
        self._check_open()
        t0 = time.perf_counter()
        root = self._logical.index(min(self._alive_ranks))
        is_root = self._global.Get_rank() == root
        self.in_ft_operation = True
        try:
            header = None
            if is_root:
                assert plan is not None
                header = {
                    "plan": plan,
                    "command": command,
                    "info": info,
                    "epoch": self._epoch,
                    "alive_replicas": self._alive_replicas,
                    "parked": self._parked_ranks,
                    "alive_since": self._alive_since,
                    "processes": self.processes,
                    "logical": self._logical,
                    "payload": payload,
                }
            # Spawn and Merge are not uniform (they can fail on some members only): after each
            # stage the members agree on its outcome on the global communicator before going on,
            # so every member leaves the join at the same stage, with the same reason.
            error = None
            try:
                header = self._global.bcast(header, root=root)
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                error = exc
            self._join_stage_agree(error is None, "before the spawn", error)
            plan = header["plan"]
            mpi_info = MPI.Info.Create()
            for key, value in header["info"].items():
                mpi_info.Set(key, value)
            inter = None
            try:
                cmd = header["command"]
                inter = self._global.Spawn(
                    cmd[0], cmd[1:], maxprocs=len(plan.new_ranks), info=mpi_info, root=root
                )
                inter.Set_errhandler(MPI.ERRORS_RETURN)
            except MPI.Exception as exc:
                error = exc
            finally:
                mpi_info.Free()
            try:
                self._join_stage_agree(error is None, "during the spawn", error, could_not_start=True)
            except JoinFailed:
                _revoke(inter)  # spawned processes waiting in their Merge die (fail_stop)
                _free(inter)
                raise
            merged = None
            try:
                merged = inter.Merge(high=False)
                merged.Set_errhandler(MPI.ERRORS_RETURN)
            except MPI.Exception as exc:
                error = exc
            try:
                self._join_stage_agree(error is None, "while merging", error)
            except JoinFailed:
                for comm in (merged, inter):
                    _revoke(comm)
                    _free(comm)
                raise
            _free(inter)
            merged.Set_errhandler(MPI.ERRORS_RETURN)
            try:
                merged.bcast(header if merged.Get_rank() == 0 else None, root=0)  # to the spawned ones
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                _revoke(merged)  # carry on to the commit agree, which then aborts uniformly
            pending = self._build_join(merged, header, self.coords.rank)
            pending.spawn_s = time.perf_counter() - t0
            return pending
        finally:
            self.in_ft_operation = False

    @classmethod
    def join_parent(
        cls,
        tp: int,
        pp: int,
        n_replicas: int,
        *,
        on_leave: Callable[[RecoveryResult], None] | None = None,
        fault_hook: Callable[[str], None] | None = None,
        on_failure_notice: Callable[[list[int], float], None] | None = None,
        park_orphans: bool = True,
    ) -> tuple[FaultTolerantComm, PendingJoin]:
        """The spawned side of a re-join: this process was started by :meth:`begin_join`.

        Returns this rank's (not yet committed) communicator and the pending join; the caller
        receives its state and calls :meth:`commit_join`, which SIGKILLs this process on an abort."""
        parent = MPI.Comm.Get_parent()
        if parent == MPI.COMM_NULL:
            raise FTError("join_parent: this process was not spawned by a running job")
        self = cls.__new__(cls)
        self._setup(tp, pp, n_replicas, on_leave, fault_hook, park_orphans)
        self._start_watch(MPI.COMM_WORLD, on_failure_notice)  # heartbeat progress until the commit
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
        n_parents = len(header["logical"])
        logical = plan.new_ranks[merged.Get_rank() - n_parents]
        self.coords = self.topology.coords(logical)
        self._epoch = header["epoch"]
        self._alive_replicas = list(header["alive_replicas"])
        self._alive_ranks = [r for rep in self._alive_replicas for r in self.topology.ranks_of_replica(rep)]
        self._parked_ranks = list(header["parked"])
        self._alive_since = dict(header["alive_since"])
        self.processes = list(header["processes"])
        self._logical = list(header["logical"])
        self._global = self._replica_comm = self._dp_comm = None
        pending = self._build_join(merged, header, logical)
        return self, pending

    def _build_join(self, merged: MPI.Comm, header: dict, logical: int) -> PendingJoin:
        """Step 3 of a re-join, alike on parents and spawned processes (after the header's bcast)."""
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
        active = self.coords.replica in set(self._alive_replicas) | set(plan.replicas)
        try:
            pending.logical = [int(r) for r in merged.allgather(logical)]
            infos = merged.allgather(this_process(logical))
            pending.processes = [infos[i] for i, r in enumerate(pending.logical) if r in plan.new_ranks]
            pending.replica_comm, pending.dp_comm = self._split_derived(merged, active)
            pending.watch_comm = merged.Dup()
        except MPI.Exception as exc:
            if not is_fault(exc):
                raise
            pending.ok = False
            for comm in (pending.dp_comm, pending.replica_comm, merged):
                _revoke(comm)  # wake members blocked in the join's collectives
        return pending

    def commit_join(self, pending: PendingJoin, ok: bool) -> bool:
        """Step 5: the commit agree of a re-join. True: the new world is installed (epoch + 1).
        False: nothing changed here; a spawned process SIGKILLs itself instead of returning."""
        spawned = self._global is None
        try:
            committed = pending.merged.Agree(1 if (ok and pending.ok) else 0) & 1 == 1
        except MPI.Exception as exc:
            if not is_fault(exc):
                raise
            committed = False
        if not committed:
            pending.free()
            if spawned:
                self._closed = True
                fail_stop(f"spawned rank {self.rank}: the re-join was aborted")
            return False
        plan = pending.plan
        for comm in (self._dp_comm, self._replica_comm, self._global):
            _free(comm)
        self._global, self._replica_comm, self._dp_comm = (
            pending.merged,
            pending.replica_comm,
            pending.dp_comm,
        )
        self._logical = pending.logical
        for info in pending.processes:
            self.processes[info.rank] = info
        self._epoch += 1
        self._alive_replicas = sorted(set(self._alive_replicas) | set(plan.replicas))
        self._alive_ranks = [r for rep in self._alive_replicas for r in self.topology.ranks_of_replica(rep)]
        self._parked_ranks = [r for r in self._parked_ranks if r not in plan.reused_ranks]
        for rep in plan.replicas:
            self._alive_since[rep] = self._epoch
        from .watch import rebase_watch

        rebase_watch(pending.watch_comm, pending.logical)
        return True


__all__ = [
    "FAULT_ERROR_CLASSES",
    "AllReplicasFailed",
    "FTError",
    "FaultTolerantComm",
    "JoinFailed",
    "JoinPlan",
    "PendingJoin",
    "RecoveryResult",
    "StaleEpoch",
    "WorldChanged",
    "is_fault",
]
