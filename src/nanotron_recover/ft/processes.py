"""Which process is each rank, and removing a failed one from the job for good.

At start-up every rank publishes ``(host, pid, start time)`` (an allgather over the launch
communicator). After a recovery commits, the survivors know the failed ranks; a failed rank whose
process still exists on a survivor's host is *hung* (frozen, stuck in the kernel or in a driver),
not crashed. It is SIGKILLed right away: it must never wake up and act on a world that has moved
on, and it must not keep ``mpirun`` (or the Slurm job) alive after the others finish. A failed
process on a host with no survivor is left to the launcher, which ends ``mpirun`` once the run has
completed.

The start time (field 22 of ``/proc/<pid>/stat``) guards against a recycled pid.
"""

from __future__ import annotations

import os
import signal
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessInfo:
    rank: int
    host: str
    pid: int
    start_ticks: int | None  # /proc/<pid>/stat field 22 (None where /proc is missing)
    # The process's name in Open MPI's runtime (PMIx namespace and rank; None outside it): what a
    # node-mate needs to tell its own MPI library that this process died (:mod:`.death_notices`).
    nspace: str | None = None
    pmix_rank: int | None = None

    def as_dict(self) -> dict:
        return {"rank": self.rank, "host": self.host, "pid": self.pid}


def _start_ticks(pid: int) -> int | None:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces: split after its closing parenthesis.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])


def _state(pid: int) -> str | None:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()[0]


def this_process(rank: int) -> ProcessInfo:
    pid = os.getpid()
    nspace, pmix_rank = os.environ.get("PMIX_NAMESPACE"), os.environ.get("PMIX_RANK", "")
    return ProcessInfo(
        rank=rank,
        host=socket.gethostname(),
        pid=pid,
        start_ticks=_start_ticks(pid),
        nspace=nspace or None,
        pmix_rank=int(pmix_rank) if nspace and pmix_rank.isdigit() else None,
    )


def still_running(info: ProcessInfo) -> bool | None:
    """True/False if ``info``'s process is on this host (a zombie counts as gone); None if it is not."""
    if info.host != socket.gethostname():
        return None
    state = _state(info.pid)
    if state is None or state in ("Z", "X"):
        return False
    return info.start_ticks is None or _start_ticks(info.pid) == info.start_ticks


def reap(info: ProcessInfo) -> bool | None:
    """SIGKILL ``info``'s process if it still runs on this host. Returns whether it was running
    (None: another host, nothing done)."""
    running = still_running(info)
    if running:
        try:
            os.kill(info.pid, signal.SIGKILL)
        except OSError:
            pass  # gone between the check and the kill
    return running


def launch_mates() -> dict[int, ProcessInfo]:
    """The processes of this process's launch (its PMIx namespace) that run on this host, by launch
    rank, read from ``/proc/<pid>/environ``: who a node-mate is when no table was gathered over MPI
    (a process lost while the first world was built, ``first_world.py``). Empty outside a launch."""
    mine = os.environ.get("PMIX_NAMESPACE")
    found: dict[int, ProcessInfo] = {}
    if not mine:
        return found
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = dict(
                item.split(b"=", 1)
                for item in open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
                if b"=" in item
            )
        except OSError:
            continue  # gone, or not ours to read
        rank = env.get(b"PMIX_RANK", b"")
        if env.get(b"PMIX_NAMESPACE", b"").decode() == mine and rank.isdigit():
            pid = int(entry)
            info = ProcessInfo(int(rank), socket.gethostname(), pid, _start_ticks(pid), mine, int(rank))
            found[info.rank] = info
    return found


def fill_in(table: list[ProcessInfo], own: list[ProcessInfo], shared: list[list[ProcessInfo]]) -> None:
    """Update ``table`` (indexed by logical rank) in place: each member's ``own`` entry, and what
    other members' ``shared`` tables know of processes this one does not (pid 0: lost before this
    rank gathered the table, ``first_world.py``)."""
    for other in shared:
        for known in other:
            if known.pid > 0 and table[known.rank].pid <= 0:
                table[known.rank] = known
    for info in own:
        table[info.rank] = info
