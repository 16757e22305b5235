"""The failure vocabulary: every kind of failure, every phase of a step, and how a stop ends.

One closed vocabulary, defined here once and used by everything above it: failure records
(``ft/records.py``), fault injection and the config's ``recover.faults`` (``ft/faults.py``,
``config/``), both data-parallel modes, incidents, outcomes and exit statuses (``errors.py``).
Adding a kind or a phase means adding it here; the groups below say what it does.

Kinds (:class:`Kind`), what a rank knows about why a replica was lost or the job stopped:

- ``crash``: the process is gone, no record (killed from outside, segfault, node power).
- ``hang``: frozen or past a deadline (the heartbeat detector, the watchdog, a frozen spawned
  process).
- ``peer_error``: a gloo/NCCL error inside the replica: a replica peer failed first.
- ``oom``, ``io``, ``error``: an exception while computing (out of memory, the filesystem, anything
  else not yet known to be deterministic).
- ``deterministic``: the same exception again on the same micro-batch ids in another replica.
- ``input``, ``too_few_replicas``: stops that are not a replica failure (bad input, fewer than
  ``recover.min_replicas`` replicas left).
- ``all_replicas_lost``: how a job ends when no replica is left to go on (every replica failed, or
  every rank was gone without a record); never a failure record.
- ``rejoin``: an incident of the re-join (joined, failed, given up), never a failure record.
- ``node_lost``, ``job_lost``: the job was relaunched inside its allocation, after a host was lost
  (the runtime ends the whole job then) or after every replica was lost; never a failure record.
- ``regrow``: the job stopped at a step boundary, its node-memory snapshots published, so that its
  supervisor relaunches it at full width: a re-join could not be placed; then the relaunch's
  incident kind.
- ``stalled``: the job was relaunched by its supervisor after no step committed within its
  deadline (``commit_deadline.py``); never a failure record.

Phases (:class:`Phase`), where a rank is in a step: the ones a fault can be injected at
(:data:`INJECTABLE_PHASES`) and the ones a rank reports when it leaves.

Injected kinds (:class:`InjectedKind`), what a ``recover.faults`` entry does to its victim: ``kill``
(SIGKILL, recorded as a ``crash``), ``freeze`` (SIGSTOP, recorded as a ``hang``) or ``error`` (an
exception while computing a micro-batch).
"""

from __future__ import annotations

from enum import Enum


class _Name(str, Enum):
    """A closed set of names that are also plain strings (JSON, YAML, f-strings, ``==``)."""

    # Hashed and printed as the plain string, so that "hang" in {Kind.HANG} and f"{Kind.HANG}" hold.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Kind(_Name):
    CRASH = "crash"
    HANG = "hang"
    PEER_ERROR = "peer_error"
    OOM = "oom"
    IO = "io"
    ERROR = "error"
    DETERMINISTIC = "deterministic"
    INPUT = "input"
    TOO_FEW_REPLICAS = "too_few_replicas"
    ALL_REPLICAS_LOST = "all_replicas_lost"  # no replica left to go on: the job is lost
    REJOIN = "rejoin"
    NODE_LOST = "node_lost"  # the job was relaunched after a host was lost
    JOB_LOST = "job_lost"  # the job was relaunched after every replica was lost, no host lost
    STALLED = "stalled"  # the job was relaunched after no step committed within its deadline
    # The job stopped at a step boundary to be relaunched at full width: a re-join could not be
    # placed (Open MPI does not give a dead process's slot back), and a relaunch gets every slot.
    REGROW = "regrow"


class Phase(_Name):
    START = "start"
    FORWARD = "forward"
    BACKWARD = "backward"
    COMPUTE = "compute"  # forward + backward of the step's own micro-batches
    GATE = "gate"
    REDUCE = "reduce"
    AGREE = "agree"
    LOSS = "loss"  # the loss reduction inside the replica, after the commit
    OPTIMIZER = "optimizer"
    RECOVERY = "recovery"  # the redone micro-batches of an in-step repair
    SAVE = "save"
    REJOIN = "rejoin"
    FINISH = "finish"


class InjectedKind(_Name):
    KILL = "kill"
    FREEZE = "freeze"
    ERROR = "error"


