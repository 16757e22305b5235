"""Hosts lost, on the job's own word: a frozen or cut-off node is relaunched without waiting for
Open MPI's runtime to give up on it.

A node that freezes (a kernel hang) or loses its link sends nothing. Inside the job, ULFM's
heartbeat detector declares its ranks failed within ``recover.heartbeat_timeout_s`` and the
survivors repair the step and go on; the incident is written at the next commit. Open MPI's
runtime (PRRTE 3.0.x) notices the node's daemon is gone only much later (35-39 s measured on the
emulated cluster) and then aborts the whole job anyway (docs/architecture.md, section 7). Waiting
for that abort costs the time between the two, with no step gained: the job is relaunched after
it either way.

So the supervisor reads the incidents as they are written (:class:`LostHostWatch`), and, sooner,
the processes a rank named failed the moment it learned it (``ft/suspects.py``: a survivor that
learns of a cut may wait for the link in the DP reduction, and commit nothing to write an incident
of, until the link is back). When a recovery lost ranks (``crash`` or ``hang``), or a rank named
a failed process, it probes the hosts those ranks ran on
(``hosts.HostPlan.answering``, all hosts at once so that the answering ones set how long the
silent one may take; bounded, ``host_probe.py``). A host that does not answer is lost: the
supervisor ends the job and relaunches it on the hosts that answer, from node memory, at once. A
rank that died or froze on a healthy node leaves its host answering: nothing happens, the in-step
repair (and a re-join) is all it costs. A probe that raises is said in one line and counts as no
host known lost: the job goes on, and Open MPI's runtime still ends it if the node is gone.

A cut-off process that no detector watches is named by nobody (no incident, no suspect): the
others wait for it in the DP reduction and commit nothing. So when no step has committed for a
while (``commit_deadline.CommitWatch.overdue``), :meth:`LostHostWatch.poll_stalled` probes the
hosts the job's ranks run on (the rank table), with the same consequence.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .failures import Kind
from .ft.suspects import clear_suspects, host_of, suspect_names

LOSS_KINDS = (Kind.CRASH, Kind.HANG)


class LostHostWatch:
    """Follows ``<run_dir>/incidents.jsonl``; :meth:`poll` names a lost host of a new incident."""

    def __init__(
        self,
        run_dir: str | Path,
        hosts: list[str],
        answering: Callable[[], list[str]],
        log: Callable[[str], None] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.hosts = list(hosts)
        self.answering = answering  # probes every host: those that answer
        self.log = log or (
            lambda line: print(f"nanotron-recover launch: {line}", file=sys.stderr, flush=True)
        )
        path = self.run_dir / "incidents.jsonl"
        self._offset = path.stat().st_size if path.exists() else 0  # earlier launches' incidents
        clear_suspects(self.run_dir)  # earlier launches' names: a pid they hold may be reused
        self._named: set[str] = set()
        self.lost: list[str] = []
        self.last_answering: list[str] | None = None  # the newest probe's answer, for the relaunch

    def poll(self) -> str | None:
        """A reason to end the job now (a host of a rank the job lost does not answer), or None."""
        hosts = {h for inc in self._new_incidents() for h in self._hosts_of(inc)} | self._newly_named()
        return self._probe(hosts, "of ranks the job lost")

    def poll_stalled(self) -> str | None:
        """The job commits no step: a reason to end it now (a host its ranks run on does not
        answer), or None. The hosts are those of the rank table (this launch's, rewritten by
        every re-join), so a host lost before this launch is not named again."""
        hosts = {str(r.get("host")) for r in self._table() if r.get("host") in self.hosts}
        return self._probe(hosts, "of the job", " while it commits no step")

    def _probe(self, hosts: set[str], whose: str, when: str = "") -> str | None:
        """Probe every host; name those of ``hosts`` (not named before) that do not answer."""
        suspects = sorted(hosts - set(self.lost))
        if not suspects:
            return None
        try:
            answer = list(self.answering())
        except Exception as e:
            self.log(
                f"probing hosts {', '.join(suspects)} failed ({type(e).__name__}: {e}): none counted lost"
            )
            return None
        self.last_answering = answer
        gone = [h for h in suspects if h not in answer]
        if not gone:
            return None
        self.lost += gone
        return f"hosts {', '.join(gone)} {whose} do not answer{when}"

    def _table(self) -> list[dict[str, Any]]:
        """The rank table ``ranks.json`` (empty when missing or unreadable)."""
        try:
            table = json.loads((self.run_dir / "ranks.json").read_text())
        except (OSError, ValueError):
            return []
        return [r for r in table if isinstance(r, dict)] if isinstance(table, list) else []

    def _newly_named(self) -> set[str]:
        """Hosts of processes a rank named failed since the last poll (``ft/suspects.py``): named
        the moment a rank learns of the failure, before the survivors commit the repair."""
        names = suspect_names(self.run_dir)
        new, self._named = names - self._named, self._named | names
        return {host_of(n) for n in new if host_of(n) in self.hosts}

    def _new_incidents(self) -> list[dict[str, Any]]:
        path = self.run_dir / "incidents.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        complete = data[: data.rfind(b"\n") + 1]  # a line being written waits for the next poll
        self._offset += len(complete)
        found = []
        for line in complete.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("kind") in LOSS_KINDS and record.get("failed_ranks"):
                found.append(record)
        return found

    def _hosts_of(self, incident: dict[str, Any]) -> set[str]:
        """The hosts the incident's failed ranks ran on, among the job's hosts.

        The incident names them (``failed_hosts``, read when the failure surfaced). The rank table
        is only the fallback for a record without them: a re-join that commits before this poll
        gives a failed rank's number to its replacement, and the table then names the
        replacement's host, which answers, instead of the lost one."""
        named = incident.get("failed_hosts")
        if isinstance(named, list) and named:
            return {str(h) for h in named if h in self.hosts}
        failed = set(incident["failed_ranks"])
        return {
            str(r.get("host"))
            for r in self._table()
            if r.get("rank") in failed and r.get("host") in self.hosts
        }
