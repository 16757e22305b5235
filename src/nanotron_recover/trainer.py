"""DistributedTrainer: the 3D-parallel training loop, in plain or fault-tolerant mode.

The step contract, in both modes: (1-based) step ``s`` consumes the micro-batch ids
``(s-1)*B .. s*B-1`` with ``B = dp * batch_accumulation_per_replica``, each exactly once; each
micro-batch's mean token loss is scaled by the constant ``1/B`` before backward, so the summed
gradient, and the loss of every step, depend on the config only, not on the layout or the faults.

What differs between the modes is how a step's gradient gets summed across data-parallel replicas,
which a ``DataParallelMode`` owns:

- plain (``PlainDataParallel``, below): one torch.distributed world over all ranks; data rank ``d``
  computes the ``G`` consecutive ids from ``(s-1)*B + d*G``; the gradient buffer is all-reduced
  through torch.distributed (NCCL on GPU, gloo on CPU). The fault-free reference.
- recover (``ForwardRecovery``, in ``recovery/transaction.py``): each replica is its own torch world
  and the reduction goes through the ULFM communicator, which survives replica failures inside
  the step.

Everything else (model, fp32 gradient buffer, optimizer, clipping, checkpoints, metrics) is shared.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .checkpoint import CheckpointReader, PendingSave, latest_step, save_checkpoint
from .config import Config, TokenizedDatasetArgs, check_world_size
from .data import MicroBatchSource, build_microbatch_source
from .ft.faults import FaultInjector
from .logging import MetricsWriter, ids_digest
from .logging.progress import Progress
from .logging.wandb_logger import RunLogger, run_name_for_config
from .models.llama import LlamaStage
from .optim import GradBuffer, MasterOptimizer, clip_grad_norm_, lr_at
from .parallel.context import ParallelContext
from .parallel.pipeline_parallel import PipelineEngine, build_engine
from .parallel.world import World, init_world

HISTORY_STEPS = 64  # recent step records every rank keeps, for a logger that takes over
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def set_cpu_threads() -> None:
    """One share of the cores per rank: oversubscribed CPU ranks each spinning many threads crawl."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))


@dataclass
class ReducedStep:
    """What a data-parallel mode hands back once the step's gradient is summed in the buffer."""

    loss: float  # sum of the contributed micro-batch losses / B
    ids: list[int]  # micro-batch ids the summed gradient contains
    replicas: int
    extra: dict[str, Any] = field(default_factory=dict)  # mode-specific metrics


class DataParallelMode(Protocol):
    def setup_world(self) -> tuple[World, ParallelContext]: ...
    def attach(self, trainer: DistributedTrainer) -> None: ...
    def reduced_gradients(self, step: int) -> ReducedStep: ...
    def before_optimizer(self) -> None: ...
    def is_logger(self) -> bool: ...
    def is_checkpoint_writer(self) -> bool: ...
    def replica_id(self) -> int: ...
    def abort(self, error: BaseException) -> None: ...
    def close(self) -> None: ...


class PlainDataParallel:
    """One torch world; the DP all-reduce is a torch.distributed collective.

    This is also the checkpoint-restart baseline (``recover.mode: checkpoint_restart``): injected
    faults kill their rank here like in the fault-tolerant mode, the whole job dies with it, and
    the launcher relaunches it from the last checkpoint (``restart.py``).
    """

    def __init__(self, cfg: Config, run_dir: Path | None = None):
        self.cfg, self.run_dir = cfg, run_dir
        self.injector: FaultInjector | None = None

    def setup_world(self) -> tuple[World, ParallelContext]:
        world = init_world()
        check_world_size(self.cfg, world.size)
        p = self.cfg.parallelism
        return world, ParallelContext.create(p.tp, p.pp, p.dp, world.device)

    def attach(self, trainer: DistributedTrainer) -> None:
        self.t = trainer
        r = self.cfg.recover
        if r.enabled and r.mode == "checkpoint_restart" and self.run_dir is not None:
            ctx = trainer.ctx
            self.injector = FaultInjector(r, trainer.world.rank, ctx.dp_rank, self.run_dir)
            trainer.engine.event_hook = lambda kind, i: self.injector.maybe_fail(kind, i)

    def my_ids(self, step: int) -> list[int]:
        t = self.t
        first = (step - 1) * t.B + t.ctx.dp_rank * t.G
        return list(range(first, first + t.G))

    def reduced_gradients(self, step: int) -> ReducedStep:
        t, ctx = self.t, self.t.ctx
        ids = self.my_ids(step)
        if self.injector is not None:
            self.injector.begin_step(step, list(range(ctx.dp)))
        source = t.source_for(step)
        losses = t.engine.train_batch([source.get(i) for i in ids], loss_scale=1.0 / t.B)
        if self.injector is not None:
            self.injector.maybe_fail("reduce", 0)
        if ctx.dp > 1:
            dist.all_reduce(t.grads.flat, group=ctx.dp_group)
        # The loss lives on the last stage (its tp ranks hold the same value: count tp rank 0).
        loss_sum = torch.zeros(1, dtype=torch.float64, device=t.world.device)
        if ctx.is_last_stage and ctx.tp_rank == 0:
            loss_sum += sum(float(x) for x in losses)
        dist.all_reduce(loss_sum)
        return ReducedStep(loss_sum.item() / t.B, self._gather_ids(ids), ctx.dp)

    def _gather_ids(self, ids: list[int]) -> list[int]:
        """The ids every data rank actually consumed this step (what ``ids_digest`` is computed on)."""
        ctx = self.t.ctx
        if ctx.dp == 1:
            return ids
        mine = torch.tensor(ids, dtype=torch.int64, device=self.t.world.device)
        parts = [torch.empty_like(mine) for _ in range(ctx.dp)]
        dist.all_gather(parts, mine, group=ctx.dp_group)
        return torch.cat(parts).tolist()

    def before_optimizer(self) -> None:
        if self.injector is not None:
            self.injector.maybe_fail("optimizer", 0)

    def is_logger(self) -> bool:
        return self.t.world.rank == 0

    def is_checkpoint_writer(self) -> bool:
        return True  # every rank takes part; data rank 0 writes the shards

    def replica_id(self) -> int:
        return self.t.ctx.dp_rank

    def abort(self, error: BaseException) -> None:
        raise error

    def close(self) -> None:
        pass


