"""Incidents: what failed, what it cost, written once to ``<run_dir>/incidents.jsonl`` and W&B.

A recovery becomes an :class:`Incident` on every survivor alike; the logging rank writes it when the
step commits (or at once when the job stops or the failure came between steps). Its ``kind`` comes
from the failure records of the ranks that failed (``ft/records.py``) and, for ranks that left
none, from the communicator: ``hang`` if the rank was still running on a survivor's host, else
``crash``; :data:`~nanotron_recover.failures.INCIDENT_PRIORITY` picks one kind for the incident.

``detect_s``: from the failure to the first survivor that saw it surface in MPI. The time of the
failure is the failed rank's record when it left one (injected faults, watchdog, errors:
``detect_method: record``); otherwise (a process killed or frozen from outside) it is the moment
the first survivor began the operation that then failed (``first_wait``). Both come from the
per-replica views reduced in the step's bookkeeping vector. ``recover_s``: from this survivor
noticing to the commit, minus ``redo_s``, the time spent recomputing lost micro-batches.

Re-join incidents (kind ``rejoin``: joined, failed, given up) wait for the next commit: the logging
rank may be the one a failed join lost, and its successor is known only then.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ...failures import Kind, Phase, incident_kind
from ...ft.records import read_records
from ...ft.world import RecoveryResult
from ...generation import Relaunch
from ...logging import IncidentLog
from .members import Members
from .rank_state import RankState


@dataclass
class Incident:
    step: int
    phase: str
    kind: Kind
    result: RecoveryResult
    action: str
    lost_ids: list[int]
    extra_microbatches: int
    noticed: float  # perf_counter when this survivor learned of the failure
    failed_at: float | None  # wall clock of the failure, from a failure record
    compute_s: float = 0.0  # redone micro-batches after noticing (excluded from recover_s)
    # The hosts the failed ranks ran on, read when the failure surfaced: a re-join later gives a
    # failed rank's number to its replacement on another host, so the rank table is no longer
    # the place to look (the supervisor probes these hosts, ``lost_hosts.py``).
    failed_hosts: list[str] = field(default_factory=list)


class Incidents:
    def __init__(self, state: RankState, members: Members):
        self.s, self.members = state, members
        self.log_file = IncidentLog(state.run_dir / "incidents.jsonl")
        self.rejoin_records: list[dict[str, Any]] = []

    # -- classification ------------------------------------------------------------------------
    def of_recovery(
        self,
        step: int,
        result: RecoveryResult,
        action: str = "none",
        lost: list[int] | None = None,
        extra: int = 0,
    ) -> tuple[Incident, list[dict]]:
        """The incident of one recovery, and the failure records of the ranks it lost."""
        s = self.s
        # A process lost before the process table was gathered is unknown (pid 0, no host).
        known = [s.ftc.processes[r] for r in result.failed_ranks if s.ftc.processes[r].pid > 0]
        pids = {p.rank: p.pid for p in known}
        hosts = sorted({p.host for p in known})
        records = read_records(s.run_dir, list(result.failed_ranks), since=s.started, pids=pids)
        causes = [r for r in records if r["kind"] != Kind.PEER_ERROR]
        kinds = {r["kind"] for r in records}
        unrecorded = set(result.failed_ranks) - {r["rank"] for r in records}
        if unrecorded & set(result.hung_ranks):
            kinds.add(Kind.HANG)
        elif unrecorded:
            kinds.add(Kind.CRASH)
        incident = Incident(
            step=step,
            phase=causes[0]["phase"] if causes else (records[0]["phase"] if records else result.trigger),
            kind=incident_kind(kinds),
            result=result,
            action=action,
            lost_ids=lost or [],
            extra_microbatches=extra,
            noticed=time.perf_counter(),
            failed_at=min(r["time"] for r in causes) if causes else None,
            failed_hosts=hosts,
        )
        return incident, records

    def met_elsewhere(self, signature: str, ids: list[int]) -> dict | None:
        """The record of another replica that raised the same exception on one of ``ids``: then the
        error is deterministic, and redoing it elsewhere cannot help."""
        s = self.s
        for earlier in read_records(s.run_dir, since=s.started):
            if (
                earlier.get("replica") != s.ftc.replica
                and earlier.get("error") == signature
                and set(earlier.get("ids") or ()) & set(ids)
            ):
                return earlier
        return None

    # -- writing -----------------------------------------------------------------------------
    def _detect(self, inc: Incident) -> tuple[float | None, str]:
        """(detect_s, method) of an incident, from the per-replica views reduced in the bookkeeping."""
        s, alive = self.s, self.s.ftc.alive_replicas
        if inc.phase == Phase.START:  # repaired before the step: the step's views are not its own
            began, surfaced = [inc.result.detected_at - inc.result.detect_s], [inc.result.detected_at]
            if inc.failed_at is not None:
                return max(0.0, surfaced[0] - inc.failed_at), "record"
            return max(0.0, surfaced[0] - began[0]), "first_wait"
        began = [float(s.bookkeeping[2 * s.B + r]) for r in alive]
        surfaced = [float(s.bookkeeping[2 * s.B + s.W + r]) for r in alive]
        began = [b for b in began if b > 0] or [inc.result.detected_at - inc.result.detect_s]
        surfaced = [t for t in surfaced if t > 0] or [inc.result.detected_at]
        if inc.failed_at is not None:
            return max(0.0, min(surfaced) - inc.failed_at), "record"
        return max(0.0, min(surfaced) - min(began)), "first_wait"

    def write(self, incidents: list[Incident], committed: float | None = None) -> None:
        """Write these incidents (the logging rank only) and forget them."""
        committed = time.perf_counter() if committed is None else committed
        incidents, taken = list(incidents), incidents
        taken.clear()
        if not self.members.is_logger():
            return
        self.members.check_member()
        for inc in incidents:
            r = inc.result
            detect_s, method = self._detect(inc)
            record = {
                "step": inc.step,
                "phase": inc.phase,
                "kind": inc.kind,
                "failed_replicas": list(r.failed_replicas),
                "failed_ranks": list(r.failed_ranks),
                "failed_hosts": list(inc.failed_hosts),
                "hung_ranks": list(r.hung_ranks),
                "epoch": r.new_epoch,
                "action": inc.action,
                "lost_ids": inc.lost_ids,
                "extra_microbatches": inc.extra_microbatches,
                "detect_s": detect_s,
                "detect_method": method,
                "recover_s": max(0.0, committed - inc.noticed - inc.compute_s),
                "redo_s": inc.compute_s,
                "shrink_s": r.shrink_s,
                "rounds": r.rounds,
                "alive_replicas": list(r.alive_replicas),
            }
            self._append(record)
            self.s.parts.write_line(
                f"[nanotron-recover] step {inc.step}: replicas {record['failed_replicas']} failed "
                f"({inc.kind} in {inc.phase}), {inc.action}, {inc.extra_microbatches} micro-batches redone, "
                f"epoch {r.new_epoch}"
            )

    def _append(self, record: dict[str, Any]) -> None:
        try:
            self.log_file.write(record)
        except OSError as e:
            print(f"[nanotron-recover] incident not logged: {e}", file=sys.stderr, flush=True)
        self.s.parts.log_incident(record)

    # -- relaunch incidents --------------------------------------------------------------------
    def relaunched(
        self, first_step: int, relaunch: Relaunch, state_from: str, restored_at: float | None = None
    ) -> None:
        """The relaunch this job is (a lost node, or every replica lost), written by the logging
        rank once the job committed its first step: ``restart_s`` runs from the end of the previous
        job (its mpirun's exit) to this commit, in parts: ``cleanup_s`` (its leftovers ended),
        ``probe_s`` (which hosts answer; started at the job's end, it overlaps ``cleanup_s``, and
        the relaunch waits for the longer of the two), ``start_s`` (the new job started, up to its
        state restored from node snapshots or the disk checkpoint chosen) and ``first_step_s`` (the
        rest, up to the commit). The steps after the restored one were redone with the same ids."""
        if not self.members.is_logger():
            return
        self.members.check_member()
        restored = first_step - 1
        now = time.time()
        launched = relaunch.launched_at or relaunch.ended_at
        restored_at = restored_at or launched
        record = {
            "step": first_step,
            "kind": relaunch.cause,
            "generation": relaunch.generation,
            "hosts_lost": relaunch.hosts_lost,
            "hosts": relaunch.hosts,
            "restart_s": max(0.0, now - relaunch.ended_at),
            "cleanup_s": relaunch.cleanup_s,
            "probe_s": relaunch.probe_s,
            "start_s": max(0.0, restored_at - launched),
            "first_step_s": max(0.0, now - restored_at),
            "state_from": state_from,
            "restored_step": restored,
            "steps_redone": max(0, relaunch.last_committed - restored),
            "alive_replicas": self.s.ftc.alive_replicas,
        }
        self._append(record)
        lost = {
            Kind.STALLED: "no step committed within the deadline",
            Kind.REGROW: "to regrow to full width",
        }.get(relaunch.cause, "every replica lost")
        if relaunch.hosts_lost:
            lost = f"hosts {relaunch.hosts_lost} lost"
        self.s.parts.write_line(
            f"[nanotron-recover] step {first_step}: relaunched ({lost}) from the {state_from} of step "
            f"{restored} in {record['restart_s']:.1f} s; {record['steps_redone']} steps redone"
        )

    # -- re-join incidents ---------------------------------------------------------------------
    def rejoin(self, step: int, fields: dict[str, Any]) -> None:
        """A ``rejoin`` incident (joined, failed or given up), written at the next commit."""
        self.rejoin_records.append({"step": step, "kind": Kind.REJOIN, **fields})

    def flush_rejoins(self) -> None:
        records, self.rejoin_records = self.rejoin_records, []
        if self.members.is_logger():
            for record in records:
                self._write_rejoin(record)

    def _write_rejoin(self, fields: dict[str, Any]) -> None:
        step = fields["step"]
        record = {**fields, "alive_replicas": self.s.ftc.alive_replicas}
        self._append(record)
        if fields["status"] == "joined":
            line = (
                f"replicas {record['replicas']} re-joined after step {step}: {len(record['spawned_ranks'])} "
                f"spawned, {len(record['orphans_reused'])} reused, {record['state_bytes'] / 2**20:.1f} MiB in "
                f"{record['transfer_s']:.2f} s; {len(self.s.ftc.alive_replicas)} replicas"
            )
        else:
            line = f"re-join of replicas {record['replicas']} {fields['status'].replace('_', ' ')}: {fields.get('reason', '')}"
        self.s.parts.write_line(f"[nanotron-recover] step {step}: {line}")