# What a failure record can say (``ft/records.py``).
RECORD_KINDS: tuple[Kind, ...] = (
    Kind.CRASH,
    Kind.HANG,
    Kind.PEER_ERROR,
    Kind.OOM,
    Kind.IO,
    Kind.ERROR,
    Kind.DETERMINISTIC,
)
# Recorded kinds that stop the job instead of being repaired forward: redoing the work elsewhere
# cannot help.
UNREPAIRABLE_KINDS: tuple[Kind, ...] = (Kind.IO, Kind.DETERMINISTIC)
# An exception of these kinds, met while computing, may be met again on the same ids elsewhere:
# then it is deterministic.
RETRYABLE_KINDS: tuple[Kind, ...] = (Kind.ERROR, Kind.OOM)
# Kinds a whole-job stop (``errors.StopRun``) can have, most specific cause first: when several
# stops are agreed at once, the first of this order wins (both data-parallel modes).
# ``all_replicas_lost`` is never agreed (nobody is left to agree with): it is last.
STOP_ORDER: tuple[Kind, ...] = (
    Kind.DETERMINISTIC,
    Kind.IO,
    Kind.INPUT,
    Kind.TOO_FEW_REPLICAS,
    Kind.ALL_REPLICAS_LOST,
    Kind.REGROW,
)
# The incident kind of one recovery, from the kinds of its records and unrecorded failures.
INCIDENT_PRIORITY: tuple[Kind, ...] = (
    Kind.DETERMINISTIC,
    Kind.IO,
    Kind.OOM,
    Kind.ERROR,
    Kind.HANG,
    Kind.CRASH,
    Kind.PEER_ERROR,
)

# Phases of a step a ``recover.faults`` entry may name.
INJECTABLE_PHASES: tuple[Phase, ...] = (
    Phase.FORWARD,
    Phase.BACKWARD,
    Phase.GATE,
    Phase.REDUCE,
    Phase.AGREE,
    Phase.OPTIMIZER,
    Phase.RECOVERY,
    Phase.SAVE,
    Phase.REJOIN,
    Phase.START,  # a relaunched job restoring its state, when ``step`` is the step it starts with
)
# Of those, the points of a plain (checkpoint-restart) step.
PLAIN_PHASES: tuple[Phase, ...] = (Phase.FORWARD, Phase.BACKWARD, Phase.REDUCE, Phase.OPTIMIZER, Phase.SAVE)
# Phases in which micro-batches are computed: the only ones where an injected exception can fire.
ERROR_PHASES: tuple[Phase, ...] = (Phase.FORWARD, Phase.BACKWARD, Phase.RECOVERY)
# Injected kinds a checkpoint-restart run can take: it recovers only from a dead rank (a relaunch);
# a frozen rank or an exception in its step is what forward recovery's detectors are for.
PLAIN_INJECTED_KINDS: tuple[InjectedKind, ...] = (InjectedKind.KILL,)


def stop_bit(kind: Kind | str) -> int:
    """The bit of a stop kind in an agreed stop set (a bitwise AND of every rank's cleared bits)."""
    return 1 << STOP_ORDER.index(Kind(kind))


def first_stop(bits: int) -> Kind:
    """The stop that wins in an agreed stop set."""
    return next(k for k in STOP_ORDER if bits & stop_bit(k))


def stop_rank(kind: Kind | str | None) -> int:
    """A stop kind as a number that a MAX reduction resolves in :data:`STOP_ORDER` (0: no stop)."""
    return 0 if kind is None else len(STOP_ORDER) - STOP_ORDER.index(Kind(kind))


def stop_of_rank(rank: int) -> Kind | None:
    return None if rank == 0 else STOP_ORDER[len(STOP_ORDER) - rank]


def incident_kind(kinds: set[str]) -> Kind:
    """The kind an incident is logged as, from the kinds of everything that failed in it."""
    return next((k for k in INCIDENT_PRIORITY if k in kinds), Kind.CRASH)


def is_peer_error(error: BaseException) -> bool:
    """An error of the replica's own collectives (a peer died or the link broke), not of the math."""
    import torch.distributed as dist

    if isinstance(error, getattr(dist, "DistBackendError", ())) or isinstance(
        error, getattr(dist, "DistError", ())
    ):
        return True
    text = str(error).lower()
    return any(
        word in text for word in ("gloo", "nccl", "connection reset", "connection closed", "broken pipe")
    )


def signature(error: BaseException) -> str:
    """What makes two exceptions "the same": type and message, one line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:500]


def classify(error: BaseException) -> tuple[Kind, str]:
    """(kind, signature) of an exception met while training.

    A :class:`~nanotron_recover.errors.StopRun` of an unrepairable kind keeps its kind; a
    gloo/NCCL error is a ``peer_error``; out of memory ``oom``; any ``OSError`` ``io``; the rest
    ``error`` (which becomes ``deterministic`` only when another replica met the same signature on
    the same ids, a judgement that needs the failure records)."""
    import torch

    kind = getattr(error, "kind", None)
    if kind in UNREPAIRABLE_KINDS:
        return Kind(kind), signature(error)
    if is_peer_error(error):
        return Kind.PEER_ERROR, signature(error)
    if isinstance(error, (MemoryError, getattr(torch.cuda, "OutOfMemoryError", MemoryError))):
        return Kind.OOM, signature(error)
    if isinstance(error, OSError):
        return Kind.IO, signature(error)
    return Kind.ERROR, signature(error)
