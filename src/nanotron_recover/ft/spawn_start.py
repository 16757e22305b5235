"""The first moments of a process spawned by a re-join: its heartbeat before anything heavy.

The members of a re-join watch the processes they spawned through their heartbeat files
(:class:`.liveness.JoinWatch`) and give the join up when one has not started beating within a
start window. Importing torch and initialising MPI take seconds on a busy node (6.6 s measured
for the CLI's imports alone on 2 busy cores), so a process that began to beat only after them
needed a window of 30 s, and every re-join whose spawned process died before its first beat cost
those 30 s at reduced width. The spawn command sets :data:`ENV`, and the CLI module calls
:func:`beat_if_spawned` before its own imports: the heartbeat thread starts with the standard
library and ``liveness`` only (the process beats to the same file from then on).
"""

from __future__ import annotations

import os

# "<run_dir>|<heartbeat period in seconds>", set in the spawn command's environment.
ENV = "NANOTRON_RECOVER_SPAWN_BEAT"


def beat_value(run_dir: str | os.PathLike, period_s: float) -> str:
    return f"{os.fspath(run_dir)}|{float(period_s)}"


def beat_if_spawned() -> bool:
    """Start this process's heartbeat now if it was spawned by a re-join (:data:`ENV` set, and
    taken out of the environment so that nothing this process starts inherits it)."""
    value = os.environ.pop(ENV, "")
    run_dir, _, period = value.rpartition("|")
    if not run_dir:
        return False
    from .liveness import start_heartbeat

    start_heartbeat(run_dir, float(period))
    return True
