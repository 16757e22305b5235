"""Starting the torch.distributed world from whatever launched us.

Ranks are started by ``mpirun`` (the launcher the fault-tolerant mode needs: ULFM lives in Open MPI),
so rank and size come from MPI. Rank 0 opens a TCPStore on a free port and broadcasts its address
over MPI; everyone then joins the torch world through that store. Without MPI (a plain ``python``
run) the world is a single process. ``torchrun``-style ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``
environments are honoured too.

Device: CUDA + NCCL when a GPU is visible (one GPU per local rank), CPU + gloo otherwise. The
bitwise-exact mode (``recover.exact``) asks for deterministic CUDA kernels on top
(:func:`deterministic_kernels`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

MPI_ENV_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")


def launched_by_mpi() -> bool:
    return any(v in os.environ for v in MPI_ENV_VARS)


@dataclass(frozen=True)
class World:
    rank: int
    size: int
    local_rank: int
    device: torch.device
    backend: str
    # The store the world was created from (a replica's TCPStore): the gate's keys live there
    # (``ft/gate.py``). None where nothing needs it.
    store: dist.Store | None = field(default=None, compare=False, repr=False)


def pick_device(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available() and os.environ.get("NANOTRON_RECOVER_DEVICE", "") != "cpu":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device()), "nccl"
    return torch.device("cpu"), "gloo"


# cuBLAS is deterministic only with one of these workspace configurations (CUDA >= 10.2); the first
# is the larger, faster one.
CUBLAS_WORKSPACE_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = ":4096:8"
_CUBLAS_DETERMINISTIC_ANY = (":4096:8", ":16:8")


def deterministic_kernels(device_type: str) -> str | None:
    """Make the kernels of a bitwise-exact run on ``device_type`` deterministic; the start-up line.

    Exact mode (``recover.exact``) makes the sums of micro-batch gradients order-free, which gives
    bit-identical runs only if each micro-batch's gradient is itself the same bits every time. On
    CUDA that takes deterministic kernels: this calls ``torch.use_deterministic_algorithms(True)``
    (an operation without a deterministic CUDA kernel then raises instead of varying) and sets
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, which cuBLAS reads when it makes its first workspace, so
    this runs before the first matrix product. A value already set is kept, and the line says so
    (cuBLAS is deterministic with ``:4096:8`` or ``:16:8`` only). On any other device nothing is
    changed and None is returned.
    """
    if device_type != "cuda":
        return None
    torch.use_deterministic_algorithms(True)
    given = os.environ.get(CUBLAS_WORKSPACE_ENV)
    if given is None:
        os.environ[CUBLAS_WORKSPACE_ENV] = CUBLAS_DETERMINISTIC
        return (
            "recover.exact on CUDA: deterministic kernels (torch.use_deterministic_algorithms(True), "
            f"{CUBLAS_WORKSPACE_ENV}={CUBLAS_DETERMINISTIC})"
        )
    if given == CUBLAS_DETERMINISTIC:
        return (
            "recover.exact on CUDA: deterministic kernels (torch.use_deterministic_algorithms(True), "
            f"{CUBLAS_WORKSPACE_ENV}={given} as already set)"
        )
    consequence = (
        "also deterministic, with a smaller workspace"
        if given in _CUBLAS_DETERMINISTIC_ANY
        else "cuBLAS is deterministic only with :4096:8 or :16:8, so a matrix product may raise"
    )
    return (
        "warning: recover.exact on CUDA: deterministic kernels (torch.use_deterministic_algorithms(True)), "
        f"but {CUBLAS_WORKSPACE_ENV}={given!r} is kept as set, not {CUBLAS_DETERMINISTIC}: {consequence}"
    )


def _host_address() -> str:
    override = os.environ.get("NANOTRON_RECOVER_MASTER_ADDR")
    if override:
        return override
    host = socket.gethostname()
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "127.0.0.1"


def init_world(timeout_s: float = 300.0) -> World:
    """Join (or create) the torch.distributed default group for this process."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    timeout = timedelta(seconds=timeout_s)
    if launched_by_mpi():
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        rank, size = comm.Get_rank(), comm.Get_size()
        local_rank = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", os.environ.get("MPI_LOCALRANKID", 0)))
        device, backend = pick_device(local_rank)
        store = create_store(comm, rank, size, timeout)
    elif "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device, backend = pick_device(local_rank)
        store = dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", 29500)),
            size,
            is_master=rank == 0,
            timeout=timeout,
        )
    else:
        rank, size, local_rank = 0, 1, 0
        device, backend = pick_device(0)
        store = dist.HashStore()
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    return World(rank=rank, size=size, local_rank=local_rank, device=device, backend=backend)


def create_store(comm, rank: int, size: int, timeout: timedelta) -> dist.Store:
    """A TCPStore hosted by ``rank`` 0 of MPI communicator ``comm``, address broadcast over ``comm``."""
    if rank == 0:
        store = dist.TCPStore(
            _host_address(), 0, size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        address = (_host_address(), store.port)
    else:
        address = None
    address = comm.bcast(address, root=0)
    if rank != 0:
        store = dist.TCPStore(address[0], address[1], size, is_master=False, timeout=timeout)
    return store
