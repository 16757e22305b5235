"""Forward recovery: the fault-tolerant data-parallel mode, one step as a transaction (see
:mod:`.mode` for its parts and docs/architecture.md, sections 4-6, for the protocol).

:class:`ForwardRecovery` is imported on first use: importing it starts MPI and torch, which a
process that only needs the snapshot folder (``snapshots clean`` on every node at a job's end:
:mod:`.snapshot_folder`) must not pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy_names import lazy_names

if TYPE_CHECKING:
    from .mode import ForwardRecovery

__getattr__ = lazy_names(__name__, {"ForwardRecovery": ".mode"})


__all__ = ["ForwardRecovery"]
