"""State on a restart without disk: a relaunched job starts from the replicas' node-memory snapshots.

When the job is relaunched inside its allocation after a node was lost (``supervisor.py``), the
ranks of the new job land on the surviving nodes and on spare ones. Every data-parallel replica
held the same state, so any replica's snapshot of a ``(pp, tp)`` coordinate will do:

1. Each rank lists the steps its own node holds for its coordinate (``snapshots.py``).
2. One allgather; every rank computes the same answer: the newest step that *every* coordinate
   holds on some node of the new job (:func:`newest_common_step`). None, or older than the disk
   checkpoint the run would resume from: the run falls back to that checkpoint, and says so.
3. Per coordinate, the replicas whose node holds that step load it locally; the others (new or
   spare nodes) receive it over the coordinate's DP communicator from a replica that has it, with
   the re-join's state transfer (``state_transfer.py``). A snapshot that cannot be read any more
   (removed since it was listed, or damaged) counts as not held; a coordinate left without a
   readable copy makes every rank fall back to the disk checkpoint alike, and says so.
4. Training goes on with the step after it; the steps after the snapshot are redone with the same
   micro-batch ids, so the curve is the fault-free curve.
"""

from __future__ import annotations

from ...config import Config
from ...engines.state import EngineState
from .snapshots import NodeSnapshots
from .state_transfer import transfer_state


def snapshot_layout_id(cfg: Config) -> str:
    """What a coordinate means: a snapshot is read only by the same layout inside a replica."""
    p = cfg.parallelism
    return f"tp{p.tp}-pp{p.pp}-shard{p.dp_shard}-{cfg.model.dtype}"


def newest_common_step(holdings: list[tuple[int, list[int]]], coordinates: int) -> int | None:
    """The newest step that every coordinate ``0 .. coordinates-1`` holds on some rank, from each
    rank's ``(coordinate, steps held on its node)``; None when some coordinate holds nothing."""
    held: dict[int, set[int]] = {c: set() for c in range(coordinates)}
    for coordinate, steps in holdings:
        held[coordinate].update(steps)
    common = set.intersection(*held.values()) if held else set()
    return max(common) if common else None


def restore_from_snapshots(
    ftc: object,
    snapshots: NodeSnapshots,
    coordinates: int,
    at_most: int | None = None,
    disk_step: int | None = None,
) -> tuple[int, EngineState] | None:
    """Steps 1-3 above on every rank of the new job: the step restored and this rank's state, or
    None on every rank alike (use the disk checkpoint). ``at_most``: the last step the previous
    generation committed; a newer snapshot can only come from a process that was cut off from the
    job and trained on alone, and is never used. ``disk_step``: the step of the disk checkpoint the
    run would otherwise resume from, as this rank reads it; a snapshot older than the newest any
    rank read is not used (the run resumes from the disk, which holds the newer state: snapshots
    taken less often than checkpoints, or by fewer replicas), and one as new is preferred (local).

    A snapshot listed but not readable any more (removed in between, or damaged) counts as not
    held: the rank receives the state from another replica of its coordinate that did read it;
    when no replica of some coordinate could, every rank falls back, and the ranks that failed to
    read say why. The answers are agreed over the same collectives on every rank, so no rank waits
    in a transfer that another rank skipped."""
    mine = sorted({p.step for p in snapshots.available() if at_most is None or p.step <= at_most})
    if snapshots.refused is not None:
        print(f"[nanotron-recover] rank {ftc.rank}: warning: {snapshots.refused}", flush=True)
    gathered = ftc.global_comm.allgather((ftc.local_rank, mine, disk_step))
    step = newest_common_step([(c, steps) for c, steps, _ in gathered], coordinates)
    disk = max((d for _, _, d in gathered if d is not None), default=None)
    if step is None:
        return None
    if disk is not None and step < disk:
        if ftc.rank == 0:
            print(
                f"[nanotron-recover] relaunched: the disk checkpoint of step {disk} is newer than the "
                f"newest step the nodes' snapshots hold ({step})",
                flush=True,
            )
        return None
    state, error = None, None
    if step in mine:
        try:
            state = snapshots.load(step)
        except (OSError, ValueError) as exc:  # FileNotFoundError included: gone since it was listed
            error = f"{type(exc).__name__}: {exc}"
            print(
                f"[nanotron-recover] rank {ftc.rank}: warning: the node snapshot of step {step} "
                f"could not be read ({error}); it counts as not held here",
                flush=True,
            )
    # Replicas of my coordinate that read the step (the DP communicator orders by replica).
    has = ftc.dp_comm.allgather((ftc.replica, state is not None))
    donors = sorted(r for r, holds in has if holds)
    receivers = sorted(r for r, holds in has if not holds)
    # Every coordinate needs a donor; one without is known to its own ranks only: ask everyone.
    coverable = ftc.global_comm.allgather(bool(donors))
    if not all(coverable):
        if ftc.rank == 0:
            print(
                f"[nanotron-recover] relaunched: the node snapshot of step {step} could not be read "
                "by any replica of some coordinate",
                flush=True,
            )
        return None
    if not receivers:
        return step, state
    transfer = transfer_state(ftc.dp_comm, ftc.replica, donors, receivers, export=lambda: state)
    if not transfer.ok:
        raise RuntimeError(
            f"restoring step {step} from node snapshots failed: a peer was lost during the transfer"
        )
    return step, transfer.received if ftc.replica in receivers else state
