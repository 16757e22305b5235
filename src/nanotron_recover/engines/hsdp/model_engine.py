"""The HSDP engine as a :class:`~nanotron_recover.engines.ModelEngine`: FSDP2 inside a replica.

Each replica is ``parallelism.dp_shard`` ranks running ``fully_shard`` over their group
(:class:`.engine.HSDPEngine`): parameters, gradients and AdamW state are sharded inside the replica, the
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

from ...checkpoint import CheckpointReader, PendingSave
from ...config import Config
from ...parallel.context import ParallelContext
from ...parallel.world import World
from ..state import (
    EngineState,
    check_layout,
    check_optimizer_meta,
    dtype_name,
    export_optimizer,
    exported,
    import_optimizer,
    optimizer_layout,
    rng_state,
    set_rng_state,
)
from ..three_d import DTYPES
from .checkpoint import load_hsdp_checkpoint, save_hsdp_checkpoint
from .engine import HSDPEngine


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
            depth_scaled_init=init.depth_scaled,
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

    # -- live state transfer (re-join) ------------------------------------------------------------
    # The sharded parameters are fp32 and are the AdamW masters (the model-dtype weights exist only
    # while FSDP has them all-gathered), so ``param/<name>`` is this rank's fp32 local shard and there
    # is no ``master/`` entry. Shard ``r`` of every replica holds the same rows: the layout (shard
    # shapes, possibly uneven or empty) is the same on every replica at this coordinate.

    def _state_layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """What :meth:`export_state` gives, without copying anything (to check a received state)."""
        masters = self.engine.masters
        layout = [(f"param/{n}", tuple(m.shape), dtype_name(m.dtype)) for n, m in masters.items()]
        return layout + optimizer_layout(self.engine.torch_opt, masters)

    def _state_meta(self) -> dict[str, object]:
        """What identifies the state's coordinate: another shard rank's state may have the same shapes
        and must still be refused."""
        return {
            "engine": "hsdp",
            "coordinate": self.digest_name,
            "shards": self.engine.shard,
            "dtype": self.cfg.model.dtype,
        }

    @torch.no_grad()
    def export_state(self, copy: bool = True) -> EngineState:
        """This rank's fp32 parameter shards (the masters), AdamW moment shards, step counts and
        hyper-parameters, and RNG states: CPU copies of the local tensors (``DTensor.to_local()``;
        with ``copy=False`` the live tensors, valid until the next optimizer step); nothing is
        gathered and the engine is not modified. Not collective.

        Call at a step boundary (after :meth:`optimizer_step`): the gradient shard is not sent."""
        masters = self.engine.masters
        tensors = {f"param/{n}": exported(m, copy) for n, m in masters.items()}
        opt_tensors, opt_meta = export_optimizer(self.engine.torch_opt, masters, copy)
        tensors.update(opt_tensors)
        meta = {**self._state_meta(), "optimizer": opt_meta, "rng": rng_state(self.engine.device)}
        return EngineState(tensors, meta)

    @torch.no_grad()
    def import_state(self, state: EngineState) -> None:
        """Load :meth:`export_state`'s output from shard rank ``r`` of another replica into this shard
        rank ``r``, in place: the local shards are the parameters' storage and the optimizer's keys,
        and the gradient DTensors alias ``grads_flat``; all keep their identity. ``grads_flat`` is
        zeroed (a step boundary). Everything is checked before anything changes. Not collective."""
        for key, value in self._state_meta().items():
            if state.meta.get(key) != value:
                raise ValueError(
                    f"engine state for {key}={state.meta.get(key)!r}, this rank is {key}={value!r}"
                )
        check_layout(state.layout(), self._state_layout())
        masters = self.engine.masters
        check_optimizer_meta(self.engine.torch_opt, masters, state.meta["optimizer"])
        for n, m in masters.items():
            m.copy_(state.tensors[f"param/{n}"])
        import_optimizer(self.engine.torch_opt, masters, state.tensors, state.meta["optimizer"])
        self.engine.zero_grad()
        set_rng_state(state.meta["rng"], self.engine.device)
        self.engine._check_storage()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize()

    def parameter_digest(self) -> str:
        return self.engine.parameter_digest()

    def close(self) -> None:
        pass
