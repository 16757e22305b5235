"""Each replica is its own torch.distributed world.

The replica's ``tp*pp`` ranks join a world of their own, through a TCPStore hosted by the replica's
local rank 0 whose address is broadcast over the replica's MPI communicator. TP and PP groups live
in that world. Nothing in it spans two replicas, so when a replica fails its broken gloo/NCCL
connections can never block another replica: across replicas there is only the fault-tolerant MPI
communicator.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..parallel.world import World, create_store, pick_device

if TYPE_CHECKING:
    from .comm import FaultTolerantComm


def init_replica_world(ftc: FaultTolerantComm, timeout_s: float = 300.0) -> World:
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    size = ftc.topology.replica_size
    rank = ftc.local_rank
    node_local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
    device, backend = pick_device(node_local)
    timeout = timedelta(seconds=timeout_s)
    store = create_store(ftc.replica_comm, rank, size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return World(rank=rank, size=size, local_rank=node_local, device=device, backend=backend, store=store)
