"""The MPI-free half of the fault-tolerant layer: what :class:`~.comm.FaultTolerantComm` reports.

The errors it raises and the :class:`RecoveryResult` of a committed recovery, in a module that does
not import ``mpi4py``: importing ``mpi4py.MPI`` (as ``ft/comm.py`` does) initializes MPI, which code
that only catches or inspects these (a unit test, a supervisor, a log reader) must not pay for.
``ft/comm.py`` re-exports every name here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class FTError(RuntimeError):
    """Base class of the fault-tolerance errors raised to the caller."""


class StaleEpoch(FTError):
    """A reduction was requested for an epoch that is not the current world's."""

    def __init__(self, given: int, current: int) -> None:
        super().__init__(f"reduction tagged with epoch {given}, but the world is at epoch {current}")
        self.given = given
        self.current = current


@dataclass(frozen=True)
class RecoveryResult:
    """What one committed recovery changed, and how long it took."""

    old_epoch: int
    new_epoch: int
    failed_replicas: tuple[int, ...]
    failed_ranks: tuple[int, ...]  # logical ranks (grid positions)
    alive_replicas: tuple[int, ...]
    trigger: str  # "allreduce", "agree" or "manual"
    detect_s: float  # how long the failing operation ran before it raised (0.0 for "manual")
    detected_at: float  # wall clock (time.time()) when the failure surfaced here
    revoke_s: float  # revoking the owned communicators + the entry agree
    shrink_s: float  # all Shrink calls, summed over rounds
    recover_s: float  # entering recovery -> commit
    rounds: int  # shrink/split/commit rounds (1 unless something failed during recovery)
    left: bool = False  # True on a rank that leaves (only ever seen by on_leave)
    # Failed ranks whose process still ran on this host at the commit (frozen: now SIGKILLed), and
    # failed ranks on other hosts, which this rank cannot see.
    hung_ranks: tuple[int, ...] = ()
    unseen_ranks: tuple[int, ...] = ()
    # True on a rank of a failed replica that stays in the job, parked, to be reused when its
    # replica re-joins (``recover.rejoin``); such a rank has no replica or DP communicator.
    parked: bool = False
    # The newest step any survivor had committed when the recovery ended (each rank's
    # ``FaultTolerantComm.last_commit``; -1: unknown). A rank whose commit agree raised while
    # another returned from it learns here that its step was committed (see ``comm.py``).
    newest_commit: int = -1

    def as_dict(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}


class WorldChanged(FTError):
    """The world moved to a new epoch; work tagged with an older epoch must be redone."""

    def __init__(self, result: RecoveryResult) -> None:
        super().__init__(
            f"world changed: epoch {result.old_epoch} -> {result.new_epoch}, "
            f"failed replicas {list(result.failed_replicas)}"
        )
        self.result = result
        self.old_epoch = result.old_epoch
        self.new_epoch = result.new_epoch
        self.failed_replicas = result.failed_replicas


class AllReplicasFailed(FTError):
    """Recovery committed but every replica failed: no replica is left alive to go on.

    Raised on the ranks still running (members of failed replicas). The step transaction turns it
    into a lost job (kind ``all_replicas_lost``, exit 1, nothing saved), not the checkpointed stop
    of falling below ``recover.min_replicas``.
    """

    def __init__(self, result: RecoveryResult) -> None:
        super().__init__(f"no replica left alive (failed replicas {list(result.failed_replicas)})")
        self.result = result


@dataclass(frozen=True)
class JoinPlan:
    """Which replicas come back in one re-join (decided by the root, sent to every member)."""

    replicas: tuple[int, ...]  # replicas brought back
    new_ranks: tuple[int, ...]  # logical ranks to spawn (sorted)
    reused_ranks: tuple[int, ...]  # parked ranks of those replicas, reused


class JoinFailed(FTError):
    """A re-join did not commit (the spawn failed, or a member failed during it); nothing changed.

    ``could_not_start``: the spawn itself could not start (no free slot, unknown host, missing
    command), a lack of resources rather than a fault; the same on every member."""

    def __init__(self, message: str, could_not_start: bool = False) -> None:
        super().__init__(message)
        self.could_not_start = could_not_start


__all__ = [
    "AllReplicasFailed",
    "FTError",
    "JoinFailed",
    "JoinPlan",
    "RecoveryResult",
    "StaleEpoch",
    "WorldChanged",
]
