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
from typing import Any

import numpy as np

from .failstop import fail_stop
from .processes import ProcessInfo, reap, still_running, this_process
from .topology import RankCoords, Topology
from .world import AllReplicasFailed, FTError, RecoveryResult, StaleEpoch, WorldChanged

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
    ) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        self.topology = Topology(tp=tp, pp=pp, n_replicas=n_replicas)
        if base.Get_size() != self.topology.world_size:
            raise ValueError(
                f"communicator has {base.Get_size()} ranks, expected "
                f"n_replicas*pp*tp = {n_replicas}*{pp}*{tp} = {self.topology.world_size}"
            )
        self._on_leave = on_leave
        self._fault_hook = fault_hook

        self._global: MPI.Comm = base.Dup()
        self._global.Set_errhandler(MPI.ERRORS_RETURN)
        # The group of the launch world: every later group is translated into it, so
        # failed ranks are always reported as initial ranks.
        self._initial_group: MPI.Group = self._global.Get_group()
        self.coords: RankCoords = self.topology.coords(self._global.Get_rank())

        self._replica_comm, self._dp_comm = self._split_derived(self._global)
        self._epoch = 0
        self._alive_replicas: list[int] = list(range(n_replicas))
        self._alive_ranks: list[int] = list(range(self.topology.world_size))
        self._closed = False
        # Who is who: (host, pid) of every rank, to tell a hung failed rank from a crashed one
        # and to remove it for good.
        self.processes: list[ProcessInfo] = self._global.allgather(this_process(self.coords.rank))
        # True while this rank is inside allreduce_/agree/recover: MPI itself will tell it about
        # failures then, so the failure watch leaves it alone.
        self.in_ft_operation = False
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
        """Sorted initial ranks in the current world."""
        return list(self._alive_ranks)

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
        """This process's initial rank in the launch communicator (never changes)."""
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

    def agree(self, flag: bool, stop: int = 0) -> tuple[bool, int]:
        """The commit point of a step: logical AND of ``flag``, and OR of ``stop``, over the survivors.

        ``stop`` is a small bit set (0..255) of stop requests: any bit one rank sets, every
        survivor gets back. Returns ``(flag, stop)`` only if no rank failed and no rank is
        recovering; otherwise runs :meth:`recover` on every survivor and raises
        :class:`WorldChanged` (uniformly: either all survivors return the same value or all raise).
        """
        self._check_open()
        if not 0 <= stop <= _STOP_BITS:
            raise ValueError(f"stop bits must be in 0..{_STOP_BITS}, got {stop}")
        t0 = time.perf_counter()
        self.in_ft_operation = True
        try:
            mine = (_FLAG if flag else 0) | _NO_RECOVERY | ((_STOP_BITS & ~stop) << _STOP_SHIFT)
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
        return bool(value & _FLAG), _STOP_BITS & ~(value >> _STOP_SHIFT)

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

    def _split_derived(self, glob: MPI.Comm) -> tuple[MPI.Comm, MPI.Comm]:
        """The replica and DP communicators of ``glob`` (collective over ``glob``)."""
        replica = glob.Split(color=self.coords.replica, key=self.coords.local_rank)
        replica.Set_errhandler(MPI.ERRORS_RETURN)
        dp = glob.Split(color=self.coords.local_rank, key=self.coords.replica)
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

    def _alive_initial_ranks(self, comm: MPI.Comm) -> list[int]:
        group = comm.Get_group()
        try:
            ranks = group.Translate_ranks(list(range(group.Get_size())), self._initial_group)
        finally:
            group.Free()
        return sorted(int(r) for r in ranks)

    def _recover(self, trigger: str, *, detect_s: float, entry_agree: bool) -> RecoveryResult:
        detected_at = time.time()
        t_start = time.perf_counter()
        old_epoch = self._epoch
        prev_replicas = list(self._alive_replicas)
        prev_ranks = set(self._alive_ranks)
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

            alive_ranks = self._alive_initial_ranks(shrunk)
            complete = set(self.topology.complete_replicas(alive_ranks))
            alive_replicas = [r for r in prev_replicas if r in complete]
            leaving = self.coords.replica not in complete

            ok = 1
            new_global: MPI.Comm | None = None
            new_replica: MPI.Comm | None = None
            new_dp: MPI.Comm | None = None
            try:
                new_global = shrunk.Split(MPI.UNDEFINED if leaving else 0, key=self.coords.rank)
                if not leaving:
                    new_global.Set_errhandler(MPI.ERRORS_RETURN)
                    new_replica, new_dp = self._split_derived(new_global)
            except MPI.Exception as exc:
                if not is_fault(exc):
                    raise
                ok = 0
                _revoke(new_global)  # wake survivors blocked in the derived splits
            self._hook("recover:split")
            # Which failed ranks still run on this host (frozen, not crashed): looked at before the
            # commit agree, so before any survivor kills them.
            seen_running = {
                r: still_running(self.processes[r]) for r in sorted(prev_ranks - set(alive_ranks))
            }

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

        survivors = [r for r in alive_ranks if self.topology.replica_of(r) in set(alive_replicas)]
        failed_ranks = sorted(prev_ranks - set(alive_ranks))
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

        assert new_global is not None and new_replica is not None and new_dp is not None
        for comm in (self._dp_comm, self._replica_comm, self._global, *discarded, shrunk):
            _free(comm)
        self._global, self._replica_comm, self._dp_comm = new_global, new_replica, new_dp
        self._alive_replicas = alive_replicas
        self._alive_ranks = survivors
        self._epoch = old_epoch + 1
        return result


# The name this error had before it moved to .world; kept until every importer uses the new one.

__all__ = [
    "FAULT_ERROR_CLASSES",
    "AllReplicasFailed",
    "FTError",
    "FaultTolerantComm",
    "RecoveryResult",
    "StaleEpoch",
    "WorldChanged",
    "is_fault",
]
