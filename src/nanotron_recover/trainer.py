"""DistributedTrainer: the plain 3D-parallel training loop (the fault-free reference).

One torch.distributed world over all ranks; data-parallel gradients are all-reduced through
torch.distributed (NCCL on GPU, gloo on CPU).

The step contract, which the fault-tolerant mode keeps under failures: (1-based) step ``s`` consumes
the micro-batch ids ``(s-1)*B .. s*B-1`` with ``B = dp * batch_accumulation_per_replica``; data
rank ``d`` computes the ``G`` consecutive ids starting at ``(s-1)*B + d*G``; each micro-batch's mean
token loss is scaled by the constant ``1/B`` before backward, so the summed gradient is the same
whatever the layout, and so is the loss of every step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import CheckpointReader, latest_step, save_checkpoint
from .config import Config, TokenizedDatasetArgs, check_world_size
from .data import MicroBatchSource, build_microbatch_source
from .logging import MetricsWriter, ids_digest
from .models.llama import LlamaStage
from .optim import GradBuffer, MasterOptimizer, clip_grad_norm_, lr_at
from .parallel.context import ParallelContext
from .parallel.pipeline_parallel import build_engine
from .parallel.world import World, init_world

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_cpu_threads() -> None:
    """One rank per core share: oversubscribed CPU ranks each spinning many threads crawl."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    ids: list[int]
    step_time_s: float


