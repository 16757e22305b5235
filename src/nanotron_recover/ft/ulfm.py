"""``mpi4py.MPI`` with the project's settings, and the few ULFM helpers every part of the communicator uses.

The fault-tolerant communicator is split by job (:mod:`.comm`: collectives and failure handling;
:mod:`.membership`: who is in the job and the shrink-and-resplit recovery round; :mod:`.join`: the
re-join protocol); all of them import MPI from here, so MPI is initialized with the settings below
whichever of them is imported first.

Importing this module defaults ``OMPI_MCA_async_mpi_finalize=1`` (see below): without it the
survivors' ``MPI_Finalize`` can hang on a dead rank at exit; and ``OMPI_MCA_mpi_add_procs_cutoff``
to the largest value, so every endpoint exists before a failure (a revoke forwarded to a dead rank
never reached before hung in a ``PMIx_Get``); and ``OMPI_MCA_btl_tcp_eager_limit`` to
:mod:`.transport`'s limit (a rendezvous torn by a fault can deadlock the TCP transport). All apply only if this module is imported before ``mpi4py.MPI``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from .transport import eager_limit_env

# Skip the PMIx fence in MPI_Finalize. Seen here with Open MPI 5.0.11 + ULFM: after a
# rank was SIGKILLed, the survivors' MPI_Finalize waited on the dead rank in that fence
# in 20-40% of runs, forever (usleep loop in ompi_mpi_finalize); with the fence off,
# 0 hangs in 50 runs. The fence only guards messages still buffered at exit, and every
# exchange here ends in a completed collective. Must be set before MPI is initialized
# (i.e. before mpi4py.MPI is first imported); setdefault keeps a launcher's choice.
os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")

# Create the endpoints of every process of the launch in MPI_Init, while all of them are alive,
# instead of at the first message to each (Open MPI 5's default: mpi_add_procs_cutoff 0). ULFM
# forwards a revoke to peers this rank may never have talked to (ompi_comm_rbcast_send_msg in
# ompi/communicator/ft/comm_ft_reliable_bcast.c); the first message to a peer creates its
# endpoint (mca_bml_base_get_endpoint -> bml_add_proc -> mca_btl_tcp_proc_create), which reads the
# peer's address with a blocking PMIx_Get from inside the progress engine. Seen on the emulated
# cluster (3 ranks on 3 nodes, one SIGKILLed, the others revoke and shrink): the survivor
# forwarding the revoke to the dead rank waited in that PMIx_Get forever (gdb), inside the
# Allreduce it had not left, so it never saw the failure, and the other waited for it in Shrink;
# 3 of 12 runs hung, 0 of 15 with every endpoint made at start-up. The cost is one endpoint per
# process of the launch, made in MPI_Init (TCP connections still open at first use).
os.environ.setdefault("OMPI_MCA_mpi_add_procs_cutoff", "4294967295")

# Every large message goes eager over TCP, none by rendezvous: see transport.py.
os.environ.setdefault(*eager_limit_env())

# Before libmpi is loaded: the fix for a failure reported while a communicator is created
# (rank_fixes.py), when the launch names it.
from .rank_fixes import load as _load_rank_fixes  # noqa: E402

_load_rank_fixes()

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

# Open MPI 5.0.x's libnbc (ompi/mca/coll/libnbc/nbc.c, NBC_Start_round) returns OMPI_ERROR, which
# the caller sees as MPI_ERR_OTHER, when the progress it runs as a new round starts finds a request
# torn by a process failure or a revoke; fixed upstream by open-mpi/ompi#14353 (on main since
# August 2026, not in v5.0.x). Calls that run on libnbc can therefore fail with ERR_OTHER for a fault:
# the non-blocking collectives, and every communicator creation but an intracommunicator's Shrink,
# whose context-id allocation (ompi/communicator/comm_cid.c) is an MPI_Iallreduce on the parent
# (Dup, Split, Create), an Ireduce/Ibcast in each group (Intercomm_merge) or around a PMIx exchange
# (Spawn). Measured with 4 ranks, one revoking a communicator while the others loop over Dup or
# Split from it: 5 of 160 and 13 of 320 of the errors were ERR_OTHER, the others ERR_REVOKED
# (tests/integration/ft/test_creation_faults.py). Blocking collectives, point-to-point calls,
# Agree and an intracommunicator's Shrink (coll/ftagree, coll/tuned, the PML) report the fault
# classes. So ERR_OTHER counts as a fault only from libnbc calls (``is_fault(exc, libnbc=True)``):
# a recovery without a failure costs one more round, while ERR_OTHER elsewhere stays an error.
LIBNBC_FAULT_ERROR_CLASSES: frozenset[int] = FAULT_ERROR_CLASSES | {MPI.ERR_OTHER}


def is_fault(exc: BaseException, *, libnbc: bool = False) -> bool:
    """True if ``exc`` is an MPI error caused by a process failure or a revoke.

    ``libnbc``: ``exc`` comes from a call that runs on Open MPI's libnbc (a communicator creation
    other than ``Shrink``, or a non-blocking collective), where ``MPI_ERR_OTHER`` is a fault too
    (see ``LIBNBC_FAULT_ERROR_CLASSES``)."""
    classes = LIBNBC_FAULT_ERROR_CLASSES if libnbc else FAULT_ERROR_CLASSES
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in classes


def reset_cid_gate() -> None:
    """Reopen Open MPI's context-id allocator after a communicator creation failed.

    Open MPI 5.0.11 lets one communicator creation at a time allocate a context id: the one whose
    parent has the lowest id, kept in the process-wide ``ompi_comm_cid_lowest_id``
    (ompi/communicator/comm_cid.c; a creation from a parent with a higher id waits, rescheduling
    itself). A creation that fails in the middle of the allocation, in the error branches of
    ``ompi_comm_checkcid`` and ``ompi_comm_nextcid_check_flag`` (the allreduce of a round failed,
    e.g. on a process failure or a revoke), returns without setting it back to ``INT64_MAX``
    (v5.0.x, and main as of 2026-08; the branch of ``ompi_comm_allreduce_getnextcid`` does reset
    it). From then on every creation from a parent with a higher context id (Split, Dup, Create,
    Intercomm_merge, Spawn, Shrink) spins in ``ompi_comm_nextcid`` forever, and no revoke ends
    it: tests/integration/ft/test_creation_faults.py hangs in ``Shrink`` without this call.

    A creation that completes sets the gate back, and one from ``MPI_COMM_SELF`` (context id 1,
    below every communicator a job creates) always passes it: a local ``Dup`` and ``Free`` of
    ``MPI_COMM_SELF`` reopens the allocator (tens of microseconds). Call it in the handler of every
    failed communicator creation (:func:`creation_failed`), before any other creation. It cannot
    help after a creation from ``MPI_COMM_WORLD`` (context id 0) failed: then it would wait too.
    """
    try:
        MPI.COMM_SELF.Dup().Free()
    except MPI.Exception:
        pass  # MPI_COMM_SELF has no peer that can fail; nothing more to do if it refused


def creation_failed(exc: BaseException, *, libnbc: bool = True) -> bool:
    """The handler of a communicator creation that raised ``exc``: reopens the context-id allocator
    (:func:`reset_cid_gate`) and tells whether ``exc`` is a fault (:func:`is_fault`; ``libnbc``
    False for an intracommunicator's ``Shrink``, which does not run on libnbc)."""
    reset_cid_gate()
    return is_fault(exc, libnbc=libnbc)


# Held by the main thread while it is inside one of Open MPI's agreements (``Agree``, ``Shrink``);
# a helper thread that makes MPI progress (the failure watch, ``watch.py``) skips its poll while
# it is held. See :func:`agreement`.
_AGREEMENT = threading.Lock()


@contextmanager
def agreement() -> Iterator[None]:
    """The main thread's side: run an agreement (``Agree``, or ``Shrink``, whose context id is
    agreed through the same mechanism) with no other thread making MPI progress meanwhile.

    Open MPI 5.0.x's ERA agreement (ompi/mca/coll/ftagree/coll_ftagree_earlyreturning.c) can hand
    a rank a value that is not the agreement's when another thread of the process makes progress
    while it is inside one: the decision can reach this rank, and the next agreement's messages
    from faster peers garbage-collect the decided value, before this rank's request is attached to
    it (``mca_coll_ftagree_iera_intra``: the value is looked up again at completion, and the failed
    lookup's result, unchecked outside debug builds, is copied out). Measured on 3 ranks with two busy
    processes beside them and the failure watch polling every 0.1 ms: without its side of this
    lock, 9-20 of 20,000 agreements per rank returned wrong values, pointer-like ones such as
    ``-0x10e2b2e8`` and uniform ones such as ``0x928``; with it, 0 of 20,000
    (``benchmarks/agreement_race.py``, ``tests/integration/ft/test_ulfm.py``).
    The same values ended jobs in the chaos campaigns (a step agreement of one rank returned
    ``-0x47505fa8`` while the others still reduced; the recovery that followed built communicators
    with clashing context ids). The main thread makes progress itself while it waits in an
    agreement, so heartbeats and failure notices go on."""
    with _AGREEMENT:
        yield


def helper_may_progress() -> bool:
    """A helper thread's side: True if it may make MPI progress now (then it must call
    :func:`helper_done` after); False while the main thread is inside an agreement."""
    return _AGREEMENT.acquire(blocking=False)


def helper_done() -> None:
    _AGREEMENT.release()


# mpirun's exit status when a rank ended the job over a corrupted agreement (:func:`agree`).
ABORT_CORRUPT_AGREEMENT = 86


def agree(comm: MPI.Comm, value: int, what: str) -> int:
    """``comm.Agree(value)``, checked: an agreement returns the bitwise AND of what its participants
    contributed, so a result with a bit this rank did not set was contributed by no one. (A wrong
    value made only of bits every rank set passes: all ranks then got it, and recover together.)

    The agreement runs under :func:`agreement`, which keeps the race behind such values away. The
    check stays as the last line: seen in the chaos campaigns before that fix, a step's agreement
    returned values such as ``0x37838ad8`` and ``-0x47505fa8`` on one rank while the others were
    still in the step's reduction; the recovery that followed built communicators whose context
    ids differ between ranks (a ``Shrink`` that made context id 1 on one rank), and the job stalled
    at the commit deadline (45 s) or ob1 aborted a rank on a message from a rank outside its
    communicator. A world whose agreements disagree cannot repair itself, so the rank that sees one
    ends the job at once (``MPI_Abort`` on ``comm``: the runtime ends every process of it), and the
    supervisor relaunches it from node memory in seconds.
    The other exceptions of ``Agree`` (a failure, a revoke) are the caller's."""
    with agreement():
        result = comm.Agree(value)
    if result & ~value:
        print(
            f"[nanotron-recover] pid {os.getpid()}: the {what} agreement returned {result:#x}, which no "
            f"rank can have contributed (this rank's {value:#x}): Open MPI's agreements are mixed up; "
            "ending the job for a relaunch from node memory",
            file=sys.stderr,
            flush=True,
        )
        comm.Abort(ABORT_CORRUPT_AGREEMENT)
    return result


def all_ok(comm: MPI.Comm, ok: bool, what: str) -> bool:
    """Whether every member of ``comm`` contributed ``ok`` True and none failed: one agreement,
    which raises a fault on every member when a process of ``comm`` failed (no failure on it was
    acknowledged), so the answer is the same everywhere. Other exceptions are the caller's."""
    try:
        return agree(comm, int(ok), what) == 1
    except MPI.Exception as exc:
        if not is_fault(exc):
            raise
        return False


def revoke_comm(comm: MPI.Comm | None) -> None:
    """Revoke ``comm`` (None and ``COMM_NULL`` are skipped), ignoring errors."""
    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        comm.Revoke()
    except MPI.Exception:
        pass  # already revoked, or its peers are gone: the revoke is best effort by design


# Every communicator this process ever retired (see :func:`retire_comm`): held, never freed.
_RETIRED: list[MPI.Comm] = []


def retire_comm(comm: MPI.Comm | None) -> None:
    """Stop using ``comm`` without freeing it (None and ``COMM_NULL`` are skipped).

    Freeing a communicator gives its context id back, and the next creation may take it with the
    same ULFM epoch: Open MPI 5.0.x (ompi/communicator/comm_cid.c, ``ompi_comm_nextcid_check_flag``)
    sets a new communicator's ``c_epoch`` to one more than the most communicators any member has
    created, which repeats when the member that had created the most is gone and a process spawned
    since has created fewer. The ERA agreement (ompi/mca/coll/ftagree/coll_ftagree_earlyreturning.c)
    names each ``Agree`` by (context id, epoch, sequence number) and keeps decided agreements in a
    process-wide history that freeing the communicator does not clear; a new communicator that
    takes the same context id and epoch starts its sequence at 1 again and meets the old decisions
    ("removing old agreement ... from history, due to cycling of identifiers"). Seen in a one-host
    chaos campaign (4 replicas: kill, re-join, freeze, re-join, kill, re-join): the 34th step agree
    on the world made by the last re-join met a decision of the world before it, which the kill
    had torn, and in 2 of 4 runs the job stopped there, one survivor in the recovery and the
    others in the agree (``test_creation_faults.py`` in tests/integration/ft reproduces the
    collision with 4 processes). No upstream report or fix as of Open MPI 5.0.11 and main
    (2026-12).

    Holding every retired communicator keeps its context id taken in this process, so a later
    communicator with a member that agreed on it gets another id. The cost is a few hundred bytes
    per communicator, a handful per fault."""
    if comm is None or comm == MPI.COMM_NULL:
        return
    _RETIRED.append(comm)


__all__ = [
    "ABORT_CORRUPT_AGREEMENT",
    "FAULT_ERROR_CLASSES",
    "LIBNBC_FAULT_ERROR_CLASSES",
    "MPI",
    "agree",
    "agreement",
    "all_ok",
    "helper_done",
    "helper_may_progress",
    "creation_failed",
    "retire_comm",
    "is_fault",
    "reset_cid_gate",
    "revoke_comm",
]
