"""Fault injection: a process SIGKILLs or SIGSTOPs itself, or raises, at an exact point of a step.

The schedule comes from the config (``recover.faults`` and ``recover.random_faults``) and is known to
every rank, so survivors can tell which fault they are recovering from. A replica fault hits every
rank of the replica at the same point; a rank fault hits one rank, and its replica then fails as a
whole (its other ranks leave during recovery). ``kind: kill`` dies by SIGKILL, ``kind: freeze``
stops itself with SIGSTOP (a hang: the heartbeat detector must find it); before either, the victim
writes a failure record (``ft/records.py``) with the wall-clock time, so the survivors can measure
detection latency. ``kind: error`` raises :class:`InjectedError` in whichever replica computes the
micro-batch ``id``: once (a transient error) or, with ``persistent``, every time (a deterministic
one). A fault fires once per run: a job relaunched by checkpoint-restart skips the faults whose
record exists, even when it recomputes their step.

Random faults pick, every ``every_steps`` steps, one alive replica by a generator seeded with
``(seed, step)``, and kill it in the forward pass of its first micro-batch, until ``until_replicas``
are left. Every rank computes the same choice from the same alive set.
"""

from __future__ import annotations

import os
import random
import signal
from dataclasses import dataclass
from pathlib import Path

from ..config import FaultSpec, RecoverArgs
from ..failures import InjectedKind, Kind, Phase
from .failstop import fail_stop
from .records import faults_dir, read_records, write_record


class InjectedError(RuntimeError):
    """The exception a ``kind: error`` fault raises while computing its micro-batch."""


@dataclass(frozen=True)
class ScheduledFault:
    step: int
    phase: Phase
    microbatch: int
    replica: int | None
    rank: int | None
    kind: InjectedKind = InjectedKind.KILL
    id: int | None = None
    persistent: bool = False


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
            ScheduledFault(f.step, f.phase, f.microbatch, f.replica, f.rank, f.kind, f.id, f.persistent)
            for f in self.args.faults
            if f.step == step
        ]
        rf = self.args.random_faults
        if rf is not None and step % rf.every_steps == 0 and len(alive) > rf.until_replicas:
            victim = random.Random(f"{rf.seed}:{step}").choice(sorted(alive))
            faults.append(ScheduledFault(step, Phase.FORWARD, 0, victim, None))
        return faults

    def is_victim(self, fault: ScheduledFault | FaultSpec) -> bool:
        if fault.kind == InjectedKind.ERROR:
            return False  # hits whoever computes its micro-batch id, see maybe_raise
        return fault.rank == self.rank if fault.rank is not None else fault.replica == self.replica

    def maybe_fail(self, phase: Phase | str, index: int = 0) -> None:
        """Die (or freeze) here if a fault is scheduled for this rank at (current step, ``phase``,
        ``index``)."""
        for fault in self.current:
            if fault.phase == phase and fault.microbatch == index and self.is_victim(fault):
                name = self._record_name(fault)
                if (faults_dir(self.run_dir) / f"{name}.json").exists():
                    continue  # fired in an earlier incarnation of this job
                kind = Kind.HANG if fault.kind == InjectedKind.FREEZE else Kind.CRASH
                record = {"rank": self.rank, "replica": self.replica, "step": fault.step}
                write_record(self.run_dir, name, {**record, "phase": phase, "kind": kind, "injected": True})
                where = f"rank {self.rank} (replica {self.replica}) at step {self.step} {phase} #{index}"
                if fault.kind == InjectedKind.FREEZE:
                    print(f"[injected freeze pid={os.getpid()}] {where}", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                    # Woken up: this process was removed from the job while it slept; it must not
                    # act on a world that has moved on.
                    fail_stop(f"injected freeze: {where}: woken up after removal")
                fail_stop(f"injected fault: {where}")

    def maybe_raise(self, microbatch_id: int) -> None:
        """Raise :class:`InjectedError` if a ``kind: error`` fault targets ``microbatch_id`` now."""
        for fault in self.current:
            if fault.kind != InjectedKind.ERROR or fault.id != microbatch_id:
                continue
            if not fault.persistent:
                fired = faults_dir(self.run_dir) / f"step{fault.step}_error_id{fault.id}.fired"
                try:
                    fired.parent.mkdir(parents=True, exist_ok=True)
                    os.close(os.open(fired, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    continue  # a transient error strikes once
            raise InjectedError(f"injected error on micro-batch {microbatch_id}")

    def _record_name(self, fault: ScheduledFault) -> str:
        return f"step{fault.step}_{fault.phase}{fault.microbatch}_rank{self.rank}"


def read_deaths(run_dir: Path, ranks: list[int] | None = None, since: float = 0.0) -> list[dict]:
    """Failure records (all, or those of ``ranks``) written at or after ``since`` (wall clock),
    oldest first; empty for faults that struck from outside."""
    return read_records(run_dir, ranks, since)
