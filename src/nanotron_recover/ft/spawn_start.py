"""The first moments of a process spawned by a re-join: its heartbeat before anything heavy.

The members of a re-join watch the processes they spawned through their heartbeat files
(:class:`.liveness.JoinWatch`) and give the join up when one has not started beating within a
start window. Importing torch and initialising MPI take seconds on a busy node (6.6 s measured
for the CLI's imports alone on 2 busy cores), so a process that began to beat only after them
needed a window of 30 s, and every re-join whose spawned process died before its first beat cost
those 30 s at reduced width. The spawn command sets :data:`ENV`, and the CLI module calls
:func:`beat_if_spawned` before its own imports: the heartbeat thread starts with the standard
library and ``liveness`` only (the process beats to the same file from then on).

It also starts the process's watcher (``abandoned_join.py``), which kills it if the members give
its join up while it is still connecting to them (in ``MPI_Init``, which nothing else
interrupts); :func:`joined_members` ends the watcher once the process got through its merge.
"""

from __future__ import annotations

import os

# "<run_dir>|<heartbeat period in seconds>", set in the spawn command's environment.
ENV = "NANOTRON_RECOVER_SPAWN_BEAT"


def beat_value(run_dir: str | os.PathLike, period_s: float) -> str:
    return f"{os.fspath(run_dir)}|{float(period_s)}"


def beat_if_spawned() -> bool:
    """Start this process's heartbeat now if it was spawned by a re-join (:data:`ENV` set, and
    taken out of the environment so that nothing this process starts inherits it), and its
    watcher if the spawn named its join (``abandoned_join.ENV``)."""
    global _watcher
    value = os.environ.pop(ENV, "")
    from .abandoned_join import ENV as JOIN_ENV

    join = os.environ.pop(JOIN_ENV, "")
    run_dir, _, period = value.rpartition("|")
    if not run_dir:
        return False
    from .liveness import start_heartbeat

    if join and _watcher is None:
        from .abandoned_join import start_watcher

        _watcher = start_watcher(run_dir, join, float(period))
    start_heartbeat(run_dir, float(period))
    return True


def joined_members() -> None:
    """This spawned process merged with the members: its join's own deadlines and commit cover it
    from here, so its watcher ends."""
    global _watcher
    if _watcher is not None:
        _watcher.release()
        _watcher = None


_watcher = None  # this process's abandoned_join.Watcher, while it connects to the members
