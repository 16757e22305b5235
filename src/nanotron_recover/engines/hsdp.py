"""The HSDP engine as a :class:`~nanotron_recover.engines.ModelEngine`: FSDP2 inside a replica.

Each replica is ``parallelism.dp_shard`` ranks running ``fully_shard`` over their group
(``parallel/hsdp/``): parameters, gradients and AdamW state are sharded inside the replica, the
gradient is reduce-scattered as a *sum* (not FSDP's default mean) into a flat fp32 buffer of this
rank's shard, and that buffer is what the data-parallel mode sums with the same shard of the other
replicas (plain all-reduce or forward recovery). Checkpoints are written as a tp=1, pp=1 layout, so
they resume on any 3D layout and back. In the parallel context the shard ranks sit where tp ranks
sit for the 3D engine (the inner dimension of the rank grid), so ``ctx.tp_group`` is the replica's
shard group and ``ctx.tp_rank`` this rank's shard index.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..checkpoint import CheckpointReader, PendingSave
from ..config import Config
from ..parallel.context import ParallelContext
from ..parallel.hsdp import HSDPEngine, load_hsdp_checkpoint, save_hsdp_checkpoint
from ..parallel.world import World
from .three_d import DTYPES


class HSDPModelEngine:
    def __init__(self, cfg: Config, world: World, ctx: ParallelContext):
        self.cfg, self.ctx = cfg, ctx
        init = cfg.model.init_method
        self.engine = HSDPEngine(
            cfg.model.model_config,
            cfg.optimizer,
            group=ctx.tp_group,
            dtype=DTYPES[cfg.model.dtype],
            device=world.device,
            init_std=init.std,
            seed=cfg.general.seed,
        )
        if init.path is not None:
            load_hsdp_checkpoint(CheckpointReader(init.path), self.engine, load_optimizer=False)
        self.grads_flat = self.engine.grads_flat

    @property
    def event_hook(self) -> Callable[[str, int], None] | None:
        return self.engine.event_hook

    @event_hook.setter
    def event_hook(self, hook: Callable[[str, int], None] | None) -> None:
        self.engine.event_hook = hook

    @property
    def holds_loss(self) -> bool:
        return self.engine.rank == 0  # every shard rank returns all the replica's losses

    @property
    def digest_name(self) -> str:
        return f"pp0_tp{self.engine.rank}"  # each shard rank writes the full model's digest

    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[float]:
        return self.engine.train_batch(microbatches, loss_scale)

    def optimizer_step(self, lr: float) -> float:
        norm = self.engine.optimizer_step(lr)
        self.engine.zero_grad()
        return norm

    def save(
        self, root: Path, step: int, cfg: Config, *, dp_rank: int, asynchronous: bool
    ) -> Path | PendingSave:
        return save_hsdp_checkpoint(root, step, cfg, self.engine, dp_rank=dp_rank, asynchronous=asynchronous)

    def load(self, reader: CheckpointReader, load_optimizer: bool) -> None:
        load_hsdp_checkpoint(reader, self.engine, load_optimizer=load_optimizer)

    def parameter_digest(self) -> str:
        return self.engine.parameter_digest()

    def close(self) -> None:
        pass
