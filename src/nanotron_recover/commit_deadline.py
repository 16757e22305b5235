"""The commit deadline: no stuck member can hold the job.

Inside the job every wait has an owner. A frozen rank is declared failed by ULFM's heartbeat
detector and shrunk away; what only one replica can see (its compute, gate, optimizer, save) is
under its watchdog. But some waits have no owner that can end them without harm: a member stuck
in ``Shrink`` or ``Agree`` after an earlier failure on another node, a communicator creation
spinning in Open MPI's id allocation, a re-join whose parent died inside ``Spawn``, a failure
notice that never reached a rank. A deadline of the rank's own there would take a healthy replica
down with the stuck one (a rank cannot tell whether it or its peer is the stuck one).

From outside, every one of them looks the same: no step commits. The supervisor, one level above
the ranks, watches exactly that (``<run_dir>/metrics.jsonl`` grows by one record per commit).
When no step has committed for longer than a bound derived from the steps it has seen, it ends
the job and relaunches it from node memory (``supervisor.run_relaunching``): seconds and at most
one step redone, the same as after a lost node, instead of a job held for minutes or forever.

The bound (:meth:`CommitWatch.bound_s`), once this launch has committed a step::

    floor_s + steps x the typical recent step (median wall_s) + the longest save seen
            + allowance_s (detection and repair: 2 heartbeat timeouts)
            + this launch's start-up (a re-join starts a process the way the launch did)

so a slow step, a repair, a re-join and a synchronous save all commit well inside it. Before the
launch's first commit the bound is ``start_factor`` x the previous launch's start-up plus the
floor, for a relaunch; the first launch of a run has no measured start and no deadline (start-up
of a large model may take minutes: its own MPI waits carry deadlines).

``recover.commit_timeout_s`` replaces the derived bound with a fixed one (``0``: off).

**After a silent process, the repair bound.** The supervisor's heartbeat-file watch
(``frozen_processes.py``) sees a process of the job go silent (frozen, or dead without the runtime
telling anyone). From that moment the job has nothing left to wait for but its repair, which takes
two heartbeat timeouts and a few steps, never the floor and the start-up above::

    allowance_s (2 heartbeat timeouts) + steps x the typical recent step + the longest save

If no step commits within it after the silence (:meth:`CommitWatch.note_loss`), the job is ended
and relaunched then, not at the full bound. Measured in the 50-fault cluster campaign: twice the
ranks on other nodes were killed (once one frozen, one killed) and the survivor on the batch host
sat in the DP ``Allreduce`` with no error for the whole 45 s deadline (its Python stacks,
``stall_trace.py``, showed it there), 54 s from the fault to the next commit; with this bound it is
the watch's silence (timeout + 3 periods) + the repair bound + a relaunch.

**Before either, the hosts are asked.** A process cut off from the others while its node runs
on is found by no one when no detector watches it (a spawned process runs without ULFM's
detector; a launch rank may be alone in its launch world) and its heartbeat file stays fresh
(a run directory the cut does not reach): the others wait for it in the DP reduction, commit
nothing and write no incident. So once no step has committed for::

    probe_s (one heartbeat timeout) + steps x the typical recent step + the longest save

:meth:`CommitWatch.overdue` says so, once per that long: the supervisor then asks whether every
host the job runs on still answers (``lost_hosts.LostHostWatch.poll_stalled``) and relaunches
without a host that does not, seconds after the cut instead of when the link heals or at the
bound above. A stall on healthy hosts costs one probe (the hosts answering: well under a second).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .atomic_file import file_version

TAIL_BYTES = 64 * 1024  # the recent records are read from the end of metrics.jsonl, not all of it
RECENT_STEPS = 20


@dataclass(frozen=True)
class DeadlineArgs:
    """How the bound is derived (or fixed)."""

    floor_s: float = 60.0
    steps: float = 10.0  # typical steps the bound allows beyond the floor
    allowance_s: float = 10.0  # detection and repair of a fault inside the job
    start_factor: float = 3.0  # a relaunch's start may take this many times the previous one
    probe_s: float = 5.0  # no commit for one heartbeat timeout (and a few steps): ask the hosts
    fixed_s: float | None = None  # recover.commit_timeout_s: a fixed bound; 0 turns it off

    @classmethod
    def from_recover(cls, recover: Any) -> DeadlineArgs:
        """The bound of a ``recover:`` config section."""
        return cls(
            allowance_s=2 * float(recover.heartbeat_timeout_s),
            probe_s=float(recover.heartbeat_timeout_s),
            fixed_s=getattr(recover, "commit_timeout_s", None),
        )

    @property
    def off(self) -> bool:
        return self.fixed_s == 0


@dataclass
class Stalled:
    """Why the watch fired: seconds without a commit, the bound, and what it was made of."""

    waited_s: float
    bound_s: float
    last_step: int | None
    why: str

    def describe(self) -> str:
        at = f"after step {self.last_step}" if self.last_step is not None else "since the launch"
        return f"no step committed for {self.waited_s:.0f} s {at} (bound {self.bound_s:.0f} s: {self.why})"


class CommitWatch:
    """Follows ``<run_dir>/metrics.jsonl`` during one launch and says when the job has stalled."""

    def __init__(
        self,
        run_dir: str | Path,
        args: DeadlineArgs,
        previous_start_s: float | None = None,
        now: float | None = None,
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.args = args
        self.previous_start_s = previous_start_s
        self.launched = time.monotonic() if now is None else now
        self.last_commit: float | None = None  # monotonic time of the newest commit seen
        self.start_s: float | None = None  # launch to this launch's first commit
        self.loss_at: float | None = None  # a process went silent then, with no commit since
        self.asked_at: float | None = None  # the hosts were last asked then (overdue), if ever
        # What an earlier launch left: its records are not this launch's commits.
        self._seen = file_version(self.path)
        self._recent: list[dict[str, Any]] = _tail_records(self.path)

    def poll(self, now: float | None = None) -> Stalled | None:
        """Look at the file once; a :class:`Stalled` when the bound has passed without a commit."""
        now = time.monotonic() if now is None else now
        seen = file_version(self.path)
        if seen != self._seen:
            recent = _tail_records(self.path)
            if recent:  # an empty read is a rewrite caught half-way: looked at again next time
                if _is_commit(self._seen, self._recent, seen, recent):
                    self.last_commit = now
                    self.loss_at = None  # repaired (or never needed to be)
                    if self.start_s is None:
                        self.start_s = now - self.launched
                self._seen, self._recent = seen, recent
        if self.args.off:
            return None
        if self.loss_at is not None and self.last_commit is not None:
            repair, why = self.repair_bound_s()
            if now - self.loss_at > repair:
                last = self._recent[-1].get("step") if self._recent else None
                silent_after = self.loss_at - self.last_commit
                return Stalled(
                    now - self.last_commit,
                    silent_after + repair,
                    last,
                    f"a process went silent {silent_after:.0f} s after that commit, and none came "
                    f"within {repair:.0f} s of it: {why}",
                )
        bound, why = self.bound_s()
        if bound is None:
            return None
        since = self.last_commit if self.last_commit is not None else self.launched
        if now - since <= bound:
            return None
        last = self._recent[-1].get("step") if self._recent and self.last_commit is not None else None
        return Stalled(now - since, bound, last, why)

    def note_loss(self, at: float) -> None:
        """A process of the job went silent at ``at`` (same clock as :meth:`poll`): unless a step
        commits after it, the repair bound holds from then on."""
        if self.loss_at is None and self.last_commit is not None and self.last_commit <= at:
            self.loss_at = at

    def overdue(self, now: float | None = None) -> bool:
        """Whether to ask now which of the job's hosts answer: this launch committed a step, none
        has committed for :meth:`probe_after_s` since, and the hosts were not asked within that
        long. True once per that long, so a stall is probed again while it lasts (a cut may come
        during a stall that began on healthy hosts)."""
        now = time.monotonic() if now is None else now
        if self.last_commit is None:
            return False  # starting: a start-up's length is not a stall's
        since = self.last_commit if self.asked_at is None else max(self.last_commit, self.asked_at)
        if now - since <= self.probe_after_s():
            return False
        self.asked_at = now
        return True

    def probe_after_s(self) -> float:
        """How long without a commit before the hosts are asked: a heartbeat timeout (a frozen
        rank's repair is under way by then), a few typical steps and the longest save."""
        step, save = self._typical_step_and_save()
        return self.args.probe_s + self.args.steps * step + save

    def repair_bound_s(self) -> tuple[float, str]:
        """How long a repair may take after a silent process: detection and repair, a few steps,
        the longest save; never more than the fixed bound."""
        a = self.args
        step, save = self._typical_step_and_save()
        bound = a.allowance_s + a.steps * step + save
        if a.fixed_s is not None and a.fixed_s > 0:
            bound = min(bound, a.fixed_s)
        return bound, f"{a.allowance_s:g} s repair + {a.steps:g} x {step:.2f} s a step + {save:.1f} s save"

    def _typical_step_and_save(self) -> tuple[float, float]:
        walls = [float(r.get("wall_s") or r.get("step_time_s") or 0.0) for r in self._recent]
        step = statistics.median(walls) if walls else 0.0
        save = max((float(r.get("checkpoint_s") or 0.0) for r in self._recent), default=0.0)
        return step, save

    def bound_s(self) -> tuple[float | None, str]:
        """The bound now, and how it was made; None before a first commit with no start measured."""
        a = self.args
        if a.fixed_s is not None:
            return a.fixed_s, "recover.commit_timeout_s"
        if self.last_commit is None:
            if self.previous_start_s is None:
                return None, "first start: no deadline"
            bound = a.floor_s + a.start_factor * self.previous_start_s
            return (
                bound,
                f"{a.floor_s:g} s + {a.start_factor:g} x the last start ({self.previous_start_s:.1f} s)",
            )
        step, save = self._typical_step_and_save()
        start = self.start_s or 0.0
        bound = a.floor_s + a.steps * step + save + a.allowance_s + start
        return bound, (
            f"{a.floor_s:g} s + {a.steps:g} x {step:.2f} s a step + {save:.1f} s save "
            f"+ {a.allowance_s:g} s repair + {start:.1f} s start"
        )


def _is_commit(
    before: tuple[int, int, int] | None,
    before_records: list[dict[str, Any]],
    after: tuple[int, int, int] | None,
    after_records: list[dict[str, Any]],
) -> bool:
    """Whether the file changed by a new step's record. The logging rank also rewrites the file
    when it starts (a relaunch keeps the steps up to the restored one, a rank taking the role over
    keeps them all): a rewrite shrinks the file or leaves its last step as it was."""
    last = after_records[-1].get("step")
    if not before_records:
        return True
    if last == before_records[-1].get("step"):
        return False
    shrank = before is not None and after is not None and after[1] < before[1]
    return not shrank


def _tail_records(path: Path) -> list[dict[str, Any]]:
    """The last complete records of the file (at most :data:`RECENT_STEPS`)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - TAIL_BYTES))
            lines = f.read().splitlines()
    except OSError:
        return []
    if size > TAIL_BYTES:
        lines = lines[1:]  # the first line read may be cut
    records = []
    for line in lines[-RECENT_STEPS:]:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    return records
