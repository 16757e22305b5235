"""Fault injection: a process SIGKILLs itself at an exact point of a step.

The schedule comes from the config (``recover.faults`` and ``recover.random_faults``) and is known to
every rank, so survivors can tell which fault they are recovering from. A replica fault kills every
rank of the replica at the same point; a rank fault kills one rank, and its replica then fails as a
whole (its other ranks leave during recovery). Before dying the victim writes the wall-clock time of
its death to ``<run_dir>/faults/step<s>_<phase><i>_rank<r>.json`` so the survivors can measure
detection latency. A fault fires once per run: a job relaunched by checkpoint-restart skips the
faults whose record exists, even when it recomputes their step.

Random faults pick, every ``every_steps`` steps, one alive replica by a generator seeded with
``(seed, step)``, and kill it in the forward pass of its first micro-batch, until ``until_replicas``
are left. Every rank computes the same choice from the same alive set.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from ..config import FaultSpec, RecoverArgs
from .failstop import fail_stop


@dataclass(frozen=True)
class ScheduledFault:
    step: int
    phase: str
    microbatch: int
    replica: int | None
    rank: int | None


class FaultInjector:
    def __init__(self, args: RecoverArgs, rank: int, replica: int, run_dir: Path):
        self.args, self.rank, self.replica, self.run_dir = args, rank, replica, run_dir
        self.step = 0
        self.current: list[ScheduledFault] = []

    def begin_step(self, step: int, alive: list[int]) -> None:
        """Fix this step's faults from the replicas alive when it starts (same on every rank)."""
        self.step, self.current = step, self.scheduled(step, alive)

    def scheduled(self, step: int, alive: list[int]) -> list[ScheduledFault]:
        """Every fault planned for ``step`` (explicit ones, plus the random one if due)."""
        faults = [
            ScheduledFault(f.step, f.phase, f.microbatch, f.replica, f.rank)
            for f in self.args.faults
            if f.step == step
        ]
        rf = self.args.random_faults
        if rf is not None and step % rf.every_steps == 0 and len(alive) > rf.until_replicas:
            victim = random.Random(f"{rf.seed}:{step}").choice(sorted(alive))
            faults.append(ScheduledFault(step, "forward", 0, victim, None))
        return faults

    def is_victim(self, fault: ScheduledFault | FaultSpec) -> bool:
        return fault.rank == self.rank if fault.rank is not None else fault.replica == self.replica

    def maybe_fail(self, phase: str, index: int = 0) -> None:
        """Die here if a fault is scheduled for this rank at (current step, ``phase``, ``index``)."""
        for fault in self.current:
            if fault.phase == phase and fault.microbatch == index and self.is_victim(fault):
                if self._record_path(fault).exists():
                    continue  # fired in an earlier incarnation of this job
                self._record_death(fault)
                fail_stop(
                    f"injected fault: rank {self.rank} (replica {self.replica}) at step {self.step} {phase} #{index}"
                )

    def _record_path(self, fault: ScheduledFault) -> Path:
        return (
            self.run_dir / "faults" / f"step{fault.step}_{fault.phase}{fault.microbatch}_rank{self.rank}.json"
        )

    def _record_death(self, fault: ScheduledFault) -> None:
        path = self._record_path(fault)
        path.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "rank": self.rank,
            "replica": self.replica,
            "step": fault.step,
            "phase": fault.phase,
            "time": time.time(),
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)


def read_deaths(run_dir: Path, ranks: list[int] | None = None, since: float = 0.0) -> list[dict]:
    """Death records left by injected victims (all, or those among ``ranks``) that died at or after
    ``since`` (wall clock), oldest first; empty for real faults."""
    out = []
    for f in sorted((run_dir / "faults").glob("step*_rank*.json")):
        try:
            record = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        if (ranks is None or record["rank"] in ranks) and record["time"] >= since:
            out.append(record)
    return sorted(out, key=lambda r: r["time"])
