"""Where a stalled rank was: its Python stacks, written before the supervisor ends it.

When no step commits for the supervisor's bound (``commit_deadline.py``), it ends the job and
relaunches it from node memory. That repairs the job but erases the evidence: which rank was stuck,
and in which call (an MPI collective whose peer's death never reached it, a shrink, a file write).
So each training rank arms a one-shot timer after every step it commits
(:func:`faulthandler.dump_traceback_later`, a C thread that needs no GIL and works while the main
thread is blocked inside MPI): if the next commit does not come within :func:`trace_after_s`, the
rank writes the stacks of all its threads to stderr once (``mpirun`` tags the lines with the rank).
A rank that is parked, starting or done is disarmed: it commits nothing by design.

The dump fires before the supervisor's fixed bound (two thirds of ``recover.commit_timeout_s``) or,
with the derived bound (at least 60 s), after ``max(30 s, 6 heartbeat timeouts)``, well past the
seconds a repair or a re-join takes. It only writes; it never ends the rank.
"""

from __future__ import annotations

import faulthandler
import sys
from typing import Any

MIN_TRACE_S = 30.0


def trace_after_s(recover: Any) -> float | None:
    """Seconds without a commit after which a rank writes its stacks (``None``: never: no forward
    recovery, so no supervisor deadline, or the commit deadline is off)."""
    if not getattr(recover, "enabled", True) or getattr(recover, "mode", "forward") != "forward":
        return None
    fixed = getattr(recover, "commit_timeout_s", None)
    if fixed is not None:
        return None if fixed == 0 else 2.0 * float(fixed) / 3.0
    return max(MIN_TRACE_S, 6.0 * float(recover.heartbeat_timeout_s))


def arm(after_s: float | None) -> None:
    """(Re)start the countdown: called after each commit; replaces the previous countdown."""
    if after_s is None or after_s <= 0:
        return
    faulthandler.dump_traceback_later(after_s, repeat=False, file=sys.stderr, exit=False)


def disarm() -> None:
    """No countdown: the rank is parked, starting or done."""
    faulthandler.cancel_dump_traceback_later()
