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

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .checkpoint import (
    CheckpointError,
    CheckpointReader,
    PendingSave,
    find_resume_checkpoint,
    latest_step,
    save_checkpoint,
)
from .config import Config, TokenizedDatasetArgs, check_world_size
from .data import MicroBatchSource, build_microbatch_source
from .errors import ExitCode, InputError, StopRun
from .ft.faults import FaultInjector
from .logging import MetricsWriter, ids_digest
from .logging.progress import Progress
from .logging.wandb_logger import RunLogger, run_name_for_config
from .models.llama import LlamaStage
from .optim import GradBuffer, MasterOptimizer, clip_grad_norm_, lr_at
from .outcome import write_outcome
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
    def agree_startup(self, error: str | None) -> str | None: ...
    def reduced_gradients(self, step: int) -> ReducedStep: ...
    def before_optimizer(self) -> None: ...
    def fault_point(self, phase: str) -> None: ...
    def after_step(self, step: int) -> None: ...
    def local_phase(self, name: str) -> contextlib.AbstractContextManager[None]: ...
    def request_stop(self, stop: StopRun) -> None: ...
    def check_member(self) -> None: ...
    def finish(self, last_step: int, resave: Callable[[int], Any] | None = None) -> None: ...
    def is_logger(self) -> bool: ...
    def is_checkpoint_writer(self) -> bool: ...
    def replica_id(self) -> int: ...
    def abort(self, error: BaseException) -> None: ...
    def close(self) -> None: ...


def make_data_parallel(cfg: Config, run_dir: Path) -> DataParallelMode:
    """The data-parallel mode the config asks for. The fault-tolerant one turns on ULFM's heartbeat
    detector first: its parameters must be in place before MPI starts."""
    if cfg.recover.enabled and cfg.recover.mode == "forward":
        if "mpi4py.MPI" not in sys.modules:  # `train` starts MPI first thing; others start it here
            from .ft.heartbeat import start_mpi

            start_mpi(cfg.recover.heartbeat_period_s, cfg.recover.heartbeat_timeout_s)
        from .recovery.transaction import ForwardRecovery

        return ForwardRecovery(cfg, run_dir)
    return PlainDataParallel(cfg, run_dir)


