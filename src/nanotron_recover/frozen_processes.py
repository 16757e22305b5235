"""Frozen processes that no rank removes, found and removed by the supervisor.

Inside the job, a frozen rank is found by ULFM's heartbeat detector, and the processes that
detector does not watch -- a process spawned by a re-join, a launch rank left alone in its launch
world -- beat to a heartbeat file (``ft/liveness.py``) that every rank on *their own host* watches:
only there can a rank SIGKILL a frozen one, so that its death is reported to every rank (by the
runtime; once no launch process is alive, by broken TCP connections and node-mates'
``ft/death_notices.py``) and the step is repaired. Two cases were left, both measured on the emulated cluster:

- a process alone on its node (a spawned process on a spare node, a launch rank whose node-mates
  were replaced) has no observer on its host: frozen, it held every member until the commit
  deadline relaunched the whole job (45-109 s);
- a launch rank frozen on one node was declared failed by ULFM's detector, but the news did not
  always reach the ranks on the other nodes: they spun in the reduction until the commit deadline.

Every launch rank therefore beats to a file of its own too (``<host>.<pid>.rank``), and the
supervisor, which sees every heartbeat file (``run_dir`` is on a file system every node shares) and
runs inside the allocation, follows the files of the processes in the current rank table
(``ranks.json``). Ages are measured on the supervisor's own clock -- how long since the file's
modification time last *changed* -- so a clock skew between nodes cannot age a file. A file that
stopped changing for longer than the heartbeat timeout plus three periods (a process alone on its
node) or twice the timeout plus three periods (one with node-mates, whose monitors and ULFM act
first) belongs to a frozen process:

1. the supervisor writes the failure record the frozen process cannot write (kind ``hang``, at
   its last heartbeat), as a rank's monitor would;
2. it SIGKILLs the process on its node: directly on its own host, else through a one-task
   ``srun --overlap`` step on that node that checks the process's start time first (a pid reused
   since is left alone). The death is then reported like a crash's, and the job repairs the
   step (and re-joins) without a relaunch: a repair, seconds;
3. when that kill cannot be done (no Slurm, or the node does not run the step: the whole node is
   frozen or cut off), :meth:`poll` says so and the supervisor ends the job and relaunches it
   from node memory on the hosts that answer, as for a lost host.
4. when every process of the rank table is silent, no member is left to repair anything:
   :meth:`poll` says so and the supervisor ends the job and relaunches it at once, instead of
   waiting out the commit deadline's repair bound for a repair that cannot come.

A launch rank some rank has learned failed is named for the supervisor (``ft/suspects.py``:
``<host>.<pid>``, by the first rank on another host to learn of it, e.g. its ULFM detector's
observer). Once such a rank's own file (``.rank``) has not changed for the heartbeat timeout, it is
removed without the three periods' wait, if it still runs (a crash the job has not repaired yet,
on a long step, is the runtime's to report and gets no ``hang`` record): MPI has given it up
already, and the other ranks may not have been told (Open MPI 5.0.11 tells a detector's verdict to
the observer only) and wait for its death. Measured on the emulated cluster before this: a frozen
launch rank's step was repaired 8.1-8.6 s after the freeze, at the supervisor's kill. A launch
rank whose observer is a node-mate is named by nobody (its node-mates remove it: ``ft/processes.py``).

A silent process the job has already removed itself (shrunk away after the runtime reported its
death, marked ``fence/<host>-<pid>``: :func:`.fencing.removed_marker`) stays in the rank table
until a re-join replaces it, and its file stops changing like a frozen one's. It is no loss: the
job repaired it and may be re-joining its replacement right then (a spawn across hosts takes
about 11 s on the emulated cluster, more on a busy machine). It is only SIGKILLed (a frozen
process must not linger), with no record and no repair bound (:attr:`lost_at`); before, the
repair bound started 8 s after such a kill and ended the re-join as a stall when the spawn was
slow.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .atomic_file import file_version
from .failures import Kind
from .fencing import removed_marker
from .ft.liveness import LAUNCH_SUFFIX, RANK_SUFFIX
from .ft.processes import ProcessInfo, still_running
from .ft.records import write_record
from .ft.suspects import suspect_names
from .host_probe import PROBE_TRY_S, run_bounded

# One srun that SIGKILLs a process on its node: as long as a probe's try (a node that runs no
# step within it is not one to wait for; measured: a 10 s bound made a dark power loss cost 10 s
# more before the relaunch).
KILL_TRY_S = PROBE_TRY_S
# The ranks' own monitors act within timeout + period on a process that has a node-mate; the
# supervisor waits this much longer before acting itself.
GRACE_PERIODS = 2.0


@dataclass(frozen=True)
class Watched:
    rank: int
    replica: int
    host: str
    pid: int
    start_ticks: int | None
    alone: bool = True  # no other rank of the table on its host


class FrozenProcessWatch:
    """Follows the heartbeat files of the job's processes; :meth:`poll` removes a frozen one, or
    returns why the job must be relaunched instead."""

    def __init__(
        self,
        run_dir: str | Path,
        period_s: float,
        timeout_s: float,
        *,
        slurm_job: str | None = None,
        local_host: str | None = None,
        clock: Any = time.monotonic,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.timeout_s = timeout_s  # a process a rank named failed (ft/suspects.py)
        self.bound_s = timeout_s + period_s * (1 + GRACE_PERIODS)
        self.shared_bound_s = self.bound_s + timeout_s  # node-mates' monitors and ULFM act first
        self.slurm_job = slurm_job if slurm_job is not None else os.environ.get("SLURM_JOB_ID")
        self.local_host = local_host or socket.gethostname()
        self.clock = clock
        # file name -> (its last modification time, when the watch saw that time first)
        self._seen: dict[str, tuple[float, float]] = {}
        self._removed: set[tuple[str, int]] = set()
        # When the newest silent process was found (this watch's clock): the commit deadline's
        # repair bound starts there (commit_deadline.CommitWatch.note_loss).
        self.lost_at: float | None = None
        # The rank table an earlier launch left (a watch is made per launch): its processes are
        # gone, their files silent. Measured: under load a relaunch took 28 s to write its own
        # table, and the watch "removed" the ended job's ranks 13 s into it.
        self._stale_table = file_version(self.run_dir / "ranks.json")

    def poll(self) -> str | None:
        """Remove the frozen processes found now; a description when one could not be removed
        (the job must be ended and relaunched), else None."""
        now = self.clock()
        table = self._table()
        found = []
        for watched, last_beat, bound in self._frozen(now, table):
            if bound < self._bound(watched) and self._alive(watched) is False:  # the named rule
                # Named and silent, but dead: a crash the job repairs; no record, no repair bound.
                self._removed.add((watched.host, watched.pid))
                continue
            found.append((watched, last_beat, bound))
        removed_by_the_job = {w for w, _, _ in found if self._removed_by_the_job(w)}
        if len(removed_by_the_job) < len(found):
            self.lost_at = now
        for watched, last_beat, bound in found:
            self._removed.add((watched.host, watched.pid))
            if watched in removed_by_the_job:
                self._kill(watched)  # in case it is frozen, not dead; the job goes on without it
                continue
            self._record(watched, last_beat, bound)
            if not self._kill(watched):
                where = "alone on its node" if watched.alone else "with node-mates"
                return (
                    f"rank {watched.rank} (pid {watched.pid} on {watched.host}, {where}) sent no "
                    f"heartbeat for {bound:.0f} s and could not be removed"
                )
        if found and table and all(key in self._removed for key in table):
            # No member is left to repair the step: waiting out the repair bound helps nobody.
            # Seen in a campaign: every rank SIGKILLed at once after several spawns in the launch,
            # mpirun did not end, and the job waited 11 s more for a repair before its relaunch.
            return (
                f"every process of the job ({len(table)}) sent no heartbeat: none is left to repair the step"
            )
        return None

    # -- finding ------------------------------------------------------------------------------
    def _bound(self, watched: Watched) -> float:
        return self.bound_s if watched.alone else self.shared_bound_s

    def _table(self) -> dict[tuple[str, int], Watched]:
        """The processes of the rank table, each saying whether another rank shares its host."""
        path = self.run_dir / "ranks.json"
        if self._stale_table is not None:
            if file_version(path) == self._stale_table:
                return {}  # this launch has not written its table yet
            self._stale_table = None
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        per_host: dict[str, int] = {}
        for row in table:
            per_host[row["host"]] = per_host.get(row["host"], 0) + 1
        return {
            (row["host"], int(row["pid"])): Watched(
                int(row["rank"]),
                int(row.get("replica", -1)),
                row["host"],
                int(row["pid"]),
                row.get("start_ticks"),
                per_host[row["host"]] == 1,
            )
            for row in table
        }

    def _frozen(
        self, now: float, table: dict[tuple[str, int], Watched]
    ) -> list[tuple[Watched, float, float]]:
        """(process, its last beat, the bound it passed) for each silent process of the table."""
        found = []
        try:
            files = list((self.run_dir / "heartbeats").iterdir())
        except OSError:
            return []
        suspects = suspect_names(self.run_dir)
        for path in files:
            host, _, rest = path.name.removesuffix(LAUNCH_SUFFIX).removesuffix(RANK_SUFFIX).rpartition(".")
            pid = int(rest) if rest.isdigit() else None
            watched = table.get((host, pid)) if pid is not None else None
            if watched is None or (host, pid) in self._removed:
                continue
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            seen = self._seen.get(path.name)
            if seen is None or seen[0] != mtime:
                self._seen[path.name] = (mtime, now)
                continue
            named = path.name.endswith(RANK_SUFFIX) and f"{host}.{pid}" in suspects
            bound = self.timeout_s if named else self._bound(watched)
            if now - seen[1] > bound:
                found.append((watched, mtime, bound))
        return found

    def _removed_by_the_job(self, watched: Watched) -> bool:
        return removed_marker(self.run_dir, watched.host, watched.pid).exists()

    # -- removing -----------------------------------------------------------------------------
    def _record(self, watched: Watched, last_beat: float, bound: float) -> None:
        message = (
            f"rank {watched.rank} (pid {watched.pid} on {watched.host}) sent no heartbeat for "
            f"{bound:.0f} s; removed by the supervisor"
        )
        record = {
            "rank": watched.rank,
            "replica": watched.replica,
            "step": self._next_step(),
            "phase": "unknown",
            "kind": Kind.HANG,
            "pid": watched.pid,
            "time": last_beat,
            "message": message,
        }
        write_record(self.run_dir, f"step{record['step']}_{Kind.HANG}_rank{watched.rank}", record)

    def _next_step(self) -> int:
        from .commit_record import read_commit

        last = read_commit(self.run_dir)
        return 1 if last is None else last.step + 1

    def _alive(self, watched: Watched) -> bool | None:
        """Whether the process still runs, its start time checked; None when that cannot be told
        (no Slurm, or its node runs no step)."""
        if watched.host == self.local_host:
            return still_running(ProcessInfo(watched.rank, watched.host, watched.pid, watched.start_ticks))
        if not self.slurm_job:
            return None
        status, _ = run_bounded(self._on_node(watched, "exit 0", absent=3), KILL_TRY_S, output=False)
        return {0: True, 3: False}.get(status)  # None: it could not be told (no answer in time)

    def _kill(self, watched: Watched) -> bool:
        """SIGKILL the process on its node; whether that was done (or it was gone already)."""
        if watched.host == self.local_host:
            try:
                os.kill(watched.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except OSError:
                return False
            return True
        if not self.slurm_job:
            return False
        status, _ = run_bounded(self._on_node(watched, "kill -KILL $p", absent=0), KILL_TRY_S, output=False)
        return status == 0

    def _on_node(self, watched: Watched, action: str, *, absent: int) -> list[str]:
        """A one-task ``srun --overlap`` step on the process's node that runs ``action`` (``$p`` the
        pid) if the process is there, else exits ``absent``."""
        ticks = "" if watched.start_ticks is None else str(watched.start_ticks)
        # Field 22 of /proc/<pid>/stat, the start time: after the command name (in parentheses),
        # the 20th field. A process with another start time is not the frozen one: left alone.
        script = (
            f'p={watched.pid}; t="{ticks}"; [ -r /proc/$p/stat ] || exit {absent}; '
            "set -- $(sed 's/.*) //' /proc/$p/stat); "
            f'[ -z "$t" ] || [ "${{20}}" = "$t" ] || exit {absent}; {action}'
        )
        return [
            "srun", "--overlap", f"--jobid={self.slurm_job}", "-N", "1", "-n", "1",
            "-w", watched.host, "--time", "1", "sh", "-c", script,
        ]  # fmt: skip
