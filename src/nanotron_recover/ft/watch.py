"""FailureWatch: learn of a failure anywhere in the job while this rank is busy outside MPI.

A rank computing, or waiting in its replica's torch world (a TP all-reduce, a pipeline receive, the
replica gate), makes no MPI call, so MPI cannot tell it that a process failed. That matters when the
failed process is a member of *its own replica*: a frozen TP peer keeps it waiting in gloo or NCCL
until that library's timeout, while every other replica waits in the recovery's ``Shrink`` for it.

The watch is a daemon thread holding one receive from ``MPI.ANY_SOURCE`` on a private duplicate of
the launch communicator, which nobody ever sends to. ULFM completes such a receive with
``MPI_ERR_PROC_FAILED_PENDING`` as soon as this process learns that any member of the communicator
failed (from the runtime for a crash, from the heartbeat detector for a freeze). The thread then
reads the failed group (``MPI_Comm_get_failed``), acknowledges it so the next receive waits for
*new* failures only, reports the newly failed initial ranks to a callback, and posts a new
receive. It polls with ``Test`` every ``poll_s`` (MPI is initialized with ``MPI_THREAD_MULTIPLE``).

It skips its poll while the main thread is inside an agreement (:func:`.ulfm.agreement`: another
thread's progress then can corrupt the agreement's value in Open MPI 5.0.x). The main thread's own
progress inside the agreement still runs the detector and marks failed processes, so the watch
then reads the failed group without progress (``MPI_Comm_get_failed`` is local: in 5.0.x,
``ompi_comm_get_failed_internal`` in ``ompi/communicator/ft/comm_ft.c`` intersects the group with
the failed processes under their lock, and makes no progress) and tells the callbacks that only *name* failures (:meth:`FailureWatch.subscribe_during_agreement`):
a rank frozen while its peers wait in an agreement (a step's or a recovery's) is named for the
supervisor within the heartbeat timeout, not after the agreement ends. Nothing is acknowledged
then; the failure reaches the other callbacks at the next poll outside the agreement.
The thread's polling is also what carries ULFM's heartbeats while the main thread computes (the
detector runs without a thread of its own, see :mod:`.heartbeat`), so there is one watch per
process (:func:`ensure_watch`), started right after ``MPI_Init``; callbacks subscribe to it.

After a re-join the job's global communicator contains processes that are not in the launch
communicator: :func:`rebase_watch` moves the watch onto a duplicate of the new global communicator,
whose ranks it reports as logical ranks (the grid positions, see ``ft/comm.py``).

The callback decides what to do; the transaction's rule is: if a member of my replica failed and
I am not inside a fault-tolerant MPI operation (which would learn it itself), my replica is lost,
so leave now instead of waiting for a library timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .ulfm import MPI, helper_done, helper_may_progress

_TAG = 0x7A7C  # never sent by anyone


class FailureWatch:
    def __init__(self, base: MPI.Comm, poll_s: float = 0.05) -> None:
        self._subscribers: list[Callable[[list[int], float], None]] = []
        self._namers: list[Callable[[list[int], float], None]] = []
        self._poll_s = poll_s
        self._start(base.Dup(), list(range(base.Get_size())))

    def _start(self, comm: MPI.Comm, logical: list[int]) -> None:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
        self._comm = comm
        # A new communicator starts with no failures. Each thread keeps its own sets: one stopped
        # by a rebase may still be inside a callback, and must not write into the new thread's.
        self._known: set[int] = set()
        named: set[int] = set()  # told to the namers during agreements, not yet acknowledged
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(comm, comm.Get_group(), logical, self._stop, self._known, named),
            name="ft-failure-watch",
            daemon=True,
        )
        self._thread.start()

    def rebase(self, comm: MPI.Comm, logical: list[int]) -> None:
        """Watch ``comm`` (a private duplicate, owned from now on) whose rank ``i`` is logical rank
        ``logical[i]``. The receive pending on the old duplicate is left behind (never matched)."""
        self.stop()
        self._start(comm, logical)

    def known_failed(self) -> set[int]:
        """Logical ranks this process has learned failed so far."""
        return set(self._known)

    def subscribe(self, on_failure: Callable[[list[int], float], None]) -> None:
        """Call ``on_failure(newly failed initial ranks, wall time)`` for every failure seen from now on."""
        self._subscribers.append(on_failure)

    def subscribe_during_agreement(self, name_failures: Callable[[list[int], float], None]) -> None:
        """Also call ``name_failures(newly failed logical ranks, wall time)`` for failures read while
        the main thread is inside an agreement, when the watch makes no progress. The callback must
        only take note (write a name, set a flag): the main thread is inside MPI meanwhile."""
        self._namers.append(name_failures)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)

    @staticmethod
    def _failed_now(comm: MPI.Comm, group: MPI.Group, logical: list[int]) -> set[int]:
        failed = comm.Get_failed()
        try:
            ranks = failed.Translate_ranks(list(range(failed.Get_size())), group)
        finally:
            failed.Free()
        return {logical[int(r)] for r in ranks if r != MPI.UNDEFINED}

    def _run(
        self,
        comm: MPI.Comm,
        group: MPI.Group,
        logical: list[int],
        stop: threading.Event,
        known: set[int],
        named: set[int],
    ) -> None:
        buf = bytearray(1)
        request = comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=_TAG)
        while not stop.is_set():
            if not helper_may_progress():
                # The main thread is inside an agreement (ulfm.agreement): read, do not progress.
                self._notice_without_progress(comm, group, logical, known, named)
                stop.wait(self._poll_s)
                continue
            try:
                try:
                    request.Test()
                finally:
                    helper_done()
            except MPI.Exception:
                noticed = time.time()
                try:
                    failed = self._failed_now(comm, group, logical)
                    comm.Ack_failed()
                except MPI.Exception:
                    failed = set()
                new = sorted(failed - known)
                known |= failed
                if new and not stop.is_set():
                    _tell(self._subscribers, new, noticed)
                try:
                    request = comm.Irecv(buf, source=MPI.ANY_SOURCE, tag=_TAG)
                except MPI.Exception:
                    return
                continue
            stop.wait(self._poll_s)

    def _notice_without_progress(
        self, comm: MPI.Comm, group: MPI.Group, logical: list[int], known: set[int], named: set[int]
    ) -> None:
        if not self._namers:
            return
        try:
            failed = self._failed_now(comm, group, logical)
        except MPI.Exception:
            return
        new = sorted(failed - known - named)
        if not new:
            return
        named |= set(new)
        _tell(self._namers, new, time.time())


def _tell(callbacks: list[Callable[[list[int], float], None]], ranks: list[int], noticed: float) -> None:
    for callback in list(callbacks):
        try:
            callback(ranks, noticed)
        except Exception:
            pass  # a failing callback must not stop the watch


_watch: FailureWatch | None = None


def ensure_watch(
    base: MPI.Comm, on_failure: Callable[[list[int], float], None] | None = None
) -> FailureWatch:
    """This process's watch over ``base`` (the launch communicator), started on first use;
    ``on_failure`` (if given) subscribes to it (:meth:`FailureWatch.subscribe`)."""
    global _watch
    if _watch is None:
        _watch = FailureWatch(base)
    if on_failure is not None:
        _watch.subscribe(on_failure)
    return _watch


def rebase_watch(comm: MPI.Comm, logical: list[int]) -> None:
    """Move this process's watch onto ``comm`` (see :meth:`FailureWatch.rebase`)."""
    if _watch is not None:
        _watch.rebase(comm, logical)


def current_watch() -> FailureWatch | None:
    return _watch


def stop_watch() -> None:
    """Stop the watch (at the very end: heartbeats then stop too)."""
    global _watch
    if _watch is not None:
        _watch.stop()
        _watch = None