# Stop kinds as codes for the plain mode's all-reduce (MAX: the most specific cause wins).
_STOP_CODES = {kind: i + 1 for i, kind in enumerate(("too_few_replicas", "input", "io", "deterministic"))}


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
        mine = _STOP_CODES[self.pending_stop.kind] if self.pending_stop is not None else 0
        code = torch.tensor([mine], dtype=torch.int64, device=self.t.world.device)
        if self.t.world.size > 1:
            dist.all_reduce(code, op=dist.ReduceOp.MAX)
        if code.item():
            kind = next(k for k, c in _STOP_CODES.items() if c == code.item())
            if self.pending_stop is not None and self.pending_stop.kind == kind:
                raise self.pending_stop
            raise StopRun(kind, f"stop requested by another rank ({kind})")

    def after_step(self, step: int) -> None:
        self._agree_stop()

    def fault_point(self, phase: str) -> None:
        if self.injector is not None:
            self.injector.maybe_fail(phase, 0)

    def finish(self, last_step: int, resave: Callable[[int], Any] | None = None) -> None:
        self._agree_stop()
        if self.t.world.rank == 0 and self.run_dir is not None:
            self.t.write_outcome("completed", last_step)

    def check_member(self) -> None:
        pass

    def is_logger(self) -> bool:
        return self.t.world.rank == 0

    def is_checkpoint_writer(self) -> bool:
        return True  # every rank takes part; data rank 0 writes the shards

    def replica_id(self) -> int:
        return self.t.ctx.dp_rank

    def abort(self, error: BaseException) -> None:
        if isinstance(error, StopRun) and self.t.world.rank == 0 and self.run_dir is not None:
            self.t.write_outcome("stopped", self.t.last_committed, error)
        raise error

    def close(self) -> None:
        """Tear the torch world down in order, so no gloo thread is left alive at interpreter exit."""
        if dist.is_initialized():
            try:
                dist.barrier()
            finally:
                dist.destroy_process_group()


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
        self.dp_mode = dp_mode if dp_mode is not None else make_data_parallel(cfg, self.run_dir)
        self.world, self.ctx = self.dp_mode.setup_world()
        if self.world.device.type == "cpu":
            set_cpu_threads()
        self.B = cfg.microbatches_per_step
        self.G = cfg.tokens.batch_accumulation_per_replica
        ck = cfg.checkpoints
        self.checkpoints_path = (
            Path(ck.checkpoints_path) if ck.checkpoints_path else self.run_dir / "checkpoints"
        )
        self._sources: dict[int, MicroBatchSource] = {}
        self.target_step = cfg.tokens.train_steps
        self.last_committed = 0
        # Bad input found now (a damaged checkpoint, a truncated corpus, another tokenizer's corpus)
        # may show on some ranks only: every rank learns the first error and stops the same way,
        # instead of the others waiting for the failed ones in their first collective.
        error = None
        try:
            self._build()
        except (InputError, CheckpointError, OSError) as e:
            error = " ".join(str(e).split())
        agreed = self.dp_mode.agree_startup(error)
        if agreed is not None:
            raise InputError(agreed)
        self.last_committed = self.start_step
        self.dp_mode.attach(self)
        self.metrics: MetricsWriter | None = None
        self._history: list[dict[str, Any]] = []
        # Real on the logging rank only (see _start_reporting); no-ops elsewhere.
        self.run_logger = RunLogger()
        self.progress = Progress(0, enabled=False)
        self._pending_save: PendingSave | None = None

    def _build(self) -> None:
        cfg, p = self.cfg, self.cfg.parallelism
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
        # Open (and so check) every data stage's corpus now, not when its first step comes.
        for stage in cfg.data_stages:
            self.source_for(max(stage.start_training_step, 1))
        self.start_step = self._maybe_resume()

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
        """Resume from ``resume_checkpoint_path`` or, failing that, this run's own latest checkpoint.

        Everything is checked before any state changes: the checkpoint belongs to this run (unless
        named explicitly), has this model's shapes, and every file this rank needs is readable."""
        ck = self.cfg.checkpoints
        reader = find_resume_checkpoint(self.cfg, self.checkpoints_path, rank=self.world.rank)
        if reader is None:
            return 0
        reader.load_model(self.stage)
        if ck.load_optimizer:
            self.optimizer.load_state_tensors(reader.load_optimizer_state(self.stage), reader.step)
        reader.load_rng(self.world.rank, self.world.size)
        if self.world.rank == 0:
            print(f"[nanotron-recover] resumed from {reader.path} at step {reader.step}", flush=True)
        return reader.step

    def save(self, step: int, synchronous: bool = False) -> Path | None:
        """Collective over the ranks that write (all of them in plain mode, one replica in
        fault-tolerant mode). With asynchronous saves this returns once the state is staged in CPU
        memory; the previous save is always finished first. Raises CheckpointError when the save
        failed (nothing was published: the previous checkpoint stays the latest)."""
        if not self.dp_mode.is_checkpoint_writer():
            return None
        self.dp_mode.check_member()
        with self.dp_mode.local_phase("save"):
            self.wait_for_save()
            self.dp_mode.fault_point("save")
            r, ck = self.cfg.recover, self.cfg.checkpoints
            asynchronous = not synchronous and (
                ck.async_save or (r.enabled and r.mode == "checkpoint_restart")
            )
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
        """Finish the save in flight; raises its CheckpointError if it failed."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.wait()

    def _save_or_stop(self, step: int, synchronous: bool = False) -> None:
        """A save that fails for a reason of its own (a full disk) stops the whole job at the next
        agree; the previous checkpoint stays the latest. Training state is not lost with it."""
        try:
            self.save(step, synchronous=synchronous)
        except CheckpointError as e:
            self.dp_mode.request_stop(StopRun("io", " ".join(str(e).split())))

    def _poll_save(self) -> None:
        """An asynchronous save that failed in the background stops the job too."""
        pending = self._pending_save
        if pending is not None and pending.done:
            self._pending_save = None
            try:
                pending.wait()
            except CheckpointError as e:
                self.dp_mode.request_stop(StopRun("io", " ".join(str(e).split())))

    def _resave_final(self, step: int) -> None:
        """The replica that wrote the final checkpoint failed before the end: write it again."""
        if latest_step(self.checkpoints_path) != step:
            self._save_or_stop(step, synchronous=True)

    def write_outcome(self, status: str, last_step: int, stop: StopRun | None = None) -> None:
        write_outcome(
            self.run_dir,
            status=status,
            last_step=last_step,
            target_step=self.target_step,
            exit_code=stop.exit_code if stop is not None else ExitCode.OK,
            kind=stop.kind if stop is not None else None,
            message=stop.message if stop is not None else None,
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
        reduced = self.dp_mode.reduced_gradients(step)
        self.dp_mode.before_optimizer()
        with self.dp_mode.local_phase("optimizer"):
            self._sync_tied_grads()
            grad_norm = clip_grad_norm_(
                self.grads,
                self.stage.specs,
                self.cfg.optimizer.clip_grad,
                self.ctx.tp_rank,
                self.ctx.mp_group,
            )
            lr = lr_at(step - 1, self.cfg.optimizer.learning_rate_scheduler, self.cfg.tokens.train_steps)
            self.optimizer.step(lr)
            self.grads.zero_()
            if self.world.device.type == "cuda":
                torch.cuda.synchronize()
        self.last_committed = step
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
        self.target_step = last
        final_save = ck.save_final_state or stop_after_step is not None
        try:
            for step in range(self.start_step + 1, last + 1):
                r = self.train_step(step)
                results.append(r)
                self._log(r)
                due = ck.checkpoint_interval and step % ck.checkpoint_interval == 0
                if due or (step == last and final_save):
                    self._save_or_stop(step)
                self._poll_save()
                self.dp_mode.after_step(step)
            try:
                self.wait_for_save()
            except CheckpointError as e:
                self.dp_mode.request_stop(StopRun("io", " ".join(str(e).split())))
            self.write_parameter_digest()
            self.dp_mode.finish(last, resave=self._resave_final if final_save else None)
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
        self.dp_mode.check_member()
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
