"""The hosts a job may run on, which of them still answer, and the relaunch's ``mpirun`` line.

Under Slurm the job's hosts are its allocation (``SLURM_JOB_NODELIST``; the job script asks for
``--no-kill``, so the allocation outlives a lost node). A host answers when Slurm does not mark it
down and a one-task step on it (``srun --overlap``) starts within a deadline. A relaunched
``mpirun`` is told the answering hosts (``--host``), and ``plm_slurm_args --overlap``: the previous
job's step that started the runtime's daemons never ends (its lost node cannot confirm), and without
``--overlap`` the new daemons would wait for its resources forever.

Outside Slurm (one host, or ``mpirun`` with a hostfile) there is nothing to probe: the job is
relaunched as it was.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

PROBE_TIMEOUT_S = 15.0
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
        return [h for h in alive if self._probe(h)]

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


def relaunch_command(cmd: list[str], hosts: list[str]) -> list[str]:
    """``cmd`` (an ``mpirun`` line) restricted to ``hosts``, with the overlap a relaunch inside the
    same Slurm allocation needs."""
    if not cmd or not os.path.basename(cmd[0]).startswith("mpirun"):
        return cmd
    extra = ["--host", ",".join(hosts), "--prtemca", "plm_slurm_args", "--overlap"]
    return [cmd[0], *extra, *_without_host(cmd[1:])]


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
        if a == "--prtemca" and i + 2 < len(args) + 1 and args[i + 1 : i + 2] == ["plm_slurm_args"]:
            skip = 2
            continue
        out.append(a)
    return out
