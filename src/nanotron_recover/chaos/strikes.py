"""How a campaign strikes: the process at a victim's place now, a signal sent to it (and what
is recorded of it), a node fault. The campaign (``runner.py``) decides when; this decides whom
and how, and remembers what it froze."""

from __future__ import annotations

import hashlib
import signal
import time
from pathlib import Path
from typing import Any

from ..config import Config
from .schedule import PlannedFault, Victim
from .targets import RankProcess, Target, process_stopped
from .watch import RunWatch

# How each victim of a kind is struck, in order (the target may spare a process for one way and not
# another); a kind not named strikes with SIGKILL.
STRIKES: dict[str, tuple[str, ...]] = {
    "freeze": ("stop",),
    "kill_during_recovery": ("stop", "kill"),
    "node_power_off": ("node",),
    "link_cut": ("node",),
    "node_freeze": ("node",),
}
# What the report names a node fault's "signal" by: what the processes of the node get (a cut link
# sends them nothing; SIGHUP, the signal of a line that hung up, stands for it).
NODE_SIGNALS = {"node_power_off": signal.SIGKILL, "node_freeze": signal.SIGSTOP, "link_cut": signal.SIGHUP}


class Striker:
    def __init__(self, target: Target, watch: RunWatch, cfg: Config, run_dir: Path) -> None:
        self.target, self.watch, self.cfg, self.run_dir = target, watch, cfg, run_dir
        self.dp = cfg.parallelism.dp
        self.size = cfg.parallelism.replica_size
        self.stopped: list[int] = []  # pids this campaign SIGSTOPped
        self.last_signal_at: float | None = None

    def resolve(
        self, victim: Victim, exclude: set[int], notes: list[str], how: str = "kill"
    ) -> RankProcess | None:
        """The process at ``victim``'s place now, or at the same local rank of the next alive replica
        (also the next one when the target may not strike it ``how``: a cluster target spares the
        node that runs ``mpirun``)."""
        table = self.target.ranks()
        for i in range(self.dp):
            replica = (victim.replica + i) % self.dp
            if replica in exclude:
                continue
            proc = table.get(replica * self.size + victim.local_rank)
            if proc is not None and self.target.alive(proc) and not process_stopped(proc.pid):
                if not self.target.can_strike(proc, how):
                    notes.append(f"replica {replica} on {proc.host}: the target spares it ({how})")
                    continue
                if i:
                    notes.append(f"replica {victim.replica} was down or spared: struck replica {replica}")
                return proc
        notes.append(f"no alive replica to strike for {victim}")
        return None

    def signal(self, record: dict[str, Any], proc: RankProcess | None, sig: int, **extra: Any) -> bool:
        if proc is None:
            return False
        ok = self.target.signal(proc, sig)
        at = time.time()
        record["signals"].append(
            {
                "sig": int(sig),
                "rank": proc.rank,
                "replica": proc.replica,
                "pid": proc.pid,
                "host": proc.host,
                "at": at,
                "sent": ok,
                "step": self.watch.last_step + 1,
                **extra,
            }
        )
        if ok:
            self.last_signal_at = at
            if sig == signal.SIGSTOP:
                self.stopped.append(proc.pid)
        return ok

    def victims(self, fault: PlannedFault, record: dict[str, Any]) -> list[RankProcess | None]:
        procs: list[RankProcess | None] = []
        exclude: set[int] = set()
        hows = STRIKES.get(fault.kind, ())
        for n, victim in enumerate(fault.victims):
            proc = self.resolve(victim, exclude, record["notes"], hows[n] if n < len(hows) else "kill")
            procs.append(proc)
            if proc is not None and proc.replica is not None:
                exclude.add(proc.replica)
        return procs

    def node_fault(self, fault: PlannedFault, record: dict[str, Any]) -> None:
        """A node kind: the node of the drawn rank, struck by the target (which restores it later)."""
        (proc,) = self.victims(fault, record)
        if proc is None:
            return
        at = time.time()  # power off waits until the node's processes are gone: the fault began here
        found = self.target.node_fault(fault.kind, proc)
        record["signals"].append(
            {
                "sig": int(NODE_SIGNALS[fault.kind]),
                "rank": proc.rank,
                "replica": proc.replica,
                "pid": proc.pid,
                "at": at,
                "sent": found is not None,
                "step": self.watch.last_step + 1,
                "node": proc.host,
                "node_action": fault.kind,
                "node_pids": found or [],
            }
        )
        if found is not None:
            self.last_signal_at = at

    def unpublished_slot(self, proc: RankProcess) -> bool:
        """Whether one of ``proc``'s node-memory snapshot slots is being written (no
        ``published.json`` in it): ``<snapshot.dir>/<run id>-<hash of the run dir>/c<local>/r<replica>``."""
        if proc.rank is None or proc.replica is None:
            return False
        where = hashlib.sha256(str(self.run_dir.resolve()).encode()).hexdigest()[:8]
        # Seen from the rank's own mount namespace: an emulated node's /dev/shm is its own.
        root = Path(f"/proc/{proc.pid}/root") / Path(self.cfg.recover.snapshot.dir).relative_to("/")
        mine = f"c{proc.rank % self.size}/r{proc.replica}"
        for run_root in root.glob(f"*-{where}"):
            for slot in (run_root / mine).glob("slot*"):
                if not (slot / "published.json").exists():
                    return True
        return False
