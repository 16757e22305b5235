"""The hosts a job may run on, which of them still answer, and the relaunch's launcher line.

Under Slurm the job's hosts are its allocation (``SLURM_JOB_NODELIST``; the job script asks for
``--no-kill``, so the allocation outlives a lost node). A host answers when Slurm does not count
it dead (:func:`dead_state`, one ``sinfo`` call for every host) and a one-task step on it
(``srun --overlap``) starts. :meth:`HostPlan.answering` asks both; ``host_probe.py`` runs the
steps: every host in parallel (``PROBE_WORKERS`` at a time), done as soon as every host has
answered -- the probe's time is what the answers took, with no floor. A lost node that Slurm does
not yet mark down (that takes ``SlurmdTimeout``, often minutes) never answers, so a try is not
waited for long: one that fails, or that is still silent ``PROBE_SLACK`` times as long as the
slowest answer so far, is retried once before its host counts as lost. A busy controller slows
every answer alike, and the wait grows with it. Each ``srun`` is bounded by ``PROBE_TRY_S``, the
whole probe by ``PROBE_TIMEOUT_S``. The supervisor starts the probe the moment a job ends
(:class:`.host_probe.ProbeRun`), so that it overlaps the job's cleanup; a probe that raises
counts as no host known lost.

A relaunched job is told the answering hosts with as many slots each as the job placed per node
(``--host a:R,b:R``, ``R`` from ``--map-by ppr:R:node``), the hosts the last job's ranks ran on
first (:func:`holders_first`): the runtime fills the hosts in that order, and those hosts hold the
newest node-memory snapshots. In the allocation's order instead, a relaunch after re-joins onto
spare nodes started on nodes that held only older snapshots, and resumed from the disk checkpoint
(seen in a 60-fault campaign on the emulated cluster: replicas re-joined onto 3 of the 6 nodes,
every rank then killed at step 2543, and the relaunch on the first 3 nodes found no step newer
than 2496 in node memory: it resumed from the checkpoint of step 2540, 3 steps redone, where
checkpoints 1,000 steps apart would have redone the 47 since that snapshot); and ``plm_slurm_args --overlap``: the
previous job's step that started the runtime's daemons never ends (its lost node cannot confirm),
and without ``--overlap`` the new daemons would wait for its resources forever. When the answering
hosts hold fewer ranks than the job had, it is relaunched narrower (:func:`relaunch_ranks`): whole
replicas only, the same ``B`` shared by fewer. The line is rewritten when it runs one of Open
MPI's launchers (``mpirun``, ``mpiexec``, ``prterun``, ``orterun``, by basename, also behind
``env VAR=...`` or ``timeout N``: :func:`launcher_at`); any other command cannot be restricted to
the answering hosts, and the supervisor says so.

Outside Slurm (one host, or ``mpirun`` with a hostfile) there is nothing to probe: the job is
relaunched as it was.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from .host_probe import PROBE_TIMEOUT_S, PROBE_TRY_S, probe_hosts, run_bounded

# sinfo's short states (``%t``) of a node that a relaunch cannot use (Slurm's sinfo(1), NODE STATE
# CODES): ``down``; ``drain`` is DRAINED (no job runs there, none will); ``fail``/``failg`` (an
# administrator expects it to fail: a relaunch there would be lost again); a node powered down or
# rebooting. ``drng`` is DRAINING: the node still runs the jobs it holds and takes no new ones --
# this job holds it, and its steps (the relaunch is one) still start there, so it is not dead; the
# probe decides. Suffixes: ``*`` not responding, ``~`` powered off, ``%`` powering down are dead;
# the others (``-`` planned by the backfill scheduler, ``$`` maintenance reservation, ``@``
# pending reboot, ``#`` powering up, ``!`` pending power down) leave it to the probe.
DEAD_STATES = frozenset(
    {"down", "drain", "fail", "failg", "boot", "reboot", "powered_down", "pow_dn", "inval"}
)
DEAD_SUFFIXES = ("*", "~", "%")
LAUNCHERS = ("mpirun", "mpiexec", "prterun", "orterun")  # Open MPI's (ORTE and PRRTE) launchers


@dataclass
class HostPlan:
    hosts: list[str]  # every host of the allocation, in order

    @classmethod
    def from_slurm(cls) -> HostPlan | None:
        """The hosts of the Slurm job this process runs in, or None outside Slurm."""
        nodelist = os.environ.get("SLURM_JOB_NODELIST")
        if not nodelist or shutil.which("scontrol") is None:
            return None
        code, out = run_bounded(["scontrol", "show", "hostnames", nodelist], PROBE_TIMEOUT_S)
        hosts = out.split() if code == 0 else []
        return cls(hosts) if hosts else None

    def answering(self) -> list[str]:
        """The hosts Slurm does not count dead and that start a probe step (:func:`probe_hosts`),
        in the plan's order; within ``PROBE_TIMEOUT_S`` in all."""
        start = time.monotonic()
        states = self._states()
        alive = [h for h in self.hosts if not dead_state(states.get(h, ""))]
        left = PROBE_TIMEOUT_S - (time.monotonic() - start)
        return probe_hosts(alive, self._probe, cap_s=left) if alive and left > 0 else []

    def _states(self) -> dict[str, str]:
        """Every host's short state, in one ``sinfo`` call; empty when sinfo does not answer."""
        cmd = ["sinfo", "-h", "-N", "-n", ",".join(self.hosts), "-o", "%N %t"]
        _, out = run_bounded(cmd, PROBE_TRY_S)
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    @staticmethod
    def _probe(host: str) -> bool:
        cmd = ["srun", "--overlap", "-N", "1", "-n", "1", "-w", host, "--time", "1", "true"]
        return run_bounded(cmd, PROBE_TRY_S, output=False)[0] == 0


