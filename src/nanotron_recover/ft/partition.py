"""Which side of a cut network goes on.

A link cut splits the job into sides that cannot reach each other. ULFM's detector on each side
declares the other side failed, and each side's recovery commits among its own members: two jobs
would train on, each writing the run's records. Seen in a fault campaign on the emulated cluster:
a node cut off alone declared the two other replicas dead, re-spawned them and went on, while
those two went on without it.

Only one side may go on, and the rule must need no message across the cut. Every process of the
job beats a heartbeat file in the run directory (``liveness.py``: a launch rank
``<host>.<pid>.rank``, a spawned process ``<host>.<pid>``), which each side still reaches, as it
reaches its checkpoints. A killed or frozen process stops beating; a cut-off one does not.

The rule, on each survivor of a committed recovery (:meth:`PartitionGuard.check`):

- a side holding a strict majority of the ranks alive before the failure goes on at once;
- any other side watches the files of the failed ranks on other hosts for two heartbeat periods
  after the failure surfaced (a process on its own host is on its side of any cut). If the failed
  ranks that beat after that moment outnumber its own ranks (on a tie: if they hold the lowest
  rank), it is the smaller side of a cut and its ranks fail-stop before they write anything. Otherwise the failed ranks are really gone and it goes on (a job that lost
  two of three replicas to crashes pays two heartbeat periods once).

The side that goes on removes the others as it removes any failed rank; the side that stops
leaves nothing behind.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .failstop import fail_stop
from .liveness import heartbeat_file, rank_heartbeat_file
from .processes import ProcessInfo
from .world import RecoveryResult

# How long a side without a majority looks for beats of the failed ranks, in heartbeat periods.
WATCH_PERIODS = 2.0


@dataclass(frozen=True)
class SideVerdict:
    smaller: bool  # this side is the smaller one of a cut: its ranks stop
    beating: tuple[int, ...]  # failed ranks seen beating after the failure surfaced


def is_smaller_side(mine: Sequence[int], beating: Sequence[int]) -> bool:
    """Whether the side of ``mine`` gives way to the failed ranks still ``beating``."""
    if not beating:
        return False
    if len(beating) != len(mine):
        return len(beating) > len(mine)
    return min(beating) < min(mine)


class PartitionGuard:
    """The rule of the module docstring, for the ranks of one run directory."""

    def __init__(
        self,
        run_dir: str | Path,
        period_s: float,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        host: str | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.period_s = float(period_s)
        self.clock, self.sleep = clock, sleep
        self.host = host if host is not None else socket.gethostname()

    def last_beat(self, info: ProcessInfo) -> float | None:
        """The newest beat of ``info``'s process (either name), or None if it has no file."""
        newest = None
        for path in (
            rank_heartbeat_file(self.run_dir, info.host, info.pid),
            heartbeat_file(self.run_dir, info.host, info.pid),
        ):
            try:
                mtime = os.stat(path).st_mtime
            except OSError:
                continue
            newest = mtime if newest is None else max(newest, mtime)
        return newest

    def check(
        self,
        before: Sequence[int],
        failed: Sequence[int],
        processes: Sequence[ProcessInfo],
        detected_at: float,
    ) -> SideVerdict:
        """Judge this rank's side after a recovery: ``before`` the ranks alive before it, ``failed``
        those it declared failed, ``detected_at`` when the failure surfaced here (wall clock)."""
        failed_set = set(failed)
        mine = [r for r in before if r not in failed_set]
        if not failed_set or 2 * len(mine) > len(before):
            return SideVerdict(False, ())
        by_rank = {p.rank: p for p in processes}
        # A process on this host cannot be on the other side of a network cut: only the failed
        # ranks of other hosts are watched (a job on one host never waits here).
        watched = [by_rank[r] for r in sorted(failed_set) if r in by_rank and by_rank[r].host != self.host]
        if not watched:
            return SideVerdict(False, ())
        deadline = detected_at + WATCH_PERIODS * self.period_s
        beating: set[int] = set()
        while True:
            for info in watched:
                beat = self.last_beat(info)
                if beat is not None and beat > detected_at:
                    beating.add(info.rank)
            if is_smaller_side(mine, sorted(beating)):
                return SideVerdict(True, tuple(sorted(beating)))
            now = self.clock()
            if now >= deadline:
                return SideVerdict(False, tuple(sorted(beating)))
            self.sleep(min(0.1, deadline - now))

    def stop_if_smaller_side(
        self, rank: int, before: Sequence[int], result: RecoveryResult, processes: Sequence[ProcessInfo]
    ) -> None:
        """After a committed recovery on ``rank``: fail-stop if its side is the smaller side of a cut."""
        verdict = self.check(before, result.failed_ranks, processes, result.detected_at)
        if verdict.smaller:
            fail_stop(
                f"rank {rank} is cut off from the job: ranks {list(verdict.beating)}, declared failed, "
                f"still beat, and they outnumber this side's {len(before) - len(result.failed_ranks)} "
                "rank(s): this side stops, the other goes on"
            )
