"""The hosts a job may run on, which of them still answer, and the relaunch's ``mpirun`` line.

Under Slurm the job's hosts are its allocation (``SLURM_JOB_NODELIST``; the job script asks for
``--no-kill``, so the allocation outlives a lost node). A host answers when Slurm does not mark it
down and a one-task step on it (``srun --overlap``) starts within a deadline. The hosts are
probed at once. A lost node that Slurm does not yet mark down (that takes ``SlurmdTimeout``, often
minutes) never answers, so the probe does not wait for it long: once some host answered, the
others get ``PROBE_SLACK`` times as long as the slowest answer so far took (at least
``PROBE_MIN_S``, at most ``PROBE_TIMEOUT_S`` in all). A busy controller slows every answer alike,
and the wait grows with it.

A relaunched ``mpirun`` is told the answering hosts with as many slots each as the job placed per
node (``--host a:R,b:R``, ``R`` from ``--map-by ppr:R:node``), and ``plm_slurm_args --overlap``: the
previous job's step that started the runtime's daemons never ends (its lost node cannot confirm),
and without ``--overlap`` the new daemons would wait for its resources forever. When the answering
hosts hold fewer ranks than the job had, it is relaunched narrower (:func:`relaunch_ranks`): whole
replicas only, the same ``B`` shared by fewer.

Outside Slurm (one host, or ``mpirun`` with a hostfile) there is nothing to probe: the job is
relaunched as it was.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

PROBE_TIMEOUT_S = 15.0
PROBE_MIN_S = 2.0
PROBE_SLACK = 4.0
# sinfo's short states of a node that cannot run a job (a trailing * means "not responding").
DEAD_STATES = ("down", "drain", "drng", "fail", "failg", "maint", "boot", "powered_down", "pow_dn")


@dataclass
class HostPlan:
    hosts: list[str]  # every host of the allocation, in order

    @classmethod
    def from_slurm(cls) -> HostPlan | None:
        """The hosts of the Slurm job this process runs in, or None outside Slurm."""
        nodelist = os.environ.get("SLURM_JOB_NODELIST")
        if not nodelist or shutil.which("scontrol") is None:
            return None
        try:
            out = subprocess.run(
                ["scontrol", "show", "hostnames", nodelist],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return None
        hosts = out.split()
        return cls(hosts) if hosts else None

    def answering(self) -> list[str]:
        """The hosts Slurm does not mark down and that start a probe step within the deadline."""
        states = self._states()
        alive = [h for h in self.hosts if not _dead(states.get(h, ""))]
        if not alive:
            return []
        ok: set[str] = set()
        pool = ThreadPoolExecutor(max_workers=min(32, len(alive)))
        try:
            pending = {pool.submit(self._probe, h): h for h in alive}
            start = time.monotonic()
            limit = start + PROBE_TIMEOUT_S
            deadline = limit
            while pending and time.monotonic() < deadline:
                done, _ = wait(pending, timeout=deadline - time.monotonic(), return_when=FIRST_COMPLETED)
                for future in done:
                    if future.result():
                        ok.add(pending[future])
                        # The slowest answer so far sets how long the rest may take.
                        took = time.monotonic() - start
                        deadline = min(limit, start + max(PROBE_MIN_S, PROBE_SLACK * took))
                    del pending[future]
        finally:
            # A probe of a lost host ends at its own timeout, in the background.
            pool.shutdown(wait=False, cancel_futures=True)
        return [h for h in alive if h in ok]

    def _states(self) -> dict[str, str]:
        try:
            out = subprocess.run(
                ["sinfo", "-h", "-N", "-n", ",".join(self.hosts), "-o", "%N %t"],
                capture_output=True,
                text=True,
                timeout=PROBE_TIMEOUT_S,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            return {}
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    @staticmethod
    def _probe(host: str) -> bool:
        cmd = ["srun", "--overlap", "-N", "1", "-n", "1", "-w", host, "--time", "1", "true"]
        try:
            return subprocess.run(cmd, capture_output=True, timeout=PROBE_TIMEOUT_S).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def _dead(state: str) -> bool:
    state = state.lower()
    return state.endswith("*") or any(state.startswith(d) for d in DEAD_STATES)


def slots_per_host(cmd: list[str]) -> int:
    """The ranks ``cmd`` places on each node (``--map-by ppr:R:node``), 1 when it does not say."""
    for i, a in enumerate(cmd[:-1]):
        if a == "--map-by":
            m = re.match(r"ppr:(\d+):node", cmd[i + 1])
            if m:
                return int(m.group(1))
    return 1


def ranks_of(cmd: list[str]) -> int | None:
    """``cmd``'s ``-n``/``-np`` value, None when it has none."""
    for i, a in enumerate(cmd[:-1]):
        if a in ("-n", "-np", "--np"):
            return int(cmd[i + 1])
    return None


def relaunch_ranks(cmd: list[str], hosts: list[str], replica_size: int) -> int:
    """How many ranks a relaunch of ``cmd`` on ``hosts`` runs: as many as before when the hosts
    hold them, else the whole replicas that fit (possibly 0)."""
    room = len(hosts) * slots_per_host(cmd)
    before = ranks_of(cmd)
    fit = room // replica_size * replica_size
    return fit if before is None else min(before, fit)


def relaunch_command(cmd: list[str], hosts: list[str], ranks: int | None = None) -> list[str]:
    """``cmd`` (an ``mpirun`` line) restricted to ``hosts`` (as many slots on each as ``cmd``
    placed per node) and, when given, to ``ranks`` ranks; with the overlap a relaunch inside the
    same Slurm allocation needs."""
    if not cmd or not os.path.basename(cmd[0]).startswith("mpirun"):
        return cmd
    slots = slots_per_host(cmd)
    extra = ["--host", ",".join(f"{h}:{slots}" for h in hosts), "--prtemca", "plm_slurm_args", "--overlap"]
    rest = _without_host(cmd[1:])
    if ranks is not None:
        for i, a in enumerate(rest[:-1]):
            if a in ("-n", "-np", "--np"):
                rest = [*rest[: i + 1], str(ranks), *rest[i + 2 :]]
                break
    return [cmd[0], *extra, *rest]


def _without_host(args: list[str]) -> list[str]:
    """An earlier relaunch's host restriction does not carry over to the next one."""
    out, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a == "--host":
            skip = 1
            continue
        if a == "--prtemca" and args[i + 1 : i + 2] == ["plm_slurm_args"]:
            skip = 2
            continue
        out.append(a)
    return out
