"""How the ranks of a synchronous save agree, over the default torch.distributed group.

:func:`_agree` is one all-reduce: the lowest failing rank (None if none failed) and rank 0's random
``save_id``; it doubles as a barrier, bounded by the process group's timeout. When a rank failed,
:func:`_shared_failure` broadcasts its error, so that every rank raises the same one. Without an
initialized process group a save is a world of one rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import CheckpointError, _error_from_record, _error_record


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agree(failure: CheckpointError | None, nonce: int = 0) -> tuple[int | None, int]:
    """All-reduce (MIN) over the default group: the lowest failing rank (None if none failed) and
    rank 0's ``nonce``. Doubles as a barrier, bounded by the process group's timeout."""
    rank, world = _rank_world()
    if world == 1:
        return (0 if failure is not None else None), nonce
    never = torch.iinfo(torch.int64).max
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flags = torch.tensor(
        [rank if failure is not None else world, nonce if rank == 0 else never],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)
    first, agreed_nonce = (int(x) for x in flags.tolist())
    return (first if first < world else None), agreed_nonce


def _shared_failure(first: int, own: CheckpointError | None) -> CheckpointError:
    """The error of the lowest failing rank, on every rank (broadcast from it), so all raise alike."""
    rank, world = _rank_world()
    if world == 1 and own is not None:
        return own
    payload = [_error_record(own) if rank == first and own is not None else None]
    dist.broadcast_object_list(payload, src=first)
    if rank == first and own is not None:
        return own
    return _error_from_record(payload[0])