@dataclass
class StepResult:
    step: int
    loss: float
    lr: float
    grad_norm: float
    ids: list[int]
    step_time_s: float
    replicas: int
    extra: dict[str, Any] = field(default_factory=dict)


class DistributedTrainer:
    def __init__(self, cfg: Config, run_dir: str | Path, dp_mode: DataParallelMode | None = None):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        if dp_mode is None:
            if cfg.recover.enabled and cfg.recover.mode == "forward":
                from .recovery.transaction import ForwardRecovery

                dp_mode = ForwardRecovery(cfg, self.run_dir)
            else:
                dp_mode = PlainDataParallel(cfg, self.run_dir)
        self.dp_mode = dp_mode
        self.world, self.ctx = dp_mode.setup_world()
        if self.world.device.type == "cpu":
            set_cpu_threads()
        p = cfg.parallelism
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
        self.engine: PipelineEngine = build_engine(
            p.pp_engine, self.stage, self.ctx, t.micro_batch_size, t.sequence_length
        )
        self._sources: dict[int, MicroBatchSource] = {}

        ck = cfg.checkpoints
        self.checkpoints_path = (
            Path(ck.checkpoints_path) if ck.checkpoints_path else self.run_dir / "checkpoints"
        )
        self.start_step = self._maybe_resume()
        self.dp_mode.attach(self)
        self.metrics: MetricsWriter | None = None
        self._history: list[dict[str, Any]] = []
        # Real on the logging rank only (see _start_reporting); no-ops elsewhere.
        self.run_logger = RunLogger()
        self.progress = Progress(0, enabled=False)
        self._pending_save: PendingSave | None = None

    # -- data --------------------------------------------------------------------------------
    def source_for(self, step: int) -> MicroBatchSource:
        stage = self.cfg.stage_for_step(step)
        key = stage.start_training_step
        if key not in self._sources:
            ds = stage.data.dataset
            folder = ds.dataset_folder if isinstance(ds, TokenizedDatasetArgs) else None
            check_tokenizer = isinstance(ds, TokenizedDatasetArgs) and ds.validate_tokenizer
            t = self.cfg.tokens
            self._sources[key] = build_microbatch_source(
                folder,
                vocab_size=self.cfg.model.model_config.vocab_size,
                micro_batch_size=t.micro_batch_size,
                sequence_length=t.sequence_length,
                seed=stage.data.seed if stage.data.seed is not None else self.cfg.general.seed,
                # The corpus must come from the config's tokenizer (checked against its index).
                tokenizer_name_or_path=self.cfg.tokenizer.tokenizer_name_or_path if check_tokenizer else None,
            )
        return self._sources[key]

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

    def save(self, step: int) -> Path | None:
        """Collective over the ranks that write (all of them in plain mode, one replica in
        fault-tolerant mode). With asynchronous saves this returns once the state is staged in CPU
        memory; the previous save is always finished first."""
        if not self.dp_mode.is_checkpoint_writer():
            return None
        self.wait_for_save()
        r, ck = self.cfg.recover, self.cfg.checkpoints
        asynchronous = ck.async_save or (r.enabled and r.mode == "checkpoint_restart")
        saved = save_checkpoint(
            self.checkpoints_path,
            step,
            self.cfg,
            self.stage,
            self.optimizer.state_tensors(),
            tp=self.ctx.tp,
            pp=self.ctx.pp,
            dp_rank=self.ctx.dp_rank,
            asynchronous=asynchronous,
        )
        if isinstance(saved, PendingSave):
            self._pending_save = saved
            return saved.path
        return saved

    def wait_for_save(self) -> None:
        if self._pending_save is not None:
            self._pending_save.wait()
            self._pending_save = None

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
        reduced = self.dp_mode.reduced_gradients(step)
        self.dp_mode.before_optimizer()
        self._sync_tied_grads()
        grad_norm = clip_grad_norm_(
            self.grads, self.stage.specs, self.cfg.optimizer.clip_grad, self.ctx.tp_rank, self.ctx.mp_group
        )
        lr = lr_at(step - 1, self.cfg.optimizer.learning_rate_scheduler, self.cfg.tokens.train_steps)
        self.optimizer.step(lr)
        self.grads.zero_()
        if self.world.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        return StepResult(step, reduced.loss, lr, grad_norm, reduced.ids, dt, reduced.replicas, reduced.extra)

    # -- the loop ------------------------------------------------------------------------------
    def train(self, stop_after_step: int | None = None) -> list[StepResult]:
        t = self.cfg.tokens
        ck = self.cfg.checkpoints
        results = []
        if self.dp_mode.is_logger():
            # A resumed run redoes the steps after its checkpoint: drop their old records.
            self._start_reporting(truncate_after_step=self.start_step)
        if ck.save_initial_state and self.start_step == 0:
            self.save(0)
        last = t.train_steps if stop_after_step is None else min(stop_after_step, t.train_steps)
        try:
            for step in range(self.start_step + 1, last + 1):
                r = self.train_step(step)
                results.append(r)
                self._log(r)
                due = ck.checkpoint_interval and step % ck.checkpoint_interval == 0
                final = step == last and (ck.save_final_state or stop_after_step is not None)
                if due or final:
                    self.save(step)
            self.wait_for_save()
            self.write_parameter_digest()
        except Exception as error:
            self.run_logger.finish(exit_code=1)
            self.dp_mode.abort(error)
            raise
        return results

    def write_parameter_digest(self) -> Path:
        """``<run_dir>/parameters/replica<r>_pp<p>_tp<t>.sha256``: a digest of this rank's parameter
        shards, so anyone can check that the replicas ended bitwise identical."""
        digest = hashlib.sha256()
        for name, param in sorted(self.stage.named_parameters()):
            digest.update(name.encode())
            digest.update(param.detach().float().cpu().contiguous().numpy().tobytes())
        folder = self.run_dir / "parameters"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"replica{self.dp_mode.replica_id()}_pp{self.ctx.pp_rank}_tp{self.ctx.tp_rank}.sha256"
        path.write_text(digest.hexdigest() + "\n")
        return path

    def _start_reporting(self, truncate_after_step: int | None = None) -> None:
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", truncate_after_step=truncate_after_step)
        self.run_logger = RunLogger.start(
            self.cfg.logging.wandb, self.run_dir, run_name_for_config(self.cfg), self.cfg
        )
        self.progress = Progress(self.cfg.tokens.train_steps)

    def _log(self, r: StepResult) -> None:
        """Every rank keeps the records of recent steps; the logging rank writes them. A rank that
        takes over logging from a failed replica first writes the committed steps its predecessor
        did not get to (all replicas hold the same values for a committed step)."""
        tokens_per_step = self.cfg.tokens_per_step
        record = {
            "step": r.step,
            "loss": r.loss,
            "lr": r.lr,
            "grad_norm": r.grad_norm,
            "tokens": tokens_per_step,
            "consumed_tokens": r.step * tokens_per_step,
            "step_time_s": r.step_time_s,
            "tokens_per_s": tokens_per_step / r.step_time_s,
            "replicas": r.replicas,
            "ids_digest": ids_digest(r.ids),
            "time": time.time(),
            **r.extra,
        }
        self._history.append(record)
        del self._history[:-HISTORY_STEPS]
        if not self.dp_mode.is_logger():
            return
        if self.metrics is None:
            self._start_reporting()  # taking over from the failed logging replica
        for rec in self._history:
            self.metrics.write(rec)  # skips steps already in the file
            self.run_logger.log_step(rec)  # likewise
        self.progress.update(record)
        if not self.progress.enabled and r.step % max(self.cfg.logging.iteration_step_info_interval, 1) == 0:
            print(
                f"[nanotron-recover] step {r.step}/{self.cfg.tokens.train_steps} loss {r.loss:.4f} "
                f"lr {r.lr:.2e} grad_norm {r.grad_norm:.3f} tokens/s {record['tokens_per_s']:.0f} "
                f"replicas {r.replicas}",
                flush=True,
            )

    def close(self) -> None:
        self.progress.close()
        self.run_logger.finish()
        if self.metrics is not None:
            self.metrics.close()
        self.grads.remove_hooks()
        self.dp_mode.close()