class DistributedTrainer:
    def __init__(self, cfg: Config, run_dir: str | Path, world: World | None = None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.world = world or init_world()
        check_world_size(cfg, self.world.size)
        if self.world.device.type == "cpu":
            set_cpu_threads()
        p = cfg.parallelism
        self.ctx = ParallelContext.create(p.tp, p.pp, p.dp, self.world.device)
        self.B = cfg.microbatches_per_step
        self.G = cfg.tokens.batch_accumulation_per_replica

        self.stage = LlamaStage(
            cfg.model.model_config,
            tp_group=self.ctx.tp_group,
            pp=p.pp,
            pp_rank=self.ctx.pp_rank,
            dtype=DTYPES[cfg.model.dtype],
            device=self.world.device,
        )
        init = cfg.model.init_method
        if init.path is not None:
            CheckpointReader(init.path).load_model(self.stage)
        else:
            self.stage.init_weights(init.std, cfg.general.seed)
        named = list(self.stage.named_parameters())
        self.grads = GradBuffer(named, self.world.device)
        self.optimizer = MasterOptimizer(named, self.grads, cfg.optimizer)
        t = cfg.tokens
        self.engine = build_engine(p.pp_engine, self.stage, self.ctx, t.micro_batch_size, t.sequence_length)
        self._sources: dict[int, MicroBatchSource] = {}

        ck = cfg.checkpoints
        self.checkpoints_path = (
            Path(ck.checkpoints_path) if ck.checkpoints_path else self.run_dir / "checkpoints"
        )
        self.start_step = self._maybe_resume()
        self.metrics = None
        if self.world.rank == 0:
            self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", truncate_after_step=self.start_step)

    # -- data --------------------------------------------------------------------------------
    def source_for(self, step: int) -> MicroBatchSource:
        stage = self.cfg.stage_for_step(step)
        key = stage.start_training_step
        if key not in self._sources:
            ds = stage.data.dataset
            folder = ds.dataset_folder if isinstance(ds, TokenizedDatasetArgs) else None
            t = self.cfg.tokens
            self._sources[key] = build_microbatch_source(
                folder,
                vocab_size=self.cfg.model.model_config.vocab_size,
                micro_batch_size=t.micro_batch_size,
                sequence_length=t.sequence_length,
                seed=stage.data.seed if stage.data.seed is not None else self.cfg.general.seed,
            )
        return self._sources[key]

    def my_ids(self, step: int) -> list[int]:
        first = (step - 1) * self.B + self.ctx.dp_rank * self.G
        return list(range(first, first + self.G))

    # -- checkpoints -------------------------------------------------------------------------
    def _maybe_resume(self) -> int:
        """Resume from ``resume_checkpoint_path`` or, failing that, this run's own latest checkpoint."""
        ck = self.cfg.checkpoints
        path = ck.resume_checkpoint_path
        if path is None and latest_step(self.checkpoints_path) is not None:
            path = self.checkpoints_path
        if path is None:
            return 0
        reader = CheckpointReader(path)
        reader.load_model(self.stage)
        if ck.load_optimizer:
            self.optimizer.load_state_tensors(reader.load_optimizer_state(self.stage), reader.step)
        reader.load_rng(self.world.rank, self.world.size)
        if self.world.rank == 0:
            print(f"[nanotron-recover] resumed from {reader.path} at step {reader.step}", flush=True)
        return reader.step

    def save(self, step: int) -> Path:
        return save_checkpoint(
            self.checkpoints_path,
            step,
            self.cfg,
            self.stage,
            self.optimizer.state_tensors(),
            tp=self.ctx.tp,
            pp=self.ctx.pp,
            dp_rank=self.ctx.dp_rank,
        )

    # -- one optimizer step ------------------------------------------------------------------
    def _sync_tied_grads(self) -> None:
        """With pp > 1 a tied output head is a copy on the last stage: sum its gradient with the
        embedding's so both copies take the same update."""
        if not (self.cfg.model.model_config.tie_word_embeddings and self.ctx.pp > 1):
            return
        name = "model.embed_tokens.weight" if self.ctx.is_first_stage else "lm_head.weight"
        if self.ctx.is_first_stage or self.ctx.is_last_stage:
            dist.all_reduce(self.grads.views[name], group=self.ctx.tied_group)

    def train_step(self, step: int) -> StepResult:
        t0 = time.perf_counter()
        ids = self.my_ids(step)
        source = self.source_for(step)
        losses = self.engine.train_batch([source.get(i) for i in ids], loss_scale=1.0 / self.B)
        if self.ctx.dp > 1:
            dist.all_reduce(self.grads.flat, group=self.ctx.dp_group)
        self._sync_tied_grads()
        grad_norm = clip_grad_norm_(
            self.grads, self.stage.specs, self.cfg.optimizer.clip_grad, self.ctx.tp_rank, self.ctx.mp_group
        )
        lr = lr_at(step - 1, self.cfg.optimizer.learning_rate_scheduler, self.cfg.tokens.train_steps)
        self.optimizer.step(lr)
        self.grads.zero_()

        # The loss lives on the last stage (tp ranks hold the same value: count tp rank 0 only).
        loss_sum = torch.zeros(1, dtype=torch.float64, device=self.world.device)
        if self.ctx.is_last_stage and self.ctx.tp_rank == 0:
            loss_sum += sum(float(x) for x in losses)
        dist.all_reduce(loss_sum)
        all_ids = self._gather_ids(ids)
        if self.world.device.type == "cuda":
            torch.cuda.synchronize()
        return StepResult(step, loss_sum.item() / self.B, lr, grad_norm, all_ids, time.perf_counter() - t0)

    def _gather_ids(self, ids: list[int]) -> list[int]:
        """The ids every data rank actually consumed this step (what ``ids_digest`` is computed on)."""
        mine = torch.tensor(ids, dtype=torch.int64, device=self.world.device)
        if self.ctx.dp == 1:
            return ids
        parts = [torch.empty_like(mine) for _ in range(self.ctx.dp)]
        dist.all_gather(parts, mine, group=self.ctx.dp_group)
        return torch.cat(parts).tolist()

    # -- the loop ------------------------------------------------------------------------------
    def train(self, stop_after_step: int | None = None) -> list[StepResult]:
        t = self.cfg.tokens
        tokens_per_step = self.cfg.tokens_per_step
        ck = self.cfg.checkpoints
        results = []
        if ck.save_initial_state and self.start_step == 0:
            self.save(0)
        last = t.train_steps if stop_after_step is None else min(stop_after_step, t.train_steps)
        for step in range(self.start_step + 1, last + 1):
            r = self.train_step(step)
            results.append(r)
            self._log(r, tokens_per_step)
            due = ck.checkpoint_interval and step % ck.checkpoint_interval == 0
            final = step == last and (ck.save_final_state or stop_after_step is not None)
            if due or final:
                self.save(step)
        return results

    def _log(self, r: StepResult, tokens_per_step: int) -> None:
        if self.metrics is None:
            return
        record = {
            "step": r.step,
            "loss": r.loss,
            "lr": r.lr,
            "grad_norm": r.grad_norm,
            "tokens": tokens_per_step,
            "consumed_tokens": r.step * tokens_per_step,
            "step_time_s": r.step_time_s,
            "tokens_per_s": tokens_per_step / r.step_time_s,
            "replicas": self.ctx.dp,
            "ids_digest": ids_digest(r.ids),
        }
        self.metrics.write(record)
        if r.step % max(self.cfg.logging.iteration_step_info_interval, 1) == 0:
            print(
                f"[nanotron-recover] step {r.step}/{self.cfg.tokens.train_steps} loss {r.loss:.4f} "
                f"lr {r.lr:.2e} grad_norm {r.grad_norm:.3f} tokens/s {record['tokens_per_s']:.0f}",
                flush=True,
            )

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        self.grads.remove_hooks()
