"""The data-parallel seam: how a step's gradient crosses replicas, as one protocol.

The trainer owns the loop (steps, logging, checkpoints, the optimizer) and a model engine
(``engines/``). *How* the step's micro-batches are split over the replicas and their gradients summed
is a :class:`DataParallelMode`, built by the command line from the config and handed to the trainer:

- :class:`~.plain.PlainDataParallel`: one torch world; a torch.distributed all-reduce. The
  fault-free reference (and the checkpoint-restart baseline's mode).
- :class:`~nanotron_recover.data_parallel.forward.ForwardRecovery`: each replica its own torch
  world, the sum over the ULFM communicator in snapshotted buckets, a step as a transaction that
  survives failures.

A mode sees the rest of the system only through :class:`ReplicaParts`: the model engine, the data,
a checkpoint callback and a reporter. Neither mode imports the trainer. The protocol holds only what
both modes answer; forward recovery's own turns reach the loop as data:

- ``setup_world()`` returns, beside the world, a :class:`JoinedState` for a process spawned into a
  running job by a re-join (the state a healthy replica sent, instead of a checkpoint), else None.
- A rank whose replica fails while the rank itself is healthy (re-join) raises :class:`Parked` out
  of the step; ``parked.wait_for_rejoin()`` returns once the replica re-joins (the committed step,
  a healthy replica's state, the replica's new torch world), and the trainer rebuilds its engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from ..data import MicroBatchSource
from ..engines import ModelEngine
from ..errors import StopRun
from ..parallel.context import ParallelContext
from ..parallel.world import World
from ..timing import PhaseTimes


@dataclass
class ReducedStep:
    """What a data-parallel mode hands back once the step's gradient is summed in the buffer."""

    loss: float  # sum of the contributed micro-batch losses / B
    ids: list[int]  # micro-batch ids the summed gradient contains
    replicas: int
    extra: dict[str, Any] = field(default_factory=dict)  # mode-specific metrics


@dataclass
class JoinedState:
    """What a rank that (re-)joins training starts from: a healthy replica's state."""

    step: int  # the last committed step; training goes on with step + 1
    engine_state: Any  # engines.state.EngineState, imported into a freshly built engine
    world: World
    ctx: ParallelContext


class Parked(BaseException):
    """This rank's replica failed, the rank did not: it is kept (parked) for a re-join.

    A ``BaseException``: it is control flow out of the step, which no ``except Exception`` on the
    way (a failed micro-batch, a failed save) may mistake for an error of its own. The mode that
    raised it sets ``wait_for_rejoin``: it blocks until the replica is back (or the run ends: exit)."""

    wait_for_rejoin: Callable[[], JoinedState]


@dataclass
class ReplicaParts:
    """Everything a data-parallel mode drives or reports to, on this rank."""

    engine: ModelEngine
    data: Callable[[int], MicroBatchSource]  # step -> the micro-batch source of its data stage
    save: Callable[[int, bool], Path | None]  # (step, synchronous) -> checkpoint path (writers)
    log_incident: Callable[[dict[str, Any]], None]  # to W&B (the JSONL log is the mode's)
    write_line: Callable[[str], None]  # a line for the user (above the progress bar)
    write_outcome: Callable[[str, int, StopRun | None], bool]  # (status, last step, stop)
    world: World  # this rank's torch world (the replica's, in recover mode)
    ctx: ParallelContext
    B: int  # micro-batches per step
    G: int  # micro-batches per replica per step, at full width
    target_step: Callable[[], int]  # the last step this run trains (re-joins stop before it)
    times: PhaseTimes = field(default_factory=PhaseTimes)  # where the step's time goes (timing.py)


class DataParallelMode(Protocol):
    def setup_world(self) -> tuple[World, ParallelContext, JoinedState | None]:
        """This rank's torch world, and the state to start from if it joins a running job."""

    def attach(self, parts: ReplicaParts) -> None: ...
    def agree_startup(self, error: str | None) -> str | None:
        """Every rank learns the first start-up error of any rank (or None)."""

    def reduced_gradients(self, step: int) -> ReducedStep: ...
    def fault_point(self, phase: str) -> None:
        """A point where an injected fault may fire (``failures.Phase``: optimizer, save)."""

    def after_step(self, step: int) -> None: ...
    def local_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A phase only this replica takes part in (under the watchdog in recover mode)."""

    def request_stop(self, stop: StopRun) -> None:
        """Stop the whole job at the next agreement point."""

    def check_member(self) -> None:
        """Before writing shared files: this rank is still a member of the job."""

    def finish(self, last_step: int, resave: Callable[[int], Any] | None = None) -> None: ...
    def is_logger(self) -> bool: ...
    def is_checkpoint_writer(self) -> bool: ...
    def replica_id(self) -> int: ...
    def abort(self, error: BaseException) -> None: ...
    def close(self) -> None: ...