def dead_state(state: str) -> bool:
    """Whether a node in sinfo short state ``state`` cannot take a relaunch (see DEAD_STATES)."""
    state = state.lower()
    return state.endswith(DEAD_SUFFIXES) or state.rstrip("*~#!%$@^-+") in DEAD_STATES


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


def launcher_at(cmd: list[str]) -> int | None:
    """Where in ``cmd`` Open MPI's launcher is (:data:`LAUNCHERS` by basename, or
    ``<launcher>.openmpi``), past ``env`` and ``timeout`` wrappers; None when it runs none."""
    i: int | None = 0
    while i is not None and i < len(cmd):
        name = os.path.basename(cmd[i])
        if name in LAUNCHERS or (name.endswith(".openmpi") and name[: -len(".openmpi")] in LAUNCHERS):
            return i
        if name == "env":
            i = _past_env(cmd, i + 1)
        elif name == "timeout":
            i = _past_timeout(cmd, i + 1)
        else:
            return None
    return None


_NAME_VALUE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def _past_env(cmd: list[str], i: int) -> int | None:
    """The index of the command ``env`` runs (its options and NAME=VALUE skipped), or None."""
    while i < len(cmd):
        a = cmd[i]
        if a in ("-i", "--ignore-environment", "-0", "--null", "-v", "--debug", "-", "--"):
            i += 1
        elif a in ("-u", "--unset", "-C", "--chdir"):
            i += 2
        elif a.startswith(("--unset=", "--chdir=")) or (a[:2] in ("-u", "-C") and len(a) > 2):
            i += 1
        elif _NAME_VALUE.match(a):
            i += 1
        elif a.startswith("-"):
            return None  # -S (a split string) and anything else: not rewritten
        else:
            return i
    return None


def _past_timeout(cmd: list[str], i: int) -> int | None:
    """The index of the command ``timeout`` runs (its options and duration skipped), or None."""
    while i < len(cmd):
        a = cmd[i]
        if a in ("--preserve-status", "--foreground", "-v", "--verbose"):
            i += 1
        elif a in ("-k", "-s", "--kill-after", "--signal"):
            i += 2
        elif a.startswith(("--kill-after=", "--signal=")) or (a[:2] in ("-k", "-s") and len(a) > 2):
            i += 1
        elif re.fullmatch(r"\d+(\.\d*)?[smhd]?", a):
            return i + 1
        else:
            return None
    return None


def rank_table_hosts(run_dir: str | Path) -> list[str]:
    """The hosts of the run's last rank table (``ranks.json``), in the order of their first rank;
    empty when there is none or it cannot be read."""
    try:
        table = json.loads((Path(run_dir) / "ranks.json").read_text())
        rows = sorted(table, key=lambda row: int(row["rank"]))
        return list(dict.fromkeys(str(row["host"]) for row in rows))
    except (OSError, ValueError, TypeError, KeyError):
        return []


def holders_first(answering: list[str], holders: list[str]) -> list[str]:
    """``answering`` with the ``holders`` among them first (in the holders' order), then the others
    in their own order: a relaunch fills its hosts in this order."""
    first = [h for h in holders if h in answering]
    return first + [h for h in answering if h not in first]


def relaunch_command(cmd: list[str], hosts: list[str], ranks: int | None = None) -> list[str]:
    """``cmd`` (an Open MPI launcher's line, :func:`launcher_at`) restricted to ``hosts`` (as many
    slots on each as ``cmd`` placed per node) and, when given, to ``ranks`` ranks; with the overlap
    a relaunch inside the same Slurm allocation needs. Any other command comes back as it was."""
    at = launcher_at(cmd)
    if at is None:
        return cmd
    slots = slots_per_host(cmd)
    extra = ["--host", ",".join(f"{h}:{slots}" for h in hosts), "--prtemca", "plm_slurm_args", "--overlap"]
    rest = _without_host(cmd[at + 1 :])
    if ranks is not None:
        for i, a in enumerate(rest[:-1]):
            if a in ("-n", "-np", "--np"):
                rest = [*rest[: i + 1], str(ranks), *rest[i + 2 :]]
                break
    return [*cmd[: at + 1], *extra, *rest]


def _without_host(args: list[str]) -> list[str]:
    """An earlier relaunch's (or the job's own) host restriction does not carry over."""
    out, skip = [], 0
    for i, a in enumerate(args):
        if skip:
            skip -= 1
            continue
        if a in ("--host", "-host", "-H"):
            skip = 1
            continue
        if a.startswith("--host="):
            continue
        if a == "--prtemca" and args[i + 1 : i + 2] == ["plm_slurm_args"]:
            skip = 2
            continue
        out.append(a)
    return out
