"""The one small state a rank of forward recovery keeps, shared by the mode's parts.

Every part (members, incidents, stops, re-join, step) reads and writes this object and nothing
else of the others': where the rank is (step, phase), what it has committed, the communicator and
the fault injector it was given, and the few flags that say whether it is joining, parking or
redoing lost micro-batches. The communicator (``ft.comm.FaultTolerantComm``) stays the single
source of truth for membership: roles and replicas are read from it, never copied here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...config import Config, RecoverArgs
from ...failures import Phase
from ...ft.failstop import Watchdog

if TYPE_CHECKING:
    from ...ft.comm import FaultTolerantComm
    from ...ft.faults import FaultInjector
    from ..protocol import ReplicaParts


@dataclass
class RankState:
    cfg: Config
    run_dir: Path
    watchdog: Watchdog
    # Failure records older than this belong to an earlier run (a spawned process takes the job's).
    started: float = field(default_factory=time.time)
    step: int = 0  # the step being run (or the last one, at the end)
    phase: str = Phase.START
    last_step: int = 0  # the last committed step
    # Set up by the mode (setup_world, attach); every part runs after both.
    ftc: FaultTolerantComm = None  # type: ignore[assignment]
    injector: FaultInjector = None  # type: ignore[assignment]
    parts: ReplicaParts = None  # type: ignore[assignment]
    my_replica_ranks: set[int] = field(default_factory=set)
    # [0, B): how many replicas contributed each id; [B, 2B): its loss; then per replica, when it
    # last saw a failure: [2B, 2B+W) the failing operation began, [2B+W, 2B+2W) it raised.
    bookkeeping: torch.Tensor | None = None
    # (began, surfaced) wall times of the operation in which this rank last saw a failure.
    last_failure_view: tuple[float, float] = (0.0, 0.0)
    in_recovery: bool = False  # computing the lost micro-batches of an in-step repair
    joining: bool = False  # a spawned process until its join commits
    parking: bool = False  # leaving a failed replica to wait for its re-join
    restore_handle: Any = None  # an asynchronous restore of stale buckets in flight
    generation: int = 0  # relaunches of the job so far (``generation.py``), read at start-up

    @property
    def args(self) -> RecoverArgs:
        return self.cfg.recover

    @property
    def rejoin_on(self) -> bool:
        return self.args.rejoin.mode == "spawn"

    @property
    def B(self) -> int:
        return self.parts.B

    @property
    def W(self) -> int:
        """Replicas at full width (the bookkeeping vector has a slot for each)."""
        return self.cfg.parallelism.dp

    @property
    def park_grace_s(self) -> float:
        """A rank stuck on a frozen replica peer cannot park (it never gets out of its torch call):
        past this grace it leaves, as without re-join."""
        return max(5.0, 2 * self.args.heartbeat_timeout_s)

    def replica_ranks(self) -> set[int]:
        return set(self.ftc.topology.ranks_of_replica(self.ftc.replica))
