"""Forward recovery: the fault-tolerant data-parallel mode, one step as a transaction (see
:mod:`.mode` for its parts and docs/architecture.md, sections 4-6, for the protocol).

:class:`ForwardRecovery` is imported on first use: importing it starts MPI and torch, which a
process that only needs the snapshot folder (``snapshots clean`` on every node at a job's end:
:mod:`.snapshot_folder`) must not pay for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .mode import ForwardRecovery


def __getattr__(name: str) -> Any:
    if name == "ForwardRecovery":
        from .mode import ForwardRecovery

        return ForwardRecovery
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ForwardRecovery"]
