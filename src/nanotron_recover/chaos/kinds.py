"""The fault kinds a chaos campaign sends, and what each one needs.

One table, :data:`KINDS`, is the vocabulary: the schedule draws from it (:mod:`.schedule`), the
runner sends each kind its own way (:mod:`.runner`) and refuses a kind the target cannot send
(:mod:`.targets`), and the report names them. Every kind is sent from outside the job, by a signal
to one or more of its rank processes, at a moment the job does not choose:

- ``kill``: SIGKILL one rank (a crashed process or a lost GPU);
- ``freeze``: SIGSTOP one rank (a hung device, a stuck collective); the heartbeat detector must
  declare it failed and a survivor on its host remove it;
- ``kill_two``: SIGKILL two ranks of two replicas back to back (two failures in one step);
- ``kill_all``: SIGKILL every rank (the job lost as a whole on one host); the supervisor
  relaunches it from the node-memory snapshots;
- ``kill_during_recovery``: SIGSTOP one rank, then, while the survivors wait for the detector to
  declare it failed (no commit and no incident since the freeze), SIGKILL a rank of another replica;
- ``kill_during_rejoin``: SIGKILL one rank; once its incident is recorded and the re-join has
  spawned the replacement (a process of the job that the rank table does not list yet), SIGKILL
  the spawned process or a rank of another replica (``role``);
- ``kill_during_save``: SIGKILL a rank of the checkpoint-writing replica while a checkpoint folder
  ``step_N.tmp`` exists;
- ``kill_during_snapshot``: SIGKILL one rank the moment a step commits, when the node-memory
  snapshot of that step is being written (the report says whether a slot was unpublished then).

Three more kinds need whole nodes, so an emulated or real multi-node cluster target: ``node_power_off``,
``link_cut`` and ``node_freeze``. They are part of the vocabulary (a schedule may hold them), but
only a cluster target can send them (``Target.node_fault``): the emulated Slurm cluster's, in
``tests/helpers/chaos_cluster.py``, sends them there; the runner refuses them on a local target
before the job starts.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KindInfo:
    """What a kind needs: how many replicas it strikes (the schedule draws that many distinct
    replicas), whether a node-level target must send it, and the config it needs to mean anything."""

    name: str
    victims: int  # distinct replicas drawn as targets (0: every rank)
    node_level: bool = False  # needs a multi-node cluster target
    needs_rejoin: bool = False  # recover.rejoin.mode: spawn
    needs_checkpoints: bool = False  # checkpoints.checkpoint_interval > 0
    needs_snapshots: bool = False  # recover.snapshot.interval > 0
    roles: tuple[str, ...] = ()  # a second choice the schedule draws (kill_during_rejoin)
    what: str = ""


KINDS: dict[str, KindInfo] = {
    k.name: k
    for k in (
        KindInfo("kill", 1, what="SIGKILL one rank"),
        KindInfo("freeze", 1, what="SIGSTOP one rank"),
        KindInfo("kill_two", 2, what="SIGKILL two ranks of two replicas at once"),
        KindInfo("kill_all", 0, needs_snapshots=True, what="SIGKILL every rank (job lost, relaunched)"),
        KindInfo(
            "kill_during_recovery",
            2,
            what="SIGSTOP one rank, SIGKILL another replica's rank while the freeze is being detected",
        ),
        KindInfo(
            "kill_during_rejoin",
            2,
            needs_rejoin=True,
            roles=("spawned", "member"),
            what="SIGKILL one rank, then the spawned replacement (or a member) during the re-join",
        ),
        KindInfo(
            "kill_during_save",
            1,
            needs_checkpoints=True,
            what="SIGKILL a rank of the writing replica while a checkpoint is being written",
        ),
        KindInfo(
            "kill_during_snapshot",
            1,
            needs_snapshots=True,
            what="SIGKILL one rank as a step commits, while its node-memory snapshot is written",
        ),
        KindInfo("node_power_off", 1, node_level=True, what="power off a rank's node (cluster only)"),
        KindInfo("link_cut", 1, node_level=True, what="cut a rank's node off the network (cluster only)"),
        KindInfo("node_freeze", 1, node_level=True, what="SIGSTOP every process of a node (cluster only)"),
    )
}

LOCAL_KINDS: tuple[str, ...] = tuple(name for name, k in KINDS.items() if not k.node_level)
NODE_KINDS: tuple[str, ...] = tuple(name for name, k in KINDS.items() if k.node_level)


def kind_info(name: str) -> KindInfo:
    """The kind called ``name``; a ValueError naming it and the known kinds otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown fault kind {name!r}: choose from {', '.join(KINDS)}") from None


def parse_kinds(text: str) -> list[str]:
    """``"kill,freeze"`` -> ``["kill", "freeze"]``: every name checked, duplicates dropped, order kept."""
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        kind_info(name)
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"no fault kind given: choose from {', '.join(KINDS)}")
    return names
