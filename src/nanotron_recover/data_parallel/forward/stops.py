"""Stops: how the whole job ends once, uniformly, when going on cannot help.

A fault that is not a replica failure -- a full disk when saving, a deterministic error -- stops
the whole job once. The rank that meets it requests a stop (:meth:`Stops.request`); the request
rides on the next global agree as a bit (the agree is a bitwise AND, so a rank that clears a bit
stops everyone after the same step); every survivor learns it from the same agree, and
:data:`~nanotron_recover.failures.STOP_ORDER` picks one kind when several are agreed at once.

After a failure, the survivors judge the failure records once (:meth:`Stops.after_failure`):
records of an unrepairable kind (``io``, ``deterministic``) stop the job; fewer replicas than
``recover.min_replicas`` stop it too, after the checkpoint writer saved the last committed step
synchronously (that checkpoint resumes in either mode; exit 3 only when that save succeeded,
otherwise 1).

No replica left at all (:meth:`Stops.no_replica_left`) is a lost job, not a stop for too few
replicas: there is no replica to save from and nobody to agree with. The lowest rank still running
records it (kind ``all_replicas_lost``, the last committed step, exit 1) and every rank still
running exits 1; node-memory snapshots are kept, since the supervisor relaunches a lost job as it
would one that left no record.

The parts never exit themselves: they raise :class:`StopJob`, and the mode turns it into the exit
(:meth:`Stops.exit`): the message is known only where the cause was met, one allgather gives it
to everyone, the logging rank records ``outcome.json`` and says it in one line, and every rank
exits with its status once the checkpoint and the outcome are on disk.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from ...errors import StopRun
from ...failures import UNREPAIRABLE_KINDS, Kind, first_stop, stop_bit
from ...ft.world import AllReplicasFailed, RecoveryResult, WorldChanged
from ...outcome import SUPERVISED_ENV
from .incidents import Incident, Incidents
from .members import Members
from .rank_state import RankState


class StopJob(BaseException):
    """The whole job stops after ``last_step``. A ``BaseException``: control flow up to the mode,
    which no ``except Exception`` on the way may take for an error of its own.

    ``save``: the checkpoint writer saves ``last_step`` first (too few replicas). ``known``: this
    rank met the cause (a stop agreed in a step agree carries only its kind). ``announce``: parked
    ranks must still learn of it from an agree. ``lost``: the recovery that left no replica alive
    (the job is lost: see :meth:`Stops.no_replica_left`)."""

    def __init__(
        self,
        last_step: int,
        stop: StopRun,
        save: bool = False,
        known: bool = True,
        announce: bool = True,
        lost: RecoveryResult | None = None,
    ):
        super().__init__(stop.message)
        self.last_step, self.stop, self.save, self.known, self.announce = (
            last_step,
            stop,
            save,
            known,
            announce,
        )
        self.lost = lost

    @property
    def job_lost(self) -> bool:
        """No replica is left: the job may be relaunched (its node-memory snapshots must stay)."""
        return self.lost is not None

    @property
    def relaunched(self) -> bool:
        """The job will be relaunched from its node-memory snapshots: they must stay."""
        return self.job_lost or self.stop.kind == Kind.REGROW


class Stops:
    def __init__(self, state: RankState, members: Members, incidents: Incidents):
        self.s, self.members, self.incidents = state, members, incidents
        self.pending: StopRun | None = None

    # -- requests and agreed stops -------------------------------------------------------------
    def request(self, stop: StopRun) -> None:
        """Stop the whole job at the next agree (the first request wins)."""
        if self.pending is None:
            self.pending = stop

    def bits(self) -> int:
        """This rank's stop request, as the bit it clears in the next agree."""
        return 0 if self.pending is None else stop_bit(self.pending.kind)

    def agreed(self, bits: int, last_step: int) -> StopJob:
        """The stop every survivor agreed on; the message is known only where it was requested."""
        kind = first_stop(bits)
        if self.pending is not None and self.pending.kind == kind:
            stop = self.pending
        else:
            stop = StopRun(kind, f"stop requested by another replica ({kind})")
        return StopJob(last_step, stop, known=False, announce=False)

    @staticmethod
    def no_replica_left(last_step: int, gone: AllReplicasFailed) -> StopJob:
        """Every replica failed: the job is lost after ``last_step`` (exit 1, nothing saved)."""
        failed = list(gone.result.failed_replicas)
        why = f"every replica lost (failed replicas {failed}); nothing saved after the last checkpoint"
        return StopJob(last_step, StopRun(Kind.ALL_REPLICAS_LOST, why), announce=False, lost=gone.result)

    def writes_lost_record(self, lost: RecoveryResult) -> bool:
        """Whether this rank records a lost job: the lowest rank still running. Every rank still
        running computes the same answer from the recovery that every one of them committed
        (the members before it, less the ranks it found failed)."""
        ftc = self.s.ftc
        running = sorted(set(ftc.members) - set(lost.failed_ranks))
        return bool(running) and ftc.rank == running[0]

    # -- the verdict after a failure -----------------------------------------------------------
    def after_failure(
        self, last_step: int, records: list[dict], unlogged: list[Incident], check_width: bool = True
    ) -> None:
        """Raise :class:`StopJob` if the failure just repaired must end the job: a record of an
        unrepairable kind, or (``check_width``) fewer than ``recover.min_replicas`` replicas left.
        The incidents not yet logged are logged first."""
        s = self.s
        stopping = [r for r in records if r["kind"] in UNREPAIRABLE_KINDS]
        if stopping:
            self.incidents.write(unlogged)
            first = stopping[0]
            raise StopJob(last_step, StopRun(first["kind"], first.get("message", first["kind"])))
        alive, least = len(s.ftc.alive_replicas), s.args.min_replicas
        if check_width and alive < least:
            self.incidents.write(unlogged)
            why = f"{alive} replicas left, below recover.min_replicas={least}"
            raise StopJob(last_step, StopRun(Kind.TOO_FEW_REPLICAS, why), save=True)

    # -- ending ------------------------------------------------------------------------------
    def end_with(self, last_step: int, stop: StopRun) -> None:
        """Record a stop and say it once: here, unless a supervising launcher will print the record."""
        recorded = self.s.parts.write_outcome("stopped", last_step, stop)
        if not (recorded and os.environ.get(SUPERVISED_ENV) == "1"):
            print(
                f"nanotron-recover: stopped after step {last_step}: {stop.message}",
                file=sys.stderr,
                flush=True,
            )

    def exit(self, job: StopJob) -> NoReturn:
        """Stop the whole job: every survivor gets here after the same agree or recovery."""
        s, stop = self.s, job.stop
        if job.lost is not None:
            # Nobody is left to agree with, or to save from: the lowest rank still running says it.
            if self.writes_lost_record(job.lost):
                self.end_with(job.last_step, stop)
            self._leave_job(int(stop.exit_code))
        if job.announce and s.rejoin_on:
            # Parked ranks learn of a stop the active ranks decided on their own from an agree.
            while True:
                try:
                    s.ftc.agree(True, stop=stop_bit(stop.kind), kind="stop")
                    break
                except WorldChanged:
                    continue
                except AllReplicasFailed:
                    break
        message = stop.message
        knows_cause = self.pending is not None and self.pending.kind == stop.kind
        # A stop agreed in the step agree (known=False) carries only its kind: the message is with the
        # rank(s) that requested it, and must not be replaced by this rank's placeholder.
        knows_cause = knows_cause or (job.known and stop.kind in UNREPAIRABLE_KINDS)
        unsaved = False
        if job.save and self.members.is_checkpoint_writer():
            knows_cause = True
            try:
                path = s.parts.save(job.last_step, True)
                message += (
                    f". Saved step {job.last_step} to {path}; resume it in plain or recover mode with "
                    "checkpoints.resume_checkpoint_path"
                )
            except Exception as e:
                unsaved = True  # exit 1, not 3: the last committed step is not checkpointed
                message += f". Could not save step {job.last_step}: {' '.join(str(e).split())}"
        try:
            # (message, save failed) of every rank: the message where the cause is known, and
            # whether any checkpoint writer failed, so every rank exits with the same status.
            known = s.ftc.global_comm.allgather((message if knows_cause else None, unsaved))
            entries = [k for k in known if isinstance(k, tuple)]
            message = next((m for m, _ in entries if m), message)
            unsaved = unsaved or any(u for _, u in entries)
        except Exception:
            pass  # a failure now: keep what this rank knows
        stop = StopRun(stop.kind, message, unsaved=unsaved)
        if self.members.is_logger():
            self.end_with(job.last_step, stop)
        self._leave_job(int(stop.exit_code))

    def complete(self, last_step: int) -> None:
        """Every requested step is committed: the logging rank records it."""
        if self.members.is_logger():
            self.members.check_member()
            self.s.parts.write_outcome("completed", last_step, None)

    def close(self) -> NoReturn:
        """End of training: wait for every survivor, then leave without MPI_Finalize.

        Finalize in a world that lost processes can block on connections to the dead, and with the
        heartbeat detector on it blocked even without a failure (Open MPI 5.0.11); exit status 0
        without finalize is reported cleanly to mpirun. The barrier makes sure nobody leaves while
        a peer still needs it (a checkpoint being written, a last reduction)."""
        self._leave_job(0)

    def _leave_job(self, status: int) -> NoReturn:
        s = self.s
        s.watchdog.stop()
        s.ftc.stop_watch()
        try:
            s.ftc.barrier()  # nobody exits before the checkpoint and the outcome are on disk
        except Exception as e:
            if status == 0:
                print(f"[nanotron-recover] rank {s.ftc.rank}: final barrier failed: {e}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
