"""The 3D engine: tensor and pipeline parallelism inside a replica, Nanotron style.

The replica's ``tp*pp`` ranks each hold one LLaMA stage shard (explicit column/row/vocab-parallel
layers, ``models/llama.py``); micro-batches go through the AFAB or 1F1B schedule; gradients
accumulate in one contiguous fp32 buffer (``optim/grad_buffer.py``), which is what crosses replicas;
AdamW updates fp32 master weights after model-parallel gradient clipping.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointReader, PendingSave, save_checkpoint
from ..config import Config
from ..models.llama import LlamaStage
from ..optim import GradBuffer, MasterOptimizer, clip_grad_norm_
from ..parallel.context import ParallelContext
from ..parallel.pipeline_parallel import build_engine
from ..parallel.world import World
from .state import (
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

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ThreeDEngine:
    def __init__(self, cfg: Config, world: World, ctx: ParallelContext):
        self.cfg, self.ctx = cfg, ctx
        p, t = cfg.parallelism, cfg.tokens
        self.stage = LlamaStage(
            cfg.model.model_config,
            tp_group=ctx.tp_group,
            pp=p.pp,
            pp_rank=ctx.pp_rank,
            dtype=DTYPES[cfg.model.dtype],
            device=world.device,
        )
        init = cfg.model.init_method
        if init.path is not None:
            CheckpointReader(init.path).load_model(self.stage)
        else:
            self.stage.init_weights(init.std, cfg.general.seed, depth_scaled=init.depth_scaled)
        named = list(self.stage.named_parameters())
        exact = cfg.recover.exact_fraction_bits if cfg.recover.exact else None
        self.grads = GradBuffer(named, world.device, fraction_bits=exact, max_terms=cfg.microbatches_per_step)
        # What crosses replicas: the fp32 sum, or in exact mode the int64 fixed-point sum.
        self.grads_flat = self.grads.reduced
        self.optimizer = MasterOptimizer(named, self.grads, cfg.optimizer)
        self.pipeline = build_engine(p.pp_engine, self.stage, ctx, t.micro_batch_size, t.sequence_length)
        self.device = world.device
        self.cuda = world.device.type == "cuda"

    @property
    def event_hook(self) -> Callable[[str, int], None] | None:
        return self.pipeline.event_hook

    @event_hook.setter
    def event_hook(self, hook: Callable[[str, int], None] | None) -> None:
        self.pipeline.event_hook = hook

    @property
    def holds_loss(self) -> bool:
        return self.ctx.is_last_stage and self.ctx.tp_rank == 0

    @property
    def digest_name(self) -> str:
        return f"pp{self.ctx.pp_rank}_tp{self.ctx.tp_rank}"

    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[float]:
        """Losses of the micro-batches on the last stage (zeros elsewhere)."""
        losses = self.pipeline.train_batch(microbatches, loss_scale=loss_scale)
        return [float(x) for x in losses] if losses else [0.0] * len(microbatches)

    def _sync_tied_grads(self) -> None:
        """With pp > 1 a tied output head is a copy on the last stage: sum its gradient with the
        embedding's so both copies take the same update."""
        if not (self.cfg.model.model_config.tie_word_embeddings and self.ctx.pp > 1):
            return
        name = "model.embed_tokens.weight" if self.ctx.is_first_stage else "lm_head.weight"
        if self.ctx.is_first_stage or self.ctx.is_last_stage:
            dist.all_reduce(self.grads.views[name], group=self.ctx.tied_group)

    def optimizer_step(self, lr: float) -> float:
        self.grads.materialize()  # exact mode: the fp32 gradient of the reduced integer sum
        self._sync_tied_grads()
        grad_norm = clip_grad_norm_(
            self.grads, self.stage.specs, self.cfg.optimizer.clip_grad, self.ctx.tp_rank, self.ctx.mp_group
        )
        self.optimizer.step(lr)
        self.grads.zero_()
        if self.cuda:
            torch.cuda.synchronize()
        return grad_norm

    def save(
        self, root: Path, step: int, cfg: Config, *, dp_rank: int, asynchronous: bool
    ) -> Path | PendingSave:
        return save_checkpoint(
            root,
            step,
            cfg,
            self.stage,
            self.optimizer.state_tensors(),
            tp=self.ctx.tp,
            pp=self.ctx.pp,
            dp_rank=dp_rank,
            asynchronous=asynchronous,
        )

    def load(self, reader: CheckpointReader, load_optimizer: bool) -> None:
        reader.load_model(self.stage)
        if load_optimizer:
            self.optimizer.load_state_tensors(reader.load_optimizer_state(self.stage), reader.step)

    # -- live state transfer (re-join) ------------------------------------------------------------
    def _separate_masters(self) -> dict[str, torch.Tensor]:
        """The fp32 masters that are not the parameter itself (a 16-bit model's); fp32 parameters
        are their own master and travel once, as ``param/<name>``."""
        params = dict(self.stage.named_parameters())
        return {n: m for n, m in self.optimizer.master.items() if m is not params[n]}

    def _state_layout(self) -> list[tuple[str, tuple[int, ...], str]]:
        """What :meth:`export_state` gives, without copying anything (to check a received state)."""
        layout = [
            (f"param/{n}", tuple(p.shape), dtype_name(p.dtype)) for n, p in self.stage.named_parameters()
        ]
        layout += [
            (f"master/{n}", tuple(m.shape), dtype_name(m.dtype)) for n, m in self._separate_masters().items()
        ]
        return layout + optimizer_layout(self.optimizer.torch_opt, self.optimizer.master)

    def _state_meta(self) -> dict[str, object]:
        """What identifies the state's coordinate: importing another coordinate's state (same shapes,
        other shard) must fail, not silently train the wrong slice."""
        return {"engine": "3d", "coordinate": self.digest_name, "dtype": self.cfg.model.dtype}

    @torch.no_grad()
    def export_state(self, copy: bool = True) -> EngineState:
        """This rank's weights (model dtype), fp32 masters (16-bit models only), AdamW moments, step
        counts and hyper-parameters, and RNG states: CPU copies (with ``copy=False`` the live
        tensors, valid until the next optimizer step); the engine is not modified.

        Call at a step boundary (after :meth:`optimizer_step`): the gradient buffer is not sent."""
        tensors = {f"param/{n}": exported(p, copy) for n, p in self.stage.named_parameters()}
        tensors.update({f"master/{n}": exported(m, copy) for n, m in self._separate_masters().items()})
        opt_tensors, opt_meta = export_optimizer(self.optimizer.torch_opt, self.optimizer.master, copy)
        tensors.update(opt_tensors)
        meta = {**self._state_meta(), "optimizer": opt_meta, "rng": rng_state(self.device)}
        return EngineState(tensors, meta)

    @torch.no_grad()
    def import_state(self, state: EngineState) -> None:
        """Load :meth:`export_state`'s output from the rank at the same (pp, tp) coordinate of another
        replica, in place: parameters, masters and the optimizer's tensors keep their identity, so the
        gradient buffer's hooks and the optimizer's references stay valid. The gradient buffer is
        zeroed (a step boundary). Everything is checked before anything changes."""
        for key, value in self._state_meta().items():
            if state.meta.get(key) != value:
                raise ValueError(
                    f"engine state for {key}={state.meta.get(key)!r}, this rank is {key}={value!r}"
                )
        check_layout(state.layout(), self._state_layout())
        check_optimizer_meta(self.optimizer.torch_opt, self.optimizer.master, state.meta["optimizer"])
        for n, p in self.stage.named_parameters():
            p.copy_(state.tensors[f"param/{n}"])
        for n, m in self._separate_masters().items():
            m.copy_(state.tensors[f"master/{n}"])
        import_optimizer(
            self.optimizer.torch_opt, self.optimizer.master, state.tensors, state.meta["optimizer"]
        )
        self.grads.zero_()
        set_rng_state(state.meta["rng"], self.device)
        if self.cuda:
            torch.cuda.synchronize()

    def parameter_digest(self) -> str:
        digest = hashlib.sha256()
        for name, param in sorted(self.stage.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()

    def close(self) -> None:
        self.grads.remove_hooks()
