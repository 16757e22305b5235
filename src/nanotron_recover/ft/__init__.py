"""Fault tolerance: the ULFM communicator, world epochs, topology and fail-stop (docs/architecture.md).

The communicator names are re-exported lazily: importing ``mpi4py.MPI`` initializes
MPI, which a process that only needs the topology, the watchdog or the errors and results
of ``world`` (a unit test, the policy code, a CLI tool) must not pay for or be affected by.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .failstop import Watchdog, fail_stop
from .topology import RankCoords, Topology
from .world import AllReplicasFailed, FTError, RecoveryResult, StaleEpoch, WorldChanged

if TYPE_CHECKING:
    from .comm import FAULT_ERROR_CLASSES, FaultTolerantComm, is_fault

_COMM_NAMES = frozenset({"FAULT_ERROR_CLASSES", "FaultTolerantComm", "is_fault"})


def __getattr__(name: str) -> Any:
    if name in _COMM_NAMES:
        return getattr(importlib.import_module(".comm", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FAULT_ERROR_CLASSES",
    "AllReplicasFailed",
    "FTError",
    "FaultTolerantComm",
    "RankCoords",
    "RecoveryResult",
    "StaleEpoch",
    "Topology",
    "Watchdog",
    "WorldChanged",
    "fail_stop",
    "is_fault",
]
