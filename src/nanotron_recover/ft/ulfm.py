"""``mpi4py.MPI`` with the project's settings, and the few ULFM helpers every part of the communicator uses.

The fault-tolerant communicator is split by job (:mod:`.comm`: collectives and failure handling;
:mod:`.membership`: who is in the job and the shrink-and-resplit recovery round; :mod:`.join`: the
re-join protocol); all of them import MPI from here, so MPI is initialized with the settings below
whichever of them is imported first.

Importing this module defaults ``OMPI_MCA_async_mpi_finalize=1`` (see below): without it the
survivors' ``MPI_Finalize`` can hang on a dead rank at exit.
"""

from __future__ import annotations

import os

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


def is_fault(exc: BaseException) -> bool:
    """True if ``exc`` is an MPI error caused by a process failure or a revoke."""
    return isinstance(exc, MPI.Exception) and exc.Get_error_class() in FAULT_ERROR_CLASSES


def revoke_comm(comm: MPI.Comm | None) -> None:
    """Revoke ``comm`` (None and ``COMM_NULL`` are skipped), ignoring errors."""
    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        comm.Revoke()
    except MPI.Exception:
        pass  # already revoked, or its peers are gone: the revoke is best effort by design


def free_comm(comm: MPI.Comm | None) -> None:
    """Free ``comm`` (None and ``COMM_NULL`` are skipped), ignoring errors."""
    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        comm.Free()
    except MPI.Exception:
        pass  # a communicator with dead members may refuse; leaking one handle is harmless


__all__ = ["FAULT_ERROR_CLASSES", "MPI", "free_comm", "is_fault", "revoke_comm"]
