"""Telling this process's MPI library that a process of its host died, when the runtime does not.

Open MPI's runtime reports a process's death to the job as a PMIx event, which ULFM turns into a
failed process (``ompi_errhandler_proc_failed_internal``, ``ompi/errhandler/errhandler.c``):
operations waiting on it end with ``MPI_ERR_PROC_FAILED`` and agreements go on without it. In Open
MPI 5.0.11 (PRRTE 3.0) that report stops once no process of the launch is left (mpirun's own job;
the processes a re-join spawned are jobs of their own). Measured with plain mpi4py on one host, one
launch process spawning two processes, the three merged:

- the launch process and one spawned process killed together (4 of 4 runs), 0.3 s apart in
  either order (3 of 3 each), or the spawned one after a first round that had shrunk the launch
  process away (2 of 2): the last process waited in ``MPIX_Comm_agree`` for good, told of the
  launch process's death and never of the other's;
- with a launch process still alive (two launched, one of them and one spawned process killed): every
  death reported to every survivor, 3 of 3.

Between hosts a dead peer's TCP connection breaks and the transport reports the death itself. On
one host the processes talk through shared memory (the sm BTL), where a dead peer breaks nothing.
Found by a chaos campaign on one host: dp=3, replicas 1 and 2 killed and re-joined (one spawn),
then the launch rank 0 and the spawned rank 1 killed together; rank 2 waited in the recovery's
entry agree until the supervisor relaunched the stalled job, 26 s after the fault (2 of 2 runs).

What a rank does about it: a daemon thread looks, every heartbeat period, at the grid's processes
on its own host. One that no longer runs (its pid gone, a zombie, or another process under its pid)
is announced once to this process's own MPI library with the event the runtime would have sent:
``PMIX_ERR_PROC_TERM_WO_SYNC``, the dead process as the affected one, in the range
``PMIX_RANGE_PROC_LOCAL``, which PMIx delivers to this process's own handlers only. ULFM takes it
like the runtime's (a process it was told about already is ignored), and every node-mate does the
same for itself. A process on another host is not judged from here: its death breaks a TCP
connection, and its freeze is the heartbeat detectors' (``liveness.py``, ``frozen_processes.py``).

PMIx is the library Open MPI loaded (found in ``/proc/self/maps``), called through ctypes. PMIx
builds its structures itself (``PMIx_Proc_create``/``_load``, ``PMIx_Info_create``/``_load``), so no
layout of its types is written here, and the three constants used are checked against the
library's own names for them first; where they differ, or without PMIx, nothing is announced.
"""

from __future__ import annotations

import ctypes
import os
import socket
import sys
import threading
from collections.abc import Callable

from .processes import ProcessInfo, still_running

# PMIx 5 (the ABI Open MPI 5.0 bundles), each checked against the library's name for it.
PMIX_ERR_PROC_TERM_WO_SYNC = -200
PMIX_PROC = 22  # pmix_data_type_t of a pmix_proc_t
PMIX_RANGE_PROC_LOCAL = 7
PMIX_EVENT_AFFECTED_PROC = b"pmix.evaffected.proc"
_NAMES = {
    "PMIx_Error_string": (PMIX_ERR_PROC_TERM_WO_SYNC, "PMIX_ERR_PROC_TERM_WO_SYNC"),
    "PMIx_Data_type_string": (PMIX_PROC, "PMIX_PROC"),
    "PMIx_Data_range_string": (PMIX_RANGE_PROC_LOCAL, "AVAIL ON LOCAL PROC ONLY"),
}
PMIX_SUCCESS = 0
PMIX_OPERATION_SUCCEEDED = -157


