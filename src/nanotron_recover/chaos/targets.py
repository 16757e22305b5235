"""Where a chaos campaign's signals go: the rank processes of the running job.

A :class:`Target` answers three questions for the runner: which process holds each rank now
(:meth:`~Target.ranks`), which processes of the job are not in the grid yet (a re-join's spawned
replacements, a relaunched job starting: :meth:`~Target.unlisted`), and it sends a signal to one of
them (:meth:`~Target.signal`). The runner never signals a pid it did not get from the target.

:class:`LocalTarget` is the one-host target. Ranks record themselves in the run directory: the
logging rank writes ``<run_dir>/ranks.json`` (rank, replica, host, pid) at start and rewrites it
when a re-join puts new processes in the grid. A pid from that table is signalled only if it is
still a process of *this* job: a descendant of the ``launch`` process the runner started whose
command line runs ``nanotron_recover.cli train`` on this run directory (a recycled pid, or a
process of another job, is never touched). :meth:`LocalTarget.end_job` ends the job the same way,
only the launch process's group and its descendants.

A cluster target implements the same interface for ranks on many nodes, and also the node-level
kinds (power, link, freeze of a node, :data:`.kinds.NODE_KINDS`) through :meth:`Target.node_fault`;
it may spare some processes (:meth:`Target.can_strike`: the node running ``mpirun`` and the job
script, a single point of failure) and restore struck nodes later (:meth:`Target.tick`, called by
the runner while it waits). The one for the emulated Slurm cluster is test infrastructure, next to
the emulation: ``tests/helpers/chaos_cluster.py``; the runner takes it through its
``target_factory`` and starts the job with the command the campaign options give
(``CampaignOptions.launch_cmd``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from .kinds import KINDS


@dataclass(frozen=True)
class RankProcess:
    """One process of the job: its logical rank (None when not in the grid yet), replica, host, pid."""

    rank: int | None
    replica: int | None
    host: str
    pid: int


class Target(ABC):
    """The job's processes, and a way to signal them."""

    name: str = "target"

    @abstractmethod
    def ranks(self) -> dict[int, RankProcess]:
        """Logical rank -> the process that holds it now (empty before the rank table exists)."""

    @abstractmethod
    def unlisted(self) -> list[RankProcess]:
        """Live training processes of the job that the rank table does not name (spawned by a
        re-join and not joined yet, or a relaunched job's ranks before their table)."""

    @abstractmethod
    def alive(self, proc: RankProcess) -> bool:
        """Whether ``proc`` still runs (not exited, not a zombie)."""

    @abstractmethod
    def signal(self, proc: RankProcess, sig: int) -> bool:
        """Send ``sig`` to ``proc`` if it is still a process of this job; whether it was sent."""

    def supports(self, kind: str) -> bool:
        """Whether this target can send ``kind``: local targets send every kind but the node-level ones."""
        return not KINDS[kind].node_level

    def can_strike(self, proc: RankProcess, how: str) -> bool:
        """Whether the runner may strike ``proc`` this way (``kill``, ``stop``, or ``node``: a fault
        of its whole node); when not, it strikes the next replica instead. Every way, by default."""
        return True

    def node_fault(self, kind: str, proc: RankProcess) -> list[int] | None:
        """Send node kind ``kind`` to the node of ``proc``; the pids of the node it struck, or None
        when it could not. Only targets whose :meth:`supports` says so implement it."""
        raise NotImplementedError(f"{self.name} target cannot send {kind}")

    def tick(self) -> None:
        """Called by the runner whenever it polls the job: a target with delayed work (a node to
        power on again) does it here. Nothing by default."""
        return None

    @abstractmethod
    def end_job(self) -> list[int]:
        """SIGKILL every process of the job (after a hang); the pids signalled."""


# -- /proc --------------------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def process_alive(pid: int) -> bool:
    """``pid`` exists and is neither a zombie nor dead."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def process_stopped(pid: int) -> bool:
    """``pid`` is stopped (SIGSTOP: state T)."""
    stat = _stat(pid)
    return stat is not None and stat[0] in ("T", "t")


def descendants(root: int) -> list[int]:
    """Every live process below ``root``, read from /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        stat = _stat(int(entry))
        if stat is not None:
            children.setdefault(stat[1], []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


class LocalTarget(Target):
    """The ranks of a job started on this host by the runner (``launch`` as process ``root_pid``)."""

    name = "local"

    def __init__(self, run_dir: str | Path, root_pid: int):
        self.run_dir = Path(run_dir).resolve()
        self.root_pid = root_pid
        self.host = socket.gethostname()

    def _is_rank_process(self, pid: int, below: set[int] | None = None) -> bool:
        below = set(descendants(self.root_pid)) if below is None else below
        if pid not in below or not process_alive(pid):
            return False
        argv = _cmdline(pid)
        # A Python process running train on this run dir (mpirun's own command line names them too).
        return (
            bool(argv)
            and Path(argv[0]).name.startswith("python")
            and "nanotron_recover.cli" in argv
            and "train" in argv
            and str(self.run_dir) in " ".join(argv)
        )

    def job_processes(self) -> list[int]:
        """Pids of the job's live training processes (ranks, spawned replacements)."""
        below = set(descendants(self.root_pid))
        return sorted(p for p in below if self._is_rank_process(p, below))

    def ranks(self) -> dict[int, RankProcess]:
        try:
            table = json.loads((self.run_dir / "ranks.json").read_text())
        except (OSError, ValueError):
            return {}
        found = {}
        for row in table if isinstance(table, list) else []:
            try:
                found[int(row["rank"])] = RankProcess(
                    int(row["rank"]), int(row["replica"]), str(row.get("host", "")), int(row["pid"])
                )
            except (KeyError, TypeError, ValueError):
                continue
        return found

    def unlisted(self) -> list[RankProcess]:
        listed = {p.pid for p in self.ranks().values()}
        return [RankProcess(None, None, self.host, pid) for pid in self.job_processes() if pid not in listed]

    def alive(self, proc: RankProcess) -> bool:
        return process_alive(proc.pid)

    def signal(self, proc: RankProcess, sig: int) -> bool:
        if proc.host and proc.host != self.host:
            return False  # a local target reaches this host only
        if not self._is_rank_process(proc.pid):
            return False
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def end_job(self) -> list[int]:
        below = descendants(self.root_pid)
        try:
            os.killpg(self.root_pid, signal.SIGKILL)  # launch runs in a session (and group) of its own
        except (ProcessLookupError, PermissionError):
            pass
        for pid in below:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return below
