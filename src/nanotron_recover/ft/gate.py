"""The replica-consistency gate through the replica's store, with a timeout on every backend.

Before a replica's gradients cross to the other replicas, its ranks meet at a gate
(``data_parallel/forward/step.py``): a rank whose peer is stuck (a hung kernel, a stuck NCCL call)
must not go on alone. On gloo, ``torch.distributed.monitored_barrier`` is such a gate, with a
timeout that names the missing ranks; NCCL has no monitored barrier, and its plain barrier is
bounded only by the process group's timeout. :class:`StoreGate` is the same gate for any backend:
each rank sets a key of its own in the replica's TCPStore (the one its torch world was created
from, ``ft/replica_world.py``) and waits for every other rank's key, at most ``timeout_s``; past it,
:class:`GateTimeout` names the ranks whose key is missing.

Gate ``n`` of a world uses the keys ``<prefix>/<n>/<rank>``: every rank of the replica passes the
same gates in the same order (the step's attempts are the same on all of them). Once a rank has
passed gate ``n``, every rank has arrived there and so is past gate ``n - 1``: the rank then removes
its key of gate ``n - 1``, so the store holds at most two keys per rank.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

PREFIX = "nanotron_recover/gate"
# How long naming the missing ranks may take after a timeout: the store may itself be stuck (its
# host, local rank 0, frozen); then the gate still fails, without the names.
CHECK_TIMEOUT_S = 5.0


class GateTimeout(RuntimeError):
    """Ranks of the replica did not reach the gate within its timeout. ``missing``: those ranks
    (None when the store could not say)."""

    def __init__(self, gate: int, timeout_s: float, missing: list[int] | None):
        self.gate, self.timeout_s, self.missing = gate, timeout_s, missing
        who = (
            f"rank(s) {missing} of the replica did not arrive"
            if missing
            else "the replica's store did not say which ranks are missing (its host, local rank 0, may be stuck)"
        )
        super().__init__(f"gate {gate} timed out after {timeout_s:g}s: {who}")


class StoreGate:
    """A barrier of the ``size`` ranks of one world through ``store``, with a timeout."""

    def __init__(self, store: dist.Store, rank: int, size: int, prefix: str = PREFIX):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a world of {size}")
        self.store, self.rank, self.size, self.prefix = store, rank, size, prefix
        self.passed = 0  # gates this rank has passed

    def key(self, gate: int, rank: int) -> str:
        return f"{self.prefix}/{gate}/{rank}"

    def __call__(self, timeout_s: float) -> None:
        """Arrive at the next gate and wait, at most ``timeout_s``, for every other rank to arrive.
        Raises :class:`GateTimeout` naming the ranks that did not; a store that fails (its host
        died) raises its own error."""
        gate = self.passed + 1
        self.store.set(self.key(gate, self.rank), b"1")
        others = [self.key(gate, r) for r in range(self.size) if r != self.rank]
        if others:
            try:
                self.store.wait(others, timedelta(seconds=timeout_s))
            except dist.DistStoreError as e:
                if "timeout" not in str(e).lower():
                    raise
                raise GateTimeout(gate, timeout_s, self._missing(gate)) from None
        self.passed = gate
        if gate > 1:
            self.store.delete_key(self.key(gate - 1, self.rank))

    def _missing(self, gate: int) -> list[int] | None:
        """The ranks whose key of ``gate`` is not in the store; None if the store does not answer."""
        try:
            self.store.set_timeout(timedelta(seconds=CHECK_TIMEOUT_S))
            return [
                r for r in range(self.size) if r != self.rank and not self.store.check([self.key(gate, r)])
            ]
        except Exception:
            return None
