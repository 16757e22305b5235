"""Re-join: moving a replica's state from a healthy replica to the ranks that bring it back.

A re-join (``recover.rejoin.mode: spawn``) brings a lost replica back at a step boundary: its
parked ranks (alive members of the failed replica, kept in the job) are reused, the dead ones are
spawned (``ft/join.py``, :func:`~nanotron_recover.ft.join.begin_join`), and every
rank of the replica receives the training state of the rank at the same ``(pp, tp)`` coordinate of
a healthy replica, over that coordinate's DP communicator:

- every coordinate moves in parallel (one donor -> receiver pair per coordinate and re-joining
  replica), so the transfer takes one shard's size over the link's bandwidth whatever the number
  of replicas; with several replicas coming back, the donors are spread over the healthy replicas;
- the donor first sends the state's layout (names, shapes, dtypes) and its small metadata (RNG
  states, optimizer step counts), then every tensor as raw bytes, all in flight at once;
- what is *not* sent is a function of the committed step, which the join's header carries: the
  data position (micro-batch ids are a function of the step) and the learning rate.

Any MPI fault during the transfer makes the join abort uniformly at its commit agree; the donor's
own state is never modified by a transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...engines.state import EngineState


@dataclass
class TransferResult:
    ok: bool
    received: EngineState | None  # on a receiver
    state_bytes: int  # sent or received by this rank
    seconds: float


def _bytes_view(t: torch.Tensor) -> np.ndarray:
    """A writeable uint8 NumPy view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return t.view(torch.uint8).reshape(-1).numpy() if t.numel() else np.empty(0, dtype=np.uint8)


def _eager_parts(t: torch.Tensor) -> list[np.ndarray]:
    """``t``'s bytes cut into messages below the TCP eager limit (ft/transport.py: a rendezvous
    message torn by a fault can deadlock Open MPI's TCP transport). MPI keeps the order of
    messages with the same source, tag and communicator, so the receiver's parts, cut the same
    way, match the sender's one for one."""
    from ...ft.transport import eager_slices

    view = _bytes_view(t)
    return [view[part] for part in eager_slices(view.size, 1)]


def donor_of(receiver_replica: int, donors: list[int], rejoining: list[int]) -> int:
    """The healthy replica that sends its state to ``receiver_replica``: the re-joining replicas in
    order take the donors in turn, so several joins spread over several donors."""
    return donors[sorted(rejoining).index(receiver_replica) % len(donors)]


def transfer_state(
    dp_comm: Any,
    my_replica: int,
    donors: list[int],
    rejoining: list[int],
    export: Any,
    *,
    fault_point: Any = None,
) -> TransferResult:
    """Move the state along this coordinate's DP communicator (members ordered by replica id).

    ``export()`` gives this rank's :class:`EngineState` (called on donors only). Returns what this
    rank received (receivers), or sent. ``fault_point()`` runs mid-transfer (fault injection)."""
    from mpi4py import MPI

    from ...ft.comm import is_fault

    members = sorted(set(donors) | set(rejoining))
    position = {r: i for i, r in enumerate(members)}
    t0 = time.perf_counter()
    received: EngineState | None = None
    nbytes = 0
    try:
        if my_replica in rejoining:
            source = position[donor_of(my_replica, donors, rejoining)]
            layout, meta = dp_comm.recv(source=source, tag=1)
            if fault_point is not None:
                fault_point()
            received = EngineState.empty_like(layout, meta)
            requests = [
                dp_comm.Irecv(part, source=source, tag=2)
                for t in received.tensors.values()
                if t.numel()
                for part in _eager_parts(t)
            ]
            MPI.Request.Waitall(requests)
            nbytes = received.nbytes()
        else:
            mine = [r for r in rejoining if donor_of(r, donors, rejoining) == my_replica]
            if mine:
                state = export()
                nbytes = state.nbytes() * len(mine)
                for r in mine:
                    dp_comm.send((state.layout(), state.meta), dest=position[r], tag=1)
                if fault_point is not None:
                    fault_point()
                requests = [
                    dp_comm.Isend(part, dest=position[r], tag=2)
                    for r in mine
                    for t in state.tensors.values()
                    if t.numel()
                    for part in _eager_parts(t)
                ]
                MPI.Request.Waitall(requests)
    except MPI.Exception as exc:
        # A Waitall over several requests reports a peer's failure as MPI_ERR_IN_STATUS.
        if not (is_fault(exc) or exc.Get_error_class() == MPI.ERR_IN_STATUS):
            raise
        try:
            dp_comm.Revoke()  # wake the other side of this coordinate
        except MPI.Exception:
            pass
        return TransferResult(False, None, nbytes, time.perf_counter() - t0)
    return TransferResult(True, received, nbytes, time.perf_counter() - t0)
