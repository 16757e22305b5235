"""The ``recover:`` section: forward recovery, the checkpoint-restart baseline, fault injection,
re-join and node-memory snapshots.

Like Nanotron's ``*Args``, every section here refuses a bad value of its own when it is built
(``__post_init__``), from a config file or in Python; each message names the key and what to set.
Checks that need another section (``parallelism.dp``, the engine, ``tokens.train_steps``, the
checkpoints) or the file system are in ``validate.py``. Phases and kinds come from the failure
vocabulary (:mod:`nanotron_recover.failures`).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..failures import (
    ERROR_PHASES,
    INJECTABLE_PHASES,
    PLAIN_INJECTED_KINDS,
    PLAIN_PHASES,
    InjectedKind,
    Phase,
)
from .loader import ConfigError, SectionError

# Where a fault can be injected, and what it does: the failure vocabulary's names (the loader
# reads them with typing.get_args, so a tuple of names is a Literal like any other).
InjectablePhase = Literal[INJECTABLE_PHASES]  # type: ignore[valid-type]
FaultKind = Literal[tuple(InjectedKind)]  # type: ignore[valid-type]

# A host of recover.rejoin.hosts: a name, optionally with a slot count ("node7", "node7:4").
_REJOIN_HOST = re.compile(r"[^\s:,]+(:[1-9][0-9]*)?")


def _positive(value: float) -> bool:
    """A finite number above zero (NaN and infinity are not)."""
    return math.isfinite(value) and value > 0


@dataclass
class FaultSpec:
    """A fault injected at an exact point of a step.

    ``kind: kill`` (default) SIGKILLs one replica (all its ranks) or one rank; ``kind: freeze``
    SIGSTOPs it instead (how a hung GPU or a stuck collective looks from outside). ``microbatch`` is
    the index, within what the victim computes in that phase, of the micro-batch
    (forward/backward/recovery) or bucket (reduce) before which it fires; ``phase: save`` fires while
    the victim writes its checkpoint files; ``phase: rejoin`` fires in the re-join at the boundary
    after ``step``: ``microbatch: 0`` before the spawn (a member), ``1`` mid-transfer (the donor
    after sending the layout, or the spawned process taking ``rank``'s place after receiving it),
    ``2`` right after the spawn returned and ``3`` right after the merge (a member, the root
    included: the stages where the spawned processes wait on the members); ``phase: start`` fires in
    a job relaunched from node memory while it restores its state, when ``step`` is the step the
    relaunch would start with (the previous job's last commit + 1), and with ``step: 0`` in the
    job's first launch while its first world is built (``microbatch`` 0 before the launch
    communicator's ``Dup``, 1 before the replica and DP splits, 2 after the process table).

    ``kind: error`` raises an exception in whichever replica computes the micro-batch ``id`` (a
    global micro-batch id) of ``step``; ``persistent: true`` raises it every time (a deterministic
    error, e.g. a bad sample), otherwise only the first time (a transient, hardware-like error).
    """

    step: int
    phase: InjectablePhase = Phase.FORWARD
    replica: int | None = None
    rank: int | None = None
    microbatch: int = 0
    kind: FaultKind = InjectedKind.KILL
    id: int | None = None
    persistent: bool = False

    # Which entry of recover.faults this is, known only to the loader (it puts the index in).
    WHERE: ClassVar[str] = "recover.faults[?]"

    def __post_init__(self) -> None:
        """The fields each kind uses; the step, the victim's range and the micro-batch id's need the
        rest of the config (``validate.py``)."""
        if self.kind == InjectedKind.ERROR:
            # The exception follows the micro-batch, not a process: whoever computes id raises it.
            if self.replica is not None or self.rank is not None:
                self._refuse(
                    ": kind error fires in whichever replica computes micro-batch id; remove replica and rank"
                )
            if self.phase not in ERROR_PHASES:
                self._refuse(
                    ": kind error fires while a micro-batch is computed, so phase must be one of "
                    f"{', '.join(ERROR_PHASES)}, got '{self.phase}'"
                )
            if self.microbatch != 0:
                self._refuse(": microbatch is not used by kind error (id names the micro-batch)")
            return
        if (self.replica is None) == (self.rank is None):
            self._refuse(": set exactly one of replica or rank")
        if self.id is not None:
            self._refuse(
                f": id is only for kind error; kind {self.kind} picks its victim with replica or rank"
            )
        if self.persistent:
            self._refuse(f": persistent is only for kind error; remove it from kind {self.kind}")
        if self.microbatch < 0:
            self._refuse(": microbatch must be >= 0")

    def _refuse(self, rest: str) -> None:
        raise SectionError(self.WHERE, rest)


@dataclass
class RandomFaults:
    """Every ``every_steps`` steps kill one alive replica chosen by ``seed``, until
    ``until_replicas`` are left."""

    every_steps: int
    seed: int = 0
    until_replicas: int = 1

    def __post_init__(self) -> None:
        if self.every_steps < 1:
            raise ConfigError("recover.random_faults.every_steps must be >= 1")


@dataclass
class RejoinArgs:
    """Growing back to full width after a replica is lost (see docs/architecture.md, "Re-join")."""

    # off: a job only shrinks. spawn: at a step boundary the survivors spawn processes for the dead
    # ranks of a lost replica (MPI_Comm_spawn), its surviving ranks are reused, and the replica's
    # state is copied from a healthy replica.
    mode: Literal["off", "spawn"] = "off"
    # Re-join at the first step boundary at least this many committed steps after the failure.
    after_steps: int = 1
    # Spawn attempts over the whole run (a failed attempt counts); then the job stays at its width.
    max_spawns: int = 16
    # A replica lost this many times is not re-spawned again.
    max_failures_per_replica: int = 3
    # Where spawned processes go: hosts ("node7" or "node7:4" slots) or a hostfile; neither: any
    # free slot mpirun knows of (on Slurm, the spare nodes of `nanotron-recover slurm --spare-nodes`).
    hosts: list[str] = field(default_factory=list)
    hostfile: str | None = None
    # A re-join that has not committed this long after it began (a spawned process or a member
    # frozen in a stage no failure detector watches) ends the job, which the supervisor relaunches
    # from the node-memory snapshots.
    join_timeout_s: float = 300.0
    # A re-join that cannot be placed (no free slot: Open MPI does not give a dead process's slot
    # back) stops the job after the step, its node-memory snapshots published, and the supervisor
    # relaunches it at full width (seconds, no step redone) instead of leaving it narrower for the
    # rest of the run. Only under the supervisor, with a relaunch left and snapshots on.
    regrow_by_relaunch: bool = True
    # Spawns per launch (per mpirun) once the job spans several hosts, where the runtime runs
    # without the project's fix (ft/prrte_fix.py: the supervisor builds it with the host's C
    # compiler). Without it, Open MPI 5.0.x's runtime (PRRTE 3.0) fails every later
    # MPI_Comm_spawn of such a launch: the new processes cannot reach the job (``opal_modex_recv``
    # -46, "unable to reach each other") and die in MPI_Init, while the members wait for them.
    # Past this count a lost replica comes back the regrow_by_relaunch way (a full-width relaunch
    # from node memory at the next boundary) when it can, else by a spawn.
    spawns_across_hosts: int = 1

    def __post_init__(self) -> None:
        where = "recover.rejoin"
        if not self.join_timeout_s > 0:
            raise ConfigError(f"{where}.join_timeout_s must be > 0, got {self.join_timeout_s}")
        if self.after_steps < 0:
            raise ConfigError(f"{where}.after_steps must be >= 0, got {self.after_steps}")
        if self.max_spawns < 1:
            raise ConfigError(
                f"{where}.max_spawns must be >= 1, got {self.max_spawns}: to never spawn set {where}.mode: off"
            )
        if self.spawns_across_hosts < 0:
            raise ConfigError(f"{where}.spawns_across_hosts must be >= 0, got {self.spawns_across_hosts}")
        if self.max_failures_per_replica < 1:
            raise ConfigError(
                f"{where}.max_failures_per_replica must be >= 1, got {self.max_failures_per_replica}"
            )
        if self.hosts and self.hostfile is not None:
            raise ConfigError(
                f"{where}: set hosts or hostfile, not both (neither: any free slot mpirun knows of)"
            )
        for i, host in enumerate(self.hosts):
            if not _REJOIN_HOST.fullmatch(host):
                raise ConfigError(
                    f"{where}.hosts[{i}] {host!r} is not a host: write a name or name:slots, e.g. node7 or node7:4"
                )


@dataclass
class SnapshotArgs:
    """Every rank's full training state in its node's memory after committed steps, so that a job
    relaunched after a node loss starts from it without disk (docs/architecture.md, "Node loss")."""

    # Snapshot after every interval-th committed step (0: never; the relaunch then uses the disk
    # checkpoint).
    interval: int = 1
    # Node-local shared memory, private to the user: "{uid}" is replaced by the user's id; the folder
    # is created 0700 and refused (snapshots skipped with a warning) unless it is a directory of this
    # user's, not a symlink. A folder per run under it, removed when the run completes.
    dir: str = "/dev/shm/nanotron-recover-{uid}"
    # A rank whose state is larger than this does not snapshot (null: the default cap, half of the
    # folder's room at the first snapshot shared by the two slots of every rank of the node; a slot
    # that does not fit in the folder's free space is skipped all the same). `train --dry-run`
    # prints what the snapshots take per rank and per node, and the cap.
    max_mb: float | None = None
    # How many replicas of each (pp, tp) coordinate keep one, the lowest alive first (null: all).
    replicas_per_coordinate: int | None = None

    def __post_init__(self) -> None:
        where = "recover.snapshot"
        if self.interval < 0:
            raise ConfigError(f"{where}.interval must be >= 0 (0: no snapshots), got {self.interval}")
        if self.max_mb is not None and self.max_mb <= 0:
            raise ConfigError(f"{where}.max_mb must be > 0 or null (no cap), got {self.max_mb}")
        if self.replicas_per_coordinate is not None and self.replicas_per_coordinate < 1:
            raise ConfigError(
                f"{where}.replicas_per_coordinate must be >= 1 or null (every replica), "
                f"got {self.replicas_per_coordinate}"
            )
        if not self.dir.strip():
            raise ConfigError(
                f"{where}.dir is empty: name a node-local folder, e.g. /dev/shm/nanotron-recover-{{uid}}"
            )
        self.dir = self.dir.replace("{uid}", str(os.getuid()))


@dataclass
class RecoverArgs:
    """Forward recovery across data-parallel replicas (off by default)."""

    enabled: bool = False
    # forward: repair inside the step (this project). checkpoint_restart: the classic baseline, for
    # comparison: on a failure the whole job is relaunched on as many ranks and resumes from the last
    # checkpoint (checkpoints.checkpoint_interval), recomputing the lost steps.
    mode: Literal["forward", "checkpoint_restart"] = "forward"
    # Relaunches of the whole job before giving up: checkpoint_restart after any failure; forward
    # after a lost node (or a job that lost every replica), from the node-memory snapshots.
    max_restarts: int = 100
    # Forward recovery: the supervisor ends and relaunches (from node memory) a job that commits no
    # step for this many seconds, whatever holds it (null: a bound derived from the measured step
    # time, the longest save, two heartbeat timeouts and the launch's start-up, at least 60 s;
    # 0: never). No stuck member can hold the job longer (commit_deadline.py).
    commit_timeout_s: float | None = None
    # The DP reduction runs in buckets of this size; each bucket is snapshotted before it is reduced.
    bucket_size_mb: float = 25.0
    # How a torn bucket is restored: blocking copy, or (CUDA) on a side stream overlapped with the
    # extra micro-batches; on CPU async falls back to blocking.
    restore: Literal["blocking", "async"] = "blocking"
    # static_world: every step sums the same B micro-batches whatever fails (the survivors redo the
    # lost ones). adaptive_world: for the ablation, what elastic trainers do: the lost micro-batches
    # are dropped and each step averages over what was summed, so the batch shrinks with the world.
    policy: Literal["static_world", "adaptive_world"] = "static_world"
    # Replicas left over by G = ceil(B/W): shadow a Major (its promotion recomputes nothing), zero
    # (compute like a shadow, contribute zeros, but a lost Major's work is recomputed: the paper's
    # spares, for the ablation) or off (idle).
    spares: Literal["shadow", "zero", "off"] = "shadow"
    # Bitwise-exact mode: every micro-batch gradient is rounded to a fixed-point integer (2^-bits
    # units) and summed as int64, within and across replicas, so the summed gradient depends only
    # on the set of micro-batch ids, not on who computed which or over how many replicas: a run
    # with faults is bit for bit the same run without them (docs/architecture.md, section 4).
    exact: bool = False
    exact_fraction_bits: int = 40
    # Below this many alive replicas the survivors checkpoint and stop.
    min_replicas: int = 1
    # Deadline of every phase only this replica can see (compute, gate, optimizer, its own
    # reductions, checkpoint save); when one passes, the stuck replica leaves (null disables it).
    # Waits on other replicas are never under it: those belong to the heartbeat detector.
    watchdog_timeout_s: float | None = 600.0
    # ULFM's heartbeat failure detector: every rank sends a heartbeat every period; a rank silent
    # for the timeout is declared failed (a frozen process, node or network), and the others
    # shrink past it. Short values catch hangs sooner at the risk of declaring a busy rank dead.
    heartbeat_period_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    # Replica-consistency gate before cross-replica traffic: every rank of the replica arrives within
    # this many seconds, or the waiting ranks leave naming the missing ones (gloo: monitored_barrier;
    # NCCL: a gate through the replica's TCPStore, ft/gate.py).
    gate_timeout_s: float = 120.0
    faults: list[FaultSpec] = field(default_factory=list)
    random_faults: RandomFaults | None = None
    # Growing back to full width after a replica is lost (forward recovery only).
    rejoin: RejoinArgs = field(default_factory=RejoinArgs)
    # Node-memory snapshots for a relaunch after a node loss (forward recovery only).
    snapshot: SnapshotArgs = field(default_factory=SnapshotArgs)

    def __post_init__(self) -> None:
        """The checks that need only this section; those that need others (parallelism.dp, the
        steps, the checkpoints, the engine) are in ``validate.py``."""
        if self.bucket_size_mb <= 0:
            raise ConfigError(f"recover.bucket_size_mb must be > 0, got {self.bucket_size_mb}")
        if self.gate_timeout_s <= 0:
            raise ConfigError("recover.gate_timeout_s must be > 0")
        if self.watchdog_timeout_s is not None and not _positive(self.watchdog_timeout_s):
            raise ConfigError(
                f"recover.watchdog_timeout_s must be > 0, or null for no watchdog, got {self.watchdog_timeout_s}"
            )
        if not _positive(self.heartbeat_period_s):
            raise ConfigError(f"recover.heartbeat_period_s must be > 0, got {self.heartbeat_period_s}")
        if not self.heartbeat_timeout_s > 3 * self.heartbeat_period_s:
            # Open MPI's own rule for its detector: a timeout of a few periods tolerates a late heartbeat.
            raise ConfigError(
                f"recover.heartbeat_timeout_s={self.heartbeat_timeout_s} must be greater than 3 x "
                f"recover.heartbeat_period_s={self.heartbeat_period_s}: a rank silent for the timeout is "
                "declared failed, so a timeout of fewer than three periods declares healthy ranks failed"
            )
        if self.policy == "adaptive_world":
            if not self.forward:
                raise ConfigError(
                    "recover.policy: adaptive_world changes how forward recovery repairs a step: it needs "
                    "recover.enabled: true and recover.mode: forward"
                )
            if self.spares == "zero":
                raise ConfigError(
                    "recover.spares: zero cannot be used with recover.policy: adaptive_world, where every "
                    "replica computes its own micro-batches and none is a spare; set recover.spares: shadow or off"
                )
        if self.max_restarts < 0:
            raise ConfigError("recover.max_restarts must be >= 0")
        if self.commit_timeout_s is not None and not self.commit_timeout_s >= 0:
            raise ConfigError(
                f"recover.commit_timeout_s must be >= 0 (0: never), or null for a bound derived from "
                f"the measured steps, got {self.commit_timeout_s}"
            )
        if (self.faults or self.random_faults is not None) and not self.enabled:
            raise ConfigError("recover.faults / recover.random_faults need recover.enabled: true")
        if self.checkpoint_restart:
            for i, f in enumerate(self.faults):
                if f.phase not in PLAIN_PHASES:
                    raise ConfigError(
                        f"recover.faults[{i}]: phase '{f.phase}' does not exist in checkpoint_restart mode "
                        f"(choose {', '.join(PLAIN_PHASES)})"
                    )
                if f.kind not in PLAIN_INJECTED_KINDS:
                    raise ConfigError(
                        f"recover.faults[{i}]: kind '{f.kind}' is not supported in checkpoint_restart mode, "
                        "which recovers only from dead ranks: use kind: kill, or recover.mode: forward"
                    )
        if self.rejoin.mode == "spawn" and not self.enabled:
            raise ConfigError(
                "recover.rejoin.mode: spawn needs recover.enabled: true (re-join grows back a job that "
                "recovers forward); set recover.enabled: true or recover.rejoin.mode: off"
            )
        if self.rejoin.mode == "spawn" and self.mode != "forward":
            raise ConfigError(
                f"recover.rejoin.mode: spawn cannot be used with recover.mode: {self.mode}: a relaunch "
                "already restores full width; set recover.mode: forward or recover.rejoin.mode: off"
            )
        if self.exact:
            if self.policy == "adaptive_world":
                raise ConfigError(
                    "recover.exact: true cannot be used with recover.policy: adaptive_world, which changes "
                    "the batch when a replica is lost; exact mode equals the fault-free run only with static_world"
                )
            if self.checkpoint_restart:
                raise ConfigError(
                    "recover.exact: true needs recover.mode: forward (or recover.enabled: false)"
                )
            if not 8 <= self.exact_fraction_bits <= 56:
                raise ConfigError(
                    f"recover.exact_fraction_bits must be between 8 and 56, got {self.exact_fraction_bits}"
                )

    @property
    def forward(self) -> bool:
        """Forward recovery runs: ``enabled`` and ``mode: forward`` (ULFM, repair inside the step)."""
        return self.enabled and self.mode == "forward"

    @property
    def checkpoint_restart(self) -> bool:
        """The checkpoint-restart baseline runs: ``enabled`` and ``mode: checkpoint_restart``."""
        return self.enabled and self.mode == "checkpoint_restart"