def loaded_pmix() -> str | None:
    """The path of the PMIx library mapped into this process (Open MPI's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if "/libpmix.so" in path:
                    return path
    except OSError:
        pass
    return None


class PmixEvents:
    """This process's PMIx client, for one thing: telling its own handlers that a process died."""

    def __init__(self, path: str | None = None) -> None:
        self.why_not: str | None = None
        self._lib: ctypes.CDLL | None = None
        # What was handed to PMIx stays allocated for the life of the process: a few hundred bytes
        # per dead process, and no question of when PMIx is done with it.
        self._keep: list[tuple[int, int]] = []
        path = path or loaded_pmix()
        if path is None:
            self.why_not = "no PMIx library in this process"
            return
        try:
            lib = ctypes.CDLL(path)
            for name, argtypes in (("PMIx_Error_string", [ctypes.c_int]),
                                   ("PMIx_Data_type_string", [ctypes.c_uint16]),
                                   ("PMIx_Data_range_string", [ctypes.c_uint8])):  # fmt: skip
                getattr(lib, name).restype = ctypes.c_char_p
                getattr(lib, name).argtypes = argtypes
            for name, (value, want) in _NAMES.items():
                got = (getattr(lib, name)(value) or b"").decode(errors="replace")
                if got != want:
                    self.why_not = f"{path}: {name}({value}) is {got!r}, not {want!r}"
                    return
            lib.PMIx_Proc_create.restype = ctypes.c_void_p
            lib.PMIx_Proc_create.argtypes = [ctypes.c_size_t]
            lib.PMIx_Proc_load.restype = None
            lib.PMIx_Proc_load.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32]
            lib.PMIx_Info_create.restype = ctypes.c_void_p
            lib.PMIx_Info_create.argtypes = [ctypes.c_size_t]
            lib.PMIx_Info_load.restype = ctypes.c_int
            lib.PMIx_Info_load.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_uint16]
            lib.PMIx_Notify_event.restype = ctypes.c_int
            lib.PMIx_Notify_event.argtypes = [
                ctypes.c_int, ctypes.c_void_p, ctypes.c_uint8, ctypes.c_void_p, ctypes.c_size_t,
                ctypes.c_void_p, ctypes.c_void_p,
            ]  # fmt: skip
        except (OSError, AttributeError) as error:
            self.why_not = f"{path}: {error}"
            return
        self._lib = lib

    @property
    def available(self) -> bool:
        return self._lib is not None

    def announce_death(self, nspace: str, rank: int) -> bool:
        """Deliver to this process's own event handlers that ``nspace:rank`` died; whether PMIx
        took the event."""
        lib = self._lib
        if lib is None:
            return False
        proc = lib.PMIx_Proc_create(1)
        info = lib.PMIx_Info_create(1)
        if not proc or not info:
            return False
        self._keep.append((proc, info))
        lib.PMIx_Proc_load(proc, nspace.encode(), rank)
        if lib.PMIx_Info_load(info, PMIX_EVENT_AFFECTED_PROC, proc, PMIX_PROC) != PMIX_SUCCESS:
            return False
        # The dead process is also the event's source: an event from oneself may be held back.
        status = lib.PMIx_Notify_event(
            PMIX_ERR_PROC_TERM_WO_SYNC, proc, PMIX_RANGE_PROC_LOCAL, info, 1, None, None
        )
        return status in (PMIX_SUCCESS, PMIX_OPERATION_SUCCEEDED)


class DeathNotices:
    """Every ``period_s``, the grid's processes on this host (``processes()``) that no longer run
    are each passed once to ``announce(nspace, pmix_rank)``."""

    def __init__(
        self,
        period_s: float,
        processes: Callable[[], list[ProcessInfo]],
        announce: Callable[[str, int], bool],
        host: str | None = None,
    ) -> None:
        self.period_s = period_s
        self._processes, self._announce = processes, announce
        self._host = host or socket.gethostname()
        self._told: set[tuple[str, int]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="death-notices", daemon=True)

    def start(self) -> DeathNotices:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> list[ProcessInfo]:
        """One look: the processes found dead now (each announced)."""
        found = []
        for info in list(self._processes()):
            if info.host != self._host or info.pid == os.getpid():
                continue
            if info.nspace is None or info.pmix_rank is None:
                continue
            name = (info.nspace, info.pmix_rank)
            if name in self._told or still_running(info) is not False:
                continue
            self._told.add(name)
            if not self._announce(*name):
                print(
                    f"[nanotron-recover] death notices: PMIx refused the event for rank {info.rank} "
                    f"(pid {info.pid}, {name[0]}:{name[1]})",
                    file=sys.stderr,
                    flush=True,
                )
            found.append(info)
        return found

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check()
            except Exception as error:  # the thread must outlive a bad look
                print(f"[nanotron-recover] death notices: {error}", file=sys.stderr, flush=True)


def start_death_notices(period_s: float, processes: Callable[[], list[ProcessInfo]]) -> DeathNotices | None:
    """The thread for this process (see the module), or None where PMIx cannot take the events
    (said once on stderr)."""
    events = PmixEvents()
    if not events.available:
        print(f"[nanotron-recover] death notices off: {events.why_not}", file=sys.stderr, flush=True)
        return None
    return DeathNotices(period_s, processes, events.announce_death).start()
