"""Processes a rank has learned failed, named in the run directory the moment it learns it.

The supervisor relaunches a job whose lost ranks' host no longer answers (``lost_hosts.py``). It
used to learn of lost ranks from the incident, which the survivors write when they commit the
repaired step. A link cut on the emulated cluster showed why that is too late: the cut-off rank's
observer declared it failed within the heartbeat timeout, but another survivor, on a third node,
was never told and sat in the DP ``Allreduce`` until the link came back (15 s), so nothing
committed and nothing was written. Once the link was back, the cut-off side's queued messages
reached the job: a heartbeat request that turned a survivor's ULFM detector towards the dead
process, so that its real observer declared the healthy survivor dead ("reported dead by someone
else"), or a freed send request that failed and aborted it. Every one of those needs the link to
heal while the job that knew of the cut still runs.

So the first rank to learn of a failure says so at once, before any repair: its failure watch
(``watch.py``) creates ``<run_dir>/suspects/<host>.<pid>`` for each failed process on *another*
host (a process on its own host cannot be cut off from it, and its death is the runtime's to
report). The name is the process, not the rank, so that a later failure on the same host is a new
name. Many ranks may create the same file; creating it twice changes nothing. The supervisor
empties the folder at each launch (pids are reused), lists it while the job runs, probes the
hosts it has not seen named, and relaunches without a host that does not answer, before the link
can heal.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from .processes import ProcessInfo

SUSPECTS_DIR = "suspects"


def suspects_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / SUSPECTS_DIR


def note_suspects(run_dir: str | Path, failed: Iterable[ProcessInfo], my_host: str) -> list[str]:
    """Name each failed process of another host than ``my_host``; returns the names written."""
    names = [f"{p.host}.{p.pid}" for p in failed if p.host != my_host]
    if not names:
        return []
    folder = suspects_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        # O_EXCL: a name another rank created already is left as it is.
        try:
            os.close(os.open(folder / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            pass
    return names


def suspect_names(run_dir: str | Path) -> set[str]:
    """Every name in the folder (none if it does not exist)."""
    try:
        return set(os.listdir(suspects_dir(run_dir)))
    except OSError:
        return set()


def clear_suspects(run_dir: str | Path) -> None:
    """Remove every name: at each launch, so that a process of a new launch that gets the pid of
    an earlier launch's named process on the same host is a new name when it fails."""
    for name in suspect_names(run_dir):
        try:
            (suspects_dir(run_dir) / name).unlink()
        except OSError:
            pass


def host_of(name: str) -> str:
    """The host of a name ``<host>.<pid>`` (a host name may hold dots; a pid does not)."""
    return name.rsplit(".", 1)[0]
