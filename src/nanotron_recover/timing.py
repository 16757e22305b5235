"""Where a step's time goes: seconds per phase, measured where each phase happens.

The trainer owns one :class:`PhaseTimes` and hands it to the data-parallel mode
(``ReplicaParts.times``); each part adds the phases it runs, and every step's metrics record
carries :meth:`PhaseTimes.record` (and so does W&B, which logs the same record):

- ``compute_s``: the replica's own micro-batches (forward and backward);
- ``gate_s``: the replica-consistency barrier (forward recovery);
- ``reduce_s``, ``reduce_bytes``, ``reduce_gbps``: the cross-replica gradient reduction, the bytes
  handed to the collective and their rate (bytes / ``reduce_s``, in GB/s). Only reductions that
  completed count; a reduction redone after a failure counts again;
- ``agree_s``: the commit agree (forward recovery);
- ``optimizer_s``: clipping and the optimizer step;
- ``checkpoint_s``: checkpoint saves and node-memory snapshots. They run between steps, after the
  previous step's record was taken, so they count in the next step's record: step ``s`` holds the
  save (or staging, with asynchronous saves) and the snapshot started after step ``s - 1``, and the
  wait for that snapshot's copy before its own optimizer step;
- ``recovery_s``: repairing a failure inside the step: the failed collective (its detection and the
  communicator's shrink), the repaired plan, restored buckets, recomputed micro-batches;
- ``wall_s``: the window all of these fall in, from the end of the previous step's optimizer (the
  start of training for the first step) to the end of this one's. The phases sum to at most
  ``wall_s``; the rest is unattributed (the loss reduction, logging, a re-join's join point).
  ``step_time_s`` is this step's own part of ``wall_s``, without the work between steps.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

PHASES = ("compute", "gate", "reduce", "agree", "optimizer", "checkpoint", "recovery")


class PhaseTimes:
    """Seconds per phase (:data:`PHASES`) since :meth:`start`; ``clock`` for tests."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.start()

    def start(self) -> None:
        """A new window: what is measured from now on belongs to the next record."""
        self.started = self._clock()
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.reduce_bytes = 0

    def now(self) -> float:
        return self._clock()

    def add(self, phase: str, since: float, nbytes: int = 0) -> float:
        """Count the time from ``since`` to now in ``phase`` (and ``nbytes`` reduced, for
        ``reduce``); returns now, the start of whatever follows."""
        if phase not in self.seconds:
            raise KeyError(f"unknown phase {phase!r}; phases: {', '.join(PHASES)}")
        now = self._clock()
        self.seconds[phase] += now - since
        self.reduce_bytes += nbytes
        return now

    @contextlib.contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        """Count the time spent in the ``with`` block in ``phase`` (also when it raises)."""
        since = self._clock()
        try:
            yield
        finally:
            self.add(phase, since)

    def record(self) -> dict[str, float]:
        """The fields of a metrics record for the window so far (see the module docstring)."""
        fields: dict[str, float] = {f"{name}_s": seconds for name, seconds in self.seconds.items()}
        reduce_s = self.seconds["reduce"]
        fields["reduce_bytes"] = self.reduce_bytes
        fields["reduce_gbps"] = self.reduce_bytes / reduce_s / 1e9 if reduce_s > 0 else 0.0
        fields["wall_s"] = self._clock() - self.started
        return fields
