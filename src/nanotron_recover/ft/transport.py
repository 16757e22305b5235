"""Every large message goes eager over TCP: the limit every process of a job shares, and the cut.

Open MPI 5.0.11's TCP transport can deadlock a survivor on itself when a peer is killed in the
middle of a collective. The survivor's progress reads the end of the dead peer's socket
(``mca_btl_tcp_frag_recv`` in opal/mca/btl/tcp/btl_tcp_frag.c) while holding that endpoint's send
lock, and closes the endpoint, which reports the process failed. That revokes the collectives of
every communicator with the peer (``ompi_comm_set_rank_failed`` in
ompi/communicator/ft/comm_ft.c), and the revoke answers each unmatched rendezvous header of those
collectives with a negative acknowledgement (``mca_pml_ob1_revoke_comm`` in
ompi/mca/pml/ob1/pml_ob1_recvfrag.c). If the dead peer had sent such a header, the answer goes out
on the dead peer's endpoint, whose send lock the same thread holds: it waits forever in
``pthread_mutex_lock``, inside the collective, and never reports the failure. The locks are real
because the ranks run ``MPI_THREAD_MULTIPLE`` (the failure watch, :mod:`.watch`). The code is the
same on Open MPI main (read 2026-12); no upstream report was found.

Seen here (``benchmarks/results/tcp_eager.md``): 3 ranks on one host over TCP, one frozen and
another SIGKILLed during an Allreduce of 8 MB: the third hung in 6 of 6 runs, each with the stack
above in ``py-spy dump --native``, and in 0 of 6 with this workaround. On the emulated cluster,
every kill during a recovery whose survivor was rank 0 ended as a relaunch 25-27 s later
(``chaos_kill_during_recovery_before.md``); with the workaround all were repaired in place in
7.8-8.2 s (``chaos_kill_during_recovery.md``).

The workaround: no message of ours goes by rendezvous. An unmatched *eager* message needs no
answer, so a revoke drops it. The TCP eager limit is raised to :data:`TCP_EAGER_LIMIT_BYTES`
(Open MPI's default is 64 KiB) and the calls that move large buffers (the gradient reduction in
``comm.py``, the state transfer of a re-join) cut them with :func:`eager_slices`; every other
message of the project is small. Every process of a job must use the same limit, since a receiver
sizes its buffers by its own (:func:`eager_limit`): the launcher passes it on the ``mpirun`` line and
each process sets it as an environment default before MPI starts (``ulfm.py``), spawned processes
included; a value already in the environment wins everywhere.

This module does not import MPI, so the launcher can use it.
"""

from __future__ import annotations

import os

# 4 MiB: a 25 MB gradient bucket is 7 calls, and a receiver's eager buffers are this size.
TCP_EAGER_LIMIT_BYTES = 4 << 20

# Room for the TCP transport's and the PML's headers inside an eager fragment.
_HEADER_ROOM = 1024

_ENV = "OMPI_MCA_btl_tcp_eager_limit"


def eager_limit() -> int:
    """The TCP eager limit of this process's job: a value already in the environment (a user's, or
    the launcher's, which ranks and spawned processes inherit) wins over ours, so that every process
    of the job has the same one. Open MPI's TCP transport reads an incoming eager message into a
    buffer of the *receiver's* limit without checking its size (``mca_btl_tcp_frag_recv``): with
    4 MiB on the sender and the default on the receiver, a 3 MB message ended the receiver
    ("readv error ... Bad address", then an abort), and a smaller overrun could as well overwrite
    memory."""
    try:
        return int(os.environ.get(_ENV, TCP_EAGER_LIMIT_BYTES))
    except ValueError:
        return TCP_EAGER_LIMIT_BYTES


def eager_limit_env() -> tuple[str, str]:
    """The environment variable (name, value) that sets this job's TCP eager limit in a process."""
    return _ENV, str(eager_limit())


def eager_limit_mca() -> list[str]:
    """The ``mpirun`` flags that give every rank this job's TCP eager limit."""
    return ["--mca", "btl_tcp_eager_limit", str(eager_limit())]


def eager_bytes() -> int:
    """The most payload one message of this process may carry and still go eager over TCP."""
    return max(eager_limit() - _HEADER_ROOM, 64)


def eager_slices(n_elements: int, itemsize: int) -> list[slice]:
    """Consecutive slices of an ``n_elements`` buffer of ``itemsize``-byte elements, each at most
    :func:`eager_bytes` long, so that a call over each slice sends eager messages only. An empty
    buffer has one empty slice: its collective still runs, as every member must take part."""
    step = max(eager_bytes() // itemsize, 1)
    return [slice(lo, min(lo + step, n_elements)) for lo in range(0, max(n_elements, 1), step)]
