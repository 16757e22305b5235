"""A stand-in for :class:`~nanotron_recover.ft.comm.FaultTolerantComm` that plays the rest of the job.

One process runs one replica (``me``) of a job of ``W`` replicas with ``tp = pp = 1``. The other
alive replicas are simulated: they do exactly what the workload policy assigns them (the same
``steady_plan`` at the start of a step and the same ``repair`` after each failure), so their
contribution to every reduction can be computed here, from ``grad_of(i)`` (the gradient of
micro-batch ``i``, before the ``1/B`` loss scale) and ``loss_of(i)``.

``allreduce_`` adds the other replicas' contribution to the bucket it is given: the fake is told
the two tensors the transaction reduces (:meth:`FakeComm.bind`), finds which one the bucket is a
view of and at which offset, and adds the matching slice of the others' full contribution for the
current plan. The bookkeeping layout is the transaction's: per id of the step its count, then its
loss, then per replica the time its last failing operation began and the time it raised.

Failures (:class:`Fault`) strike at the ``index``-th call of ``allreduce_`` or ``agree`` in a step,
counted over every epoch of that step. As after a committed recovery of the real communicator,
the fake then drops the failed replicas from the alive set, bumps the epoch, repairs its plan,
tears the bucket in flight (it is filled with NaN: "holds anything") and raises
:class:`~nanotron_recover.ft.world.WorldChanged`. Failing every alive replica raises
:class:`~nanotron_recover.ft.world.AllReplicasFailed` instead, as the real one does.

Nothing here imports ``mpi4py``.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nanotron_recover.ft.processes import ProcessInfo
from nanotron_recover.ft.records import write_record
from nanotron_recover.ft.topology import Topology
from nanotron_recover.ft.world import AllReplicasFailed, RecoveryResult, StaleEpoch, WorldChanged
from nanotron_recover.policy import StepPlan, repair, steady_plan

# Made-up pids of the other ranks (far above any real pid on this machine).
FAKE_PID = 10**9
# The failure views the simulated survivors report in the bookkeeping, relative to the moment the
# failure surfaced on this replica (``detected_at``): their failing operation began OTHERS_BEGAN_S
# before it and raised OTHERS_SURFACED_S before it. On this replica the operation ran DETECT_S.
DETECT_S = 0.25
OTHERS_BEGAN_S = 0.3
OTHERS_SURFACED_S = 0.1
# With a failure record: the failure surfaces here this long after the record was written.
RECORD_LAG_S = 1.0


@dataclass(frozen=True)
class Fault:
    """``replicas`` fail during the ``index``-th ``op`` ("allreduce" or "agree") call of ``step``.

    ``record``: the failure record each rank of those replicas writes before it dies (its
    ``kind``, ``phase``, ``message``...); none for a process killed from outside. ``running``:
    when every replica fails, ranks of the failed replicas that still run besides this one.
    ``committed_elsewhere`` (an agree only): the other survivors returned from this agree before
    the failure (they committed the step and meet the failure in the next one, which they plan in
    the world before it and then repair); the recovery says so (``newest_commit``).
    """

    step: int
    op: str
    index: int
    replicas: tuple[int, ...]
    record: dict[str, Any] | None = None
    running: tuple[int, ...] = ()
    committed_elsewhere: bool = False


class FakeGlobalComm:
    """The global communicator, as far as the transaction uses it (``allgather``)."""

    def __init__(self, owner: FakeComm) -> None:
        self.owner = owner
        self.gathered: list[Any] = []

    def allgather(self, value: Any) -> list[Any]:
        self.gathered.append(value)
        owner = self.owner
        return [value if r == owner.replica else owner.others_gather for r in owner.alive_replicas]


@dataclass
class FakeComm:
    W: int
    me: int
    B: int
    grad_of: Callable[[int], torch.Tensor]
    loss_of: Callable[[int], float]
    spares: str = "shadow"
    faults: Iterable[Fault] = ()
    alive: Iterable[int] | None = None
    epoch: int = 0
    run_dir: Path | None = None  # where failure records go (faults with a record)

    # What the other replicas do besides their plan: stop bits they set in the agree, what they
    # contribute to an allgather, and errors added to their id counts (id -> delta).
    others_stop: int = 0
    others_gather: Any = None
    count_errors: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.topology = Topology(tp=1, pp=1, n_replicas=self.W)
        self.replica = self.rank = self.me
        self.local_rank = 0
        self.faults = list(self.faults)
        self._alive = sorted(range(self.W) if self.alive is None else self.alive)
        self.in_ft_operation = False
        # One process per rank: this test's own for me, made-up pids for the others (fences and
        # failure records name processes).
        self.processes = [
            ProcessInfo(r, socket.gethostname(), os.getpid() if r == self.me else FAKE_PID + r, None)
            for r in range(self.W)
        ]
        self.parked = False
        self.global_comm = FakeGlobalComm(self)
        self._bound: dict[str, torch.Tensor] = {}
        self.step: int | None = None
        self.plan: StepPlan | None = None
        self.ops: Counter[str] = Counter()
        self.others_view = (0.0, 0.0)
        # What happened: (epoch, tensor name, offset, numel) per reduction, (flag, stop) per agree.
        self.reductions: list[tuple[int, str, int, int]] = []
        self.agrees: list[tuple[bool, int]] = []
        self.results: list[RecoveryResult] = []
        self.barriers = 0
        self.watch_stopped = False
        self.last_commit = -1
        # The others committed the step a failure interrupted here: their next step is planned in
        # the world before the failure (these replicas) and repaired without the failed ones.
        self._carried: tuple[list[int], set[int]] | None = None

    # -- set-up by the test -------------------------------------------------------------------
    def bind(self, grads: torch.Tensor, bookkeeping: torch.Tensor) -> None:
        """The two tensors whose buckets ``allreduce_`` will be given."""
        self._bound = {"grads": grads, "bookkeeping": bookkeeping}

    def begin_step(self, step: int) -> None:
        """A new step: the plan every replica starts it with (the policy counts steps from 0)."""
        self.step = step
        if self._carried is not None:
            before, gone = self._carried
            self._carried = None
            self.plan = repair(steady_plan(step - 1, self.B, before, self.spares), gone).plan
        else:
            self.plan = steady_plan(step - 1, self.B, self._alive, self.spares)
        self.ops = Counter()
        self.others_view = (0.0, 0.0)

    # -- what the transaction calls -----------------------------------------------------------
    @property
    def alive_replicas(self) -> list[int]:
        return list(self._alive)

    @property
    def members(self) -> list[int]:
        """Logical ranks of the current world (one rank per replica here)."""
        return [r for rep in self._alive for r in self.topology.ranks_of_replica(rep)]

    @property
    def senior_replica(self) -> int:
        return min(self._alive)  # no re-join here: every replica has served since the start

    def allreduce_(self, buf: torch.Tensor, epoch: int) -> None:
        if epoch != self.epoch:
            raise StaleEpoch(epoch, self.epoch)
        if not buf.is_contiguous():
            raise ValueError("allreduce_ needs a contiguous tensor (it reduces in place)")
        self.in_ft_operation = True
        try:
            name, offset = self._locate(buf)
            self._maybe_fail("allreduce", torn=buf)
            self.reductions.append((self.epoch, name, offset, buf.numel()))
            buf.add_(self._others(name)[offset : offset + buf.numel()])
        finally:
            self.in_ft_operation = False

    def agree(self, flag: bool, stop: int = 0, kind: str = "step") -> tuple[bool, int]:
        if not 0 <= stop <= 0xFF:
            raise ValueError(f"stop bits must be in 0..255, got {stop}")
        self.in_ft_operation = True
        try:
            self._maybe_fail("agree")
        finally:
            self.in_ft_operation = False
        self.agrees.append((flag, stop))
        return flag, stop | self.others_stop

    def barrier(self) -> None:
        self.barriers += 1

    def stop_watch(self) -> None:
        self.watch_stopped = True

    # -- the simulation -----------------------------------------------------------------------
    def _locate(self, buf: torch.Tensor) -> tuple[str, int]:
        """Which bound tensor ``buf`` is a view of, and at which element offset."""
        for name, t in self._bound.items():
            start, size = t.data_ptr(), t.numel() * t.element_size()
            if buf.dtype == t.dtype and start <= buf.data_ptr() < start + size:
                offset = (buf.data_ptr() - start) // t.element_size()
                assert offset + buf.numel() <= t.numel()
                return name, offset
        raise AssertionError("allreduce_ of a buffer that is neither the gradients nor the bookkeeping")

    def _others(self, name: str) -> torch.Tensor:
        """The other alive replicas' summed contribution to the whole tensor ``name``, this epoch."""
        assert self.plan is not None and self.step is not None, "begin_step was not called"
        first = (self.step - 1) * self.B
        others = [r for r in self._alive if r != self.me]
        if name == "grads":
            total = torch.zeros(self._bound["grads"].numel(), dtype=torch.float64)
            for r in others:
                for i in self.plan.contributed_by(r):
                    total += self.grad_of(i).to(torch.float64) / self.B
            return total.to(self._bound["grads"].dtype)
        total = torch.zeros(2 * self.B + 2 * self.W, dtype=torch.float64)
        for r in others:
            for i in self.plan.contributed_by(r):
                total[i - first] += 1.0
                total[self.B + i - first] += self.loss_of(i)
            total[2 * self.B + r], total[2 * self.B + self.W + r] = self.others_view
        for i, delta in self.count_errors.items():
            total[i - first] += delta
        return total

    def _maybe_fail(self, op: str, torn: torch.Tensor | None = None) -> None:
        index = self.ops[op]
        self.ops[op] += 1
        fault = next(
            (f for f in self.faults if (f.step, f.op, f.index) == (self.step, op, index)),
            None,
        )
        if fault is None:
            return
        assert self.plan is not None
        gone = set(fault.replicas)
        assert gone <= set(self._alive), f"replicas {sorted(gone)} are not alive"
        survivors = [r for r in self._alive if r not in gone]
        assert self.me not in gone or not survivors, "a failed replica leaves; it is not simulated here"
        if torn is not None:
            torn.fill_(float("nan"))  # a torn reduction holds anything
        failed_ranks = tuple(r for rep in sorted(gone) for r in self.topology.ranks_of_replica(rep))
        if not survivors:
            # Every replica failed, but this process still runs (a rank of a failed replica whose
            # peer died): the recovery finds the others' ranks failed, not this one.
            still = {self.rank, *fault.running}
            failed_ranks = tuple(r for r in failed_ranks if r not in still)
        detected_at = time.time()
        if fault.record is not None:
            assert self.run_dir is not None, "a fault with a record needs run_dir"
            for rank in failed_ranks:
                record = {
                    "rank": rank,
                    "replica": self.topology.replica_of(rank),
                    "step": self.step,
                    "pid": self.processes[rank].pid,
                }
                write_record(
                    self.run_dir, f"step{self.step}_{op}{index}_rank{rank}", {**record, **fault.record}
                )
            detected_at += RECORD_LAG_S
        result = RecoveryResult(
            old_epoch=self.epoch,
            new_epoch=self.epoch + 1,
            failed_replicas=tuple(sorted(gone)),
            failed_ranks=failed_ranks,
            alive_replicas=tuple(survivors),
            trigger=op,
            detect_s=DETECT_S,
            detected_at=detected_at,
            revoke_s=0.001,
            shrink_s=0.002,
            recover_s=0.004,
            rounds=1,
        )
        if fault.committed_elsewhere:
            assert op == "agree", "only an agree can return on some ranks and raise on others"
            result = dataclasses.replace(result, newest_commit=self.step)
            self._carried = (list(self._alive), gone)
        self.results.append(result)
        if not survivors:
            raise AllReplicasFailed(result)
        if not fault.committed_elsewhere:
            self.plan = repair(self.plan, gone).plan
        self._alive = survivors
        self.epoch += 1
        self.others_view = (detected_at - OTHERS_BEGAN_S, detected_at - OTHERS_SURFACED_S)
        raise WorldChanged(result)
