"""Forward recovery: the fault-tolerant data-parallel mode, one step as a transaction (see
:mod:`.mode` for its parts and docs/architecture.md, sections 4-6, for the protocol)."""

from .mode import ForwardRecovery

__all__ = ["ForwardRecovery"]
