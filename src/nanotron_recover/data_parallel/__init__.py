"""How gradients cross replicas: the data-parallel seam (see :mod:`.protocol`).

The names are imported on first use (they import torch): a process that needs only a torch-free
part of the package (:mod:`.forward.snapshot_folder`) does not load them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..lazy_names import lazy_names

if TYPE_CHECKING:
    from ..config import Config
    from .plain import PlainDataParallel
    from .protocol import DataParallelMode, JoinedState, Parked, ReducedStep, ReplicaParts

__getattr__ = lazy_names(
    __name__,
    {
        "PlainDataParallel": ".plain",
        "DataParallelMode": ".protocol",
        "JoinedState": ".protocol",
        "Parked": ".protocol",
        "ReducedStep": ".protocol",
        "ReplicaParts": ".protocol",
    },
)


def build_data_parallel(cfg: Config, run_dir: Path) -> DataParallelMode:
    """The data-parallel mode the config asks for. The fault-tolerant one needs MPI started with the
    heartbeat detector's parameters and the failure watch running (``train`` does that before it
    builds anything; a caller that did not is served here)."""
    if cfg.recover.forward:
        if "mpi4py.MPI" not in sys.modules:
            from ..ft.heartbeat import start_mpi

            start_mpi(cfg.recover.heartbeat_period_s, cfg.recover.heartbeat_timeout_s)
        from .forward import ForwardRecovery

        return ForwardRecovery(cfg, run_dir)
    from .plain import PlainDataParallel

    return PlainDataParallel(cfg, run_dir)


__all__ = [
    "DataParallelMode",
    "JoinedState",
    "Parked",
    "PlainDataParallel",
    "ReducedStep",
    "ReplicaParts",
    "build_data_parallel",
]
