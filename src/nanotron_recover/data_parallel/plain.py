"""PlainDataParallel: one torch world; the step's gradient is summed by a torch.distributed all-reduce.

Data rank ``d`` computes the ``G`` consecutive ids from ``(s-1)*B + d*G`` of step ``s``; the flat
gradient is all-reduced over the ranks holding the same slice of the model in every replica (NCCL
on GPU, gloo on CPU). This is the fault-free reference the forward-recovery mode is compared with,
and the mode the checkpoint-restart baseline runs in (a fault kills the job, the launcher relaunches
it from the last checkpoint). Stops (a full disk) are agreed by one scalar all-reduce per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .. import fencing
from ..config import Config, check_world_size
from ..errors import StopRun
from ..failures import Phase, stop_of_rank, stop_rank
from ..ft.faults import FaultInjector
from ..parallel.context import ParallelContext
from ..parallel.world import World, init_world
from .protocol import ReducedStep, ReplicaParts


class PlainDataParallel:
    """One torch world; the DP all-reduce is a torch.distributed collective.

    This is also the checkpoint-restart baseline (``recover.mode: checkpoint_restart``): injected
    faults kill their rank here like in the fault-tolerant mode, the whole job dies with it, and
    the launcher relaunches it from the last checkpoint (``restart.py``).
    """

    def __init__(self, cfg: Config, run_dir: Path | None = None):
        self.cfg, self.run_dir = cfg, run_dir
        self.injector: FaultInjector | None = None
        self.pending_stop: StopRun | None = None

    def setup_world(self) -> tuple[World, ParallelContext, None]:
        world = init_world()
        check_world_size(self.cfg, world.size)
        p = self.cfg.parallelism
        return world, ParallelContext.create(p.inner, p.pp, p.dp, world.device), None  # nothing joins

    def attach(self, parts: ReplicaParts) -> None:
        self.parts = parts
        self.last_committed = 0
        r = self.cfg.recover
        if r.checkpoint_restart and self.run_dir is not None:
            self.injector = FaultInjector(r, parts.world.rank, parts.ctx.dp_rank, self.run_dir)
            parts.engine.event_hook = lambda kind, i: self.injector.maybe_fail(kind, i)

    def my_ids(self, step: int) -> list[int]:
        t = self.parts
        first = (step - 1) * t.B + t.ctx.dp_rank * t.G
        return list(range(first, first + t.G))

    def reduced_gradients(self, step: int) -> ReducedStep:
        t, ctx = self.parts, self.parts.ctx
        ids = self.my_ids(step)
        if self.injector is not None:
            self.injector.begin_step(step, list(range(ctx.dp)))
        source = t.data(step)
        with t.times.phase("compute"):
            losses = t.engine.train_batch([source.get(i) for i in ids], loss_scale=1.0 / t.B)
        if self.injector is not None:
            self.injector.maybe_fail(Phase.REDUCE, 0)
        if ctx.dp > 1:
            grads, since = t.engine.grads_flat, t.times.now()
            dist.all_reduce(grads, group=ctx.dp_group)
            t.times.add("reduce", since, grads.numel() * grads.element_size())
        # The loss lives on the last stage (its tp ranks hold the same value: count tp rank 0). Each
        # micro-batch's loss goes to its own slot, one rank contributes to each, and the slots are
        # summed in id order: the step's loss does not depend on the reduction's order, and is
        # the one forward recovery computes the same way.
        by_slot = torch.zeros(t.B, dtype=torch.float64, device=t.world.device)
        if t.engine.holds_loss:
            first = (step - 1) * t.B
            for i, loss in zip(ids, losses, strict=True):
                by_slot[i - first] = loss
        dist.all_reduce(by_slot)
        return ReducedStep(by_slot.sum().item() / t.B, self._gather_ids(ids), ctx.dp)

    def _gather_ids(self, ids: list[int]) -> list[int]:
        """The ids every data rank actually consumed this step (what ``ids_digest`` is computed on)."""
        ctx = self.parts.ctx
        if ctx.dp == 1:
            return ids
        mine = torch.tensor(ids, dtype=torch.int64, device=self.parts.world.device)
        parts = [torch.empty_like(mine) for _ in range(ctx.dp)]
        dist.all_gather(parts, mine, group=ctx.dp_group)
        return torch.cat(parts).tolist()

    def agree_startup(self, error: str | None) -> str | None:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return error
        errors: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        return next((e for e in errors if e is not None), None)

    def local_phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def request_stop(self, stop: StopRun) -> None:
        if self.pending_stop is None:
            self.pending_stop = stop

    def _agree_stop(self) -> None:
        """Every rank stops together if any rank asked to (one scalar all-reduce)."""
        mine = stop_rank(self.pending_stop.kind if self.pending_stop is not None else None)
        code = torch.tensor([mine], dtype=torch.int64, device=self.parts.world.device)
        if self.parts.world.size > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MAX)  # the first kind of STOP_ORDER wins
        kind = stop_of_rank(int(code.item()))
        if kind is not None:
            if self.pending_stop is not None and self.pending_stop.kind == kind:
                raise self.pending_stop
            raise StopRun(kind, f"stop requested by another rank ({kind})")

    def after_step(self, step: int) -> None:
        self.last_committed = step
        self._agree_stop()

    def fault_point(self, phase: str) -> None:
        if self.injector is not None:
            self.injector.maybe_fail(phase, 0)

    def finish(self, last_step: int, resave: Callable[[int], Any] | None = None) -> None:
        self._agree_stop()
        if self.parts.world.rank == 0 and self.run_dir is not None:
            self.parts.write_outcome("completed", last_step, None)

    def check_member(self) -> None:
        # A process of an older job in this run directory (fencing.py) writes nothing.
        fencing.guard_adopted("the run's files")

    def is_logger(self) -> bool:
        return self.parts.world.rank == 0

    def is_checkpoint_writer(self) -> bool:
        return True  # every rank takes part; data rank 0 writes the shards

    def replica_id(self) -> int:
        return self.parts.ctx.dp_rank

    def abort(self, error: BaseException) -> None:
        if isinstance(error, StopRun) and self.parts.world.rank == 0 and self.run_dir is not None:
            self.parts.write_outcome("stopped", self.last_committed, error)
        raise error

    def close(self) -> None:
        """Tear the torch world down in order, so no gloo thread is left alive at interpreter exit."""
        if dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()
