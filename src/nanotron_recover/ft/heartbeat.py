"""Turning on ULFM's heartbeat failure detector from the config.

A crashed process is reported to the others by the runtime within milliseconds (its daemon sees it
exit). A *frozen* one -- a hung GPU, a stuck NCCL call that holds the process, a node that stops
answering, or ``kill -STOP`` -- is not: it still exists, so without a detector the other replicas
wait for it forever. Open MPI's ULFM has a detector for exactly this: the ranks form a ring, each
sends a heartbeat to its observer every ``period`` seconds, and an observer that hears nothing for
``timeout`` seconds declares the rank failed; the failure then reaches every rank like a crash
(measured here, Open MPI 5.0.11: a SIGSTOPped rank was reported to the others 2-2.6 s after the
freeze with period 0.5 s, timeout 2 s).

Heartbeats are sent and checked while MPI makes progress. The detector can run its own thread for
that (``mpi_ft_detector_thread``), but with Open MPI 5.0.11 that thread crashed a rank (SIGSEGV at a
null address, the others then crashing in ``ompi_comm_revoke_local``) in 3 of 20 runs of a plain
4-rank MPI program on this machine, and 0 of 20 without it. So the detector runs without its thread,
and this project's :class:`~.watch.FailureWatch` thread, which polls MPI every 50 ms anyway, makes
the progress: a rank computing for seconds outside MPI keeps heartbeating (without the watch, a rank
computing 8 s was declared failed by its waiting observer; with it, 0 of 3). The watch is started
right after ``MPI_Init``, before the job builds anything (the CLI has imported torch by then). A
rank a busy node still starves past the timeout is repaired like any failure, also during start-up
(``data_parallel/forward/mode.py``, ``agree_startup``).

The detector is configured through MCA parameters, which MPI reads when it is initialized: the
launcher passes them on the ``mpirun`` line, and each rank also sets them as environment defaults
before ``mpi4py.MPI`` is first imported, so a job started by hand gets the config's values too.
Processes spawned by a re-join run with the detector off (``data_parallel/forward/rejoin.py``,
``SPAWNED_DETECTOR_OFF``): their heartbeat files watch them instead.
"""

from __future__ import annotations

import os
import sys


def heartbeat_mca(period_s: float, timeout_s: float) -> dict[str, str]:
    """The MCA parameters (name -> value) that turn the threaded detector on (``%g``: 1.0 -> "1")."""
    return {
        "mpi_ft_detector": "true",
        "mpi_ft_detector_thread": "false",  # see the module docstring: the watch thread drives it
        "mpi_ft_detector_period": f"{float(period_s):g}",
        "mpi_ft_detector_timeout": f"{float(timeout_s):g}",
    }


def configure_heartbeat(period_s: float, timeout_s: float) -> None:
    """Set the detector's parameters as defaults for this process (a launcher's choice wins).

    Must run before MPI is initialized: raises RuntimeError if ``mpi4py.MPI`` is already imported,
    since the values would then silently not apply.
    """
    if "mpi4py.MPI" in sys.modules:
        raise RuntimeError("configure_heartbeat must run before mpi4py.MPI is imported")
    for name, value in heartbeat_mca(period_s, timeout_s).items():
        os.environ.setdefault(f"OMPI_MCA_{name}", value)


def start_mpi(period_s: float, timeout_s: float) -> None:
    """Configure the detector, initialize MPI and start the failure watch (which carries the
    heartbeats) now, before the job builds its model, data and worlds: a rank that spends seconds
    without MPI progress would be declared failed by its observer."""
    configure_heartbeat(period_s, timeout_s)
    # ulfm first: its MCA defaults (finalize, connections set up at start) and mpi4py's settings
    # take effect only if they are in place before MPI starts.
    from . import comm  # noqa: F401
    from .ulfm import MPI
    from .watch import ensure_watch

    ensure_watch(MPI.COMM_WORLD)
