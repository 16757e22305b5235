"""Who this rank is in the job, and how it leaves it.

- **Roles.** The longest-serving replica writes checkpoints; its local rank 0 logs. A replica that
  re-joins never takes the roles over mid-run.
- **Leaving.** A rank that must leave (its replica failed, its watchdog fired, an exception while
  computing) writes a failure record (``ft/records.py``) and then SIGKILLs itself
  (``ft/failstop.py``): an exit with a non-zero status would not be reported to the survivors.
- **Failure notices.** The failure watch thread tells a rank computing outside MPI that a peer of
  its replica failed: without re-join it leaves at once; with re-join it is kept, and parks from
  the main thread, or leaves after a grace when it is stuck on a frozen peer.
- **Fences.** A process removed while frozen may wake up later: the logging rank marks it
  (``<run_dir>/fence/<host>-<pid>``) and :meth:`Members.check_member` keeps it from writing
  shared files.
- **Spawned processes' liveness.** ULFM's heartbeat does not watch processes spawned by a re-join,
  nor a launch rank whose launch world has no other live process; those touch heartbeat files, each
  rank watches the files of those on its host (``ft/liveness.py``), and for a frozen one writes the
  record it cannot write and SIGKILLs it.
- **The rank table** ``<run_dir>/ranks.json``: host and pid of every rank, for operators and tests.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from ... import fencing
from ...atomic_file import write_text_atomically
from ...failures import Kind
from ...ft.death_notices import start_death_notices
from ...ft.failstop import fail_stop
from ...ft.liveness import SpawnedMonitor, beat_once_alone, rank_heartbeat_file, start_rank_heartbeat
from ...ft.processes import ProcessInfo, reap
from ...ft.records import write_record
from ...ft.suspects import note_suspects
from ...ft.world import RecoveryResult
from ...generation import read_generation
from ...outcome import write_abandoned
from .rank_state import RankState

# The watchdog phase a re-join runs in, on members and spawned processes alike.
REJOIN_PHASE = "rejoin"


class Members:
    def __init__(self, state: RankState):
        self.s = state

    # -- roles -------------------------------------------------------------------------------
    def is_checkpoint_writer(self) -> bool:
        ftc = self.s.ftc
        return not ftc.parked and ftc.replica == ftc.senior_replica

    def is_logger(self) -> bool:
        return self.is_checkpoint_writer() and self.s.ftc.local_rank == 0

    # -- leaving -----------------------------------------------------------------------------
    def record(self, kind: Kind, rank: int | None = None, **extra: Any) -> None:
        """This rank's failure record, or (``rank``) the one a frozen process cannot write itself."""
        s = self.s
        if s.ftc is None:
            return  # not yet in the job (a spawned process whose join failed): nobody reads it
        rank = s.ftc.rank if rank is None else rank
        record = {"rank": rank, "replica": s.ftc.topology.replica_of(rank), "step": s.step, "phase": s.phase}
        write_record(s.run_dir, f"step{s.step}_{kind}_rank{rank}", {**record, **extra, "kind": kind})

    def leave(self, kind: Kind, reason: str, **extra: Any) -> NoReturn:
        """This replica is lost (or stuck): record why, then fail-stop so the others recover."""
        self.record(kind, message=reason, **extra)
        # The full reason is in the record (and, for a stop, in the outcome): one short line here.
        ftc = self.s.ftc
        who = "a spawned process" if ftc is None else f"rank {ftc.rank} (replica {ftc.replica})"
        fail_stop(f"{who} leaves: {kind} during {self.s.phase}")

    def on_leave(self, result: RecoveryResult) -> None:
        """The communicator's callback before a rank of a failed replica leaves (also from inside
        its construction, before ``s.ftc`` is set: a replica lost while the first world was built)."""
        ftc = self.s.ftc
        if ftc is None:
            print(
                f"[nanotron-recover] launch rank {os.environ.get('OMPI_COMM_WORLD_RANK', '?')} leaves: its "
                f"replica lost a process while the job started (epoch {result.old_epoch} -> {result.new_epoch})",
                file=sys.stderr,
                flush=True,
            )
            return
        print(
            f"[nanotron-recover] rank {ftc.rank} leaves: replica {ftc.replica} failed "
            f"(epoch {result.old_epoch} -> {result.new_epoch})",
            file=sys.stderr,
            flush=True,
        )

    def on_watchdog_expire(self, reason: str) -> None:
        self.record(Kind.HANG, message=reason)
        # Only a member gives the job up: a spawned process not yet joined waited on the members,
        # who have deadlines of their own (its death aborts their join, if they are still in it).
        if f"phase {REJOIN_PHASE!r}" in reason and not self.s.joining and self.current_generation():
            # Every member is in the same join: the job as a whole is stuck (a spawned process
            # frozen in a stage no detector watches). The supervisor ends and relaunches it.
            write_abandoned(self.s.run_dir, reason)

    def give_up_join(self, reason: str) -> None:
        """A process this member's re-join spawned died or froze inside the join (``JoinWatch``):
        the members are held in a join stage that no revoke interrupts, so the job as a whole is
        given up now, for its supervisor to relaunch from node memory, not at the join deadline."""
        print(f"[nanotron-recover] rank {self.s.ftc.rank}: the re-join cannot complete: {reason}", flush=True)
        if not self.s.joining and self.current_generation():
            write_abandoned(self.s.run_dir, f"re-join: {reason}")

    def name_suspects(self, ranks: list[int], when: float) -> None:
        """Watch thread: processes failed. Name those of other hosts for the supervisor at once
        (``ft/suspects.py``). Also called while the main thread is inside an agreement
        (``FailureWatch.subscribe_during_agreement``): it only writes names."""
        s = self.s
        processes = list(getattr(s.ftc, "processes", None) or ())  # none before a spawned process joins
        # A process lost before the process table was gathered has no pid there: nothing to name.
        failed = [processes[r] for r in ranks if 0 <= r < len(processes) and processes[r].pid > 0]
        try:
            note_suspects(s.run_dir, failed, socket.gethostname())
        except OSError as e:
            rank = "?" if s.ftc is None else s.ftc.rank
            print(
                f"[nanotron-recover] rank {rank}: failed processes not named: {e}",
                file=sys.stderr,
                flush=True,
            )

    def on_failure_notice(self, ranks: list[int], when: float) -> None:
        """Watch thread: processes failed. Name them (:meth:`name_suspects`); and a member of my
        replica failed while I was outside MPI: my replica is lost."""
        s = self.s
        self.name_suspects(ranks, when)
        lost = sorted(s.my_replica_ranks.intersection(ranks))
        if not lost or s.joining or s.ftc.in_ft_operation or s.ftc.parked:
            return
        why = f"replica peer rank(s) {lost} failed during {s.phase}"
        if not s.rejoin_on:
            self.leave(Kind.PEER_ERROR, why)
        # Re-join keeps this rank: its torch world reports a crashed peer at once and the main
        # thread parks. One stuck on a frozen peer never returns from torch: it leaves after a grace.
        timer = threading.Timer(s.park_grace_s, self._leave_unless_parked, args=(why, s.ftc.epoch))
        timer.daemon = True
        timer.start()

    def _leave_unless_parked(self, why: str, epoch: int) -> None:
        # The survivors cannot shrink past this (alive) rank: while it has not parked, the epoch
        # stays where it was. A changed epoch means it parked (and perhaps re-joined) meanwhile.
        s = self.s
        if s.ftc.epoch == epoch and not (s.parking or s.ftc.parked or s.ftc.in_ft_operation):
            self.leave(Kind.PEER_ERROR, why + f"; not parked within {s.park_grace_s:.0f} s")

    # -- fences ------------------------------------------------------------------------------
    def _fence_path(self, info: ProcessInfo) -> Path:
        # Per process, not per rank: after a re-join the rank belongs to a new process.
        return fencing.removed_marker(self.s.run_dir, info.host, info.pid)

    def check_member(self) -> None:
        """Before writing shared files: a rank removed from the job (frozen, then woken up), or one
        of an older generation of a relaunched job (cut off, then reconnected), must not."""
        ftc = self.s.ftc
        if self._fence_path(ftc.processes[ftc.rank]).exists():
            fail_stop(f"rank {ftc.rank} was removed from the job; not writing")
        if not self.current_generation():
            fail_stop(
                f"rank {ftc.rank} holds fencing token {fencing.mine()} (generation {self.s.generation} "
                f"of a relaunched job); the run directory belongs to a newer job; not writing"
            )

    def current_generation(self) -> bool:
        """Whether this process still belongs to the job's current generation: its fencing token
        is the run directory's (``fencing.py``), and so is its relaunch count."""
        return fencing.is_current(self.s.run_dir) and read_generation(self.s.run_dir) == self.s.generation

    def fence(self, failed_ranks: tuple[int, ...]) -> None:
        """Mark removed processes so that one that wakes up later writes nothing (see check_member).
        A logger of an older generation (thawed after its job was relaunched) marks nothing: its
        markers would name processes of the current job, which the supervisor's watch and
        ``check_member`` read as removed."""
        if not self.is_logger() or not self.current_generation():
            return
        for r in failed_ranks:
            if self.s.ftc.processes[r].pid <= 0:
                continue  # lost before the process table was gathered: nothing known to fence
            try:
                path = self._fence_path(self.s.ftc.processes[r])
                path.parent.mkdir(exist_ok=True)
                path.touch()
            except OSError:
                pass

    # -- spawned processes ---------------------------------------------------------------------
    def watch_spawned_processes(self) -> None:
        """With re-join, look after the processes of this host that ULFM's heartbeat detector does
        not watch (see ``ft/liveness.py``): the spawned ones, and a launch rank left alone in its
        launch world once the others were replaced by spawned processes. A launch rank therefore
        starts its heartbeat file the moment it is alone (a spawned one beats from its start)."""
        s = self.s
        from mpi4py import MPI

        if MPI.Comm.Get_parent() == MPI.COMM_NULL:
            # Every launch rank beats for the supervisor, which removes a frozen one alone on its
            # node (frozen_processes.py); a spawned process beats from its start already.
            rank_heartbeat_file(s.run_dir, socket.gethostname(), os.getpid()).unlink(missing_ok=True)
            start_rank_heartbeat(s.run_dir, s.args.heartbeat_period_s)
        if s.rejoin_on:
            SpawnedMonitor(
                s.run_dir,
                s.args.heartbeat_period_s,
                s.args.heartbeat_timeout_s,
                lambda: s.ftc.processes,
                self._on_frozen_spawned,
            ).start()
            if MPI.Comm.Get_parent() == MPI.COMM_NULL:
                beat_once_alone(s.run_dir, s.args.heartbeat_period_s)
            # Once the launch's processes are all gone, the runtime reports no death to anyone;
            # between node-mates (shared memory) nothing else does (ft/death_notices.py).
            start_death_notices(s.args.heartbeat_period_s, lambda: s.ftc.processes)

    def _on_frozen_spawned(self, info: ProcessInfo, last_beat: float, age: float) -> None:
        """Monitor thread: a process of this host that ULFM does not watch is frozen. Write the
        record it cannot write (a hang, at its last heartbeat), then SIGKILL it: the runtime reports
        the death to every rank, and the recovery that follows logs the incident from the record."""
        message = f"rank {info.rank} (pid {info.pid} on {info.host}) sent no heartbeat for {age:.1f} s"
        # Its phase is this rank's when it found the freeze; its time, the last heartbeat.
        self.record(Kind.HANG, rank=info.rank, pid=info.pid, time=last_beat, message=message)
        print(f"[nanotron-recover] {message}: removing it", file=sys.stderr, flush=True)
        reap(info)

    def write_rank_table(self) -> None:
        """``<run_dir>/ranks.json``: host and pid of every rank, for operators (and tests); rewritten
        (atomically) when a re-join puts new processes in the grid."""
        ftc = self.s.ftc
        # A process lost before the table was first gathered is unknown (pid 0): left out, so that
        # nobody reading the table signals pid 0, which is their own process group.
        table = [
            {**info.as_dict(), "replica": ftc.topology.replica_of(info.rank)}
            for info in ftc.processes
            if info.pid > 0
        ]
        path = self.s.run_dir / "ranks.json"
        try:
            write_text_atomically(path, json.dumps(table, indent=1) + "\n")
        except OSError:
            pass
