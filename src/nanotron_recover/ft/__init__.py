"""Fault tolerance: the ULFM communicator, world epochs, topology and fail-stop (docs/architecture.md).

The communicator names are re-exported lazily: importing ``mpi4py.MPI`` initializes
MPI, which a process that only needs the topology, the watchdog or the errors and results
of ``world`` (a unit test, the policy code, a CLI tool) must not pay for or be affected by.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy_names import lazy_names
from .failstop import Watchdog, fail_stop
from .topology import RankCoords, Topology
from .world import AllReplicasFailed, FTError, RecoveryResult, StaleEpoch, WorldChanged

if TYPE_CHECKING:
    from .comm import FAULT_ERROR_CLASSES, FaultTolerantComm, is_fault

__getattr__ = lazy_names(
    __name__, {name: ".comm" for name in ("FAULT_ERROR_CLASSES", "FaultTolerantComm", "is_fault")}
)


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
