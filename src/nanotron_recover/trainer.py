"""DistributedTrainer: the training loop, the same for every engine and data-parallel mode.

The step contract: (1-based) step ``s`` consumes the micro-batch ids ``(s-1)*B .. s*B-1`` with
``B = dp * batch_accumulation_per_replica``, each exactly once; each micro-batch's mean token loss is
scaled by the constant ``1/B`` before backward, so the summed gradient, and the loss of every step,
depend on the config only, not on the layout, the engine or the faults.

The trainer composes two parts it does not look inside:

- a model engine (``engines/``): one rank's share of one replica's model, 3D (TP x PP) or HSDP
  (FSDP2), with its flat fp32 gradient and its optimizer step;
- a data-parallel mode (``data_parallel/``), handed in by the caller: how the step's micro-batches
  are split over the replicas and their gradients summed -- a plain all-reduce, or forward recovery
  over the ULFM communicator (``data_parallel/forward/``).

It owns the rest: the loop, data sources, checkpoints (when and where), metrics, and the outcome
record.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import fencing, stall_trace
from .checkpoint import (
    CheckpointError,
    PendingSave,
    checkpoints_root,
    find_resume_checkpoint,
    latest_step,
    lr_schedule_origin_at_start,
    resumed_lr_schedule_origin,
)
from .commit_record import write_commit
from .config import Config
from .config.validate import config_notes
from .data import MicroBatchSource
from .data.stages import DataStages
from .data_parallel import DataParallelMode, JoinedState, Parked, ReplicaParts
from .engines import ModelEngine, build_model_engine
from .errors import ExitCode, InputError, StopRun
from .failures import Kind, Phase
from .logging import MetricsWriter, ids_digest
from .logging.benchmark import report_run_row
from .logging.profiler import StepProfiler
from .logging.progress import Progress
from .logging.prometheus import RunExporter
from .logging.runinfo import write_run_info
from .logging.wandb_logger import RunLogger, run_name_for_config
from .optim import lr_at
from .outcome import write_outcome
from .parallel.world import deterministic_kernels
from .timing import PhaseTimes

HISTORY_STEPS = 64  # recent step records every rank keeps, for a logger that takes over


def set_cpu_threads() -> None:
    """One share of the cores per rank: oversubscribed CPU ranks each spinning many threads crawl."""
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
    replicas: int
    extra: dict[str, Any] = field(default_factory=dict)


class DistributedTrainer:
    def __init__(self, cfg: Config, run_dir: str | Path, dp_mode: DataParallelMode):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.dp_mode = dp_mode
        self.world, self.ctx, joined = self.dp_mode.setup_world()
        if self.world.device.type == "cpu":
            set_cpu_threads()
        # Exact mode on CUDA: deterministic kernels, set before the engine makes its first cuBLAS call.
        kernels = deterministic_kernels(self.world.device.type) if cfg.recover.exact else None
        self._startup_lines = [kernels] if kernels is not None else []
        self.B = cfg.microbatches_per_step
        self.G = cfg.tokens.batch_accumulation_per_replica
        self.checkpoints_path = checkpoints_root(cfg, self.run_dir)
        self._data = DataStages(cfg)
        self.target_step = cfg.tokens.train_steps
        # Bad input found now (a damaged checkpoint, a truncated corpus, another tokenizer's corpus)
        # may show on some ranks only: every rank learns the first error and stops the same way,
        # instead of the others waiting for the failed ones in their first collective.
        error = None
        if joined is not None:
            # Spawned into a running job (re-join): the state comes from a healthy replica, and the
            # job's start-up checks are long past.
            try:
                self._data.open_all()
                self.start_step = self._adopt(joined)
            except BaseException as error:
                self.dp_mode.abort(error)  # an exception exit would leave the job waiting for us
                raise
        else:
            try:
                self.engine: ModelEngine = build_model_engine(cfg, self.world, self.ctx)
                # Open (and so check) every data stage's folders now, not when its first step comes.
                self._data.open_all()
                self.start_step = self._maybe_resume()
            except (InputError, CheckpointError, OSError) as e:
                error = " ".join(str(e).split())
            agreed = self.dp_mode.agree_startup(error)
            if agreed is not None:
                raise InputError(agreed)
        self.metrics: MetricsWriter | None = None
        self._history: list[dict[str, Any]] = []
        # Real on the logging rank only (see _start_reporting); no-ops elsewhere.
        self.run_logger = RunLogger()
        self.exporter: RunExporter | None = None  # logging.prometheus_port's endpoint
        self.progress = Progress(0, enabled=False)
        self._pending_save: PendingSave | None = None
        self.times = PhaseTimes()  # where each step's time goes, in its metrics record
        self._attach()

    def _adopt(self, joined: JoinedState) -> int:
        """Take a healthy replica's state (re-join): a new replica world, a fresh engine holding the
        received state. Returns the committed step it is from."""
        old = getattr(self, "engine", None)
        if old is not None:
            old.close()
        else:
            # Spawned into the job: the learning-rate schedule's origin is the job's, which its
            # checkpoints record (a parked rank kept its own, the same).
            self.cfg.lr_schedule_origin = lr_schedule_origin_at_start(self.cfg, self.checkpoints_path)
        self.world, self.ctx = joined.world, joined.ctx
        self.engine = build_model_engine(self.cfg, self.world, self.ctx)
        self.engine.import_state(joined.engine_state)
        return joined.step

    def _attach(self) -> None:
        self.dp_mode.attach(
            ReplicaParts(
                engine=self.engine,
                data=self.source_for,
                save=lambda step, synchronous: self.save(step, synchronous=synchronous),
                log_incident=self._log_incident,
                write_line=lambda line: self.progress.write(line, file=sys.stdout),
                write_outcome=self.write_outcome,
                world=self.world,
                ctx=self.ctx,
                B=self.B,
                G=self.G,
                target_step=lambda: self.target_step,
                times=self.times,
            )
        )

    def _log_incident(self, record: dict[str, Any]) -> None:
        """An incident the logging rank wrote to incidents.jsonl: to W&B and Prometheus."""
        self.run_logger.log_incident(record)
        if self.exporter is not None:
            self.exporter.observe_incident(record)

    # -- data --------------------------------------------------------------------------------
    def source_for(self, step: int) -> MicroBatchSource:
        return self._data.for_step(step)

    # -- checkpoints -------------------------------------------------------------------------
    def _maybe_resume(self) -> int:
        """Resume from ``resume_checkpoint_path`` or, failing that, this run's own latest checkpoint.

        Everything is checked before any state changes: the checkpoint belongs to this run (unless
        named explicitly), has this model's shapes, and every file this rank needs is readable."""
        ck = self.cfg.checkpoints
        reader = find_resume_checkpoint(self.cfg, self.checkpoints_path, rank=self.world.rank)
        if reader is None:
            self.cfg.lr_schedule_origin = 0  # a fresh run's schedule starts at its first step
            return 0
        self.engine.load(reader, ck.load_optimizer)
        reader.load_rng(self.world.rank, self.world.size)
        self.cfg.lr_schedule_origin = resumed_lr_schedule_origin(self.cfg, reader)
        if self.world.rank == 0:
            print(f"[nanotron-recover] resumed from {reader.path} at step {reader.step}", flush=True)
            if self.cfg.lr_schedule_origin:
                print(
                    "[nanotron-recover] the learning-rate schedule counts from step "
                    f"{self.cfg.lr_schedule_origin} (checkpoints.load_lr_scheduler: false)",
                    flush=True,
                )
        return reader.step

    def save(self, step: int, synchronous: bool = False) -> Path | None:
        """Collective over the ranks that write (all of them in plain mode, one replica in
        fault-tolerant mode). With asynchronous saves this returns once the state is staged in CPU
        memory; the previous save is always finished first. Raises CheckpointError when the save
        failed (nothing was published: the previous checkpoint stays the latest)."""
        if not self.dp_mode.is_checkpoint_writer():
            return None
        self.dp_mode.check_member()
        with self.dp_mode.local_phase(Phase.SAVE):
            self.wait_for_save()
            self.dp_mode.fault_point(Phase.SAVE)
            r, ck = self.cfg.recover, self.cfg.checkpoints
            asynchronous = not synchronous and (
                ck.async_save or (r.enabled and r.mode == "checkpoint_restart")
            )
            saved = self.engine.save(
                self.checkpoints_path, step, self.cfg, dp_rank=self.ctx.dp_rank, asynchronous=asynchronous
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
            self.dp_mode.request_stop(StopRun(Kind.IO, " ".join(str(e).split())))

    def _poll_save(self) -> None:
        """An asynchronous save that failed in the background stops the job too."""
        pending = self._pending_save
        if pending is not None and pending.done:
            self._pending_save = None
            try:
                pending.wait()
            except CheckpointError as e:
                self.dp_mode.request_stop(StopRun(Kind.IO, " ".join(str(e).split())))

    def _resave_final(self, step: int) -> None:
        """The replica that wrote the final checkpoint failed before the end: write it again."""
        if latest_step(self.checkpoints_path) != step:
            self._save_or_stop(step, synchronous=True)

    def write_outcome(self, status: str, last_step: int, stop: StopRun | None = None) -> bool:
        return write_outcome(
            self.run_dir,
            status=status,
            last_step=last_step,
            target_step=self.target_step,
            exit_code=stop.exit_code if stop is not None else ExitCode.OK,
            kind=stop.kind if stop is not None else None,
            message=stop.message if stop is not None else None,
        )

    # -- one optimizer step ------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        t0 = time.perf_counter()
        reduced = self.dp_mode.reduced_gradients(step)
        self.dp_mode.fault_point(Phase.OPTIMIZER)
        with self.dp_mode.local_phase(Phase.OPTIMIZER), self.times.phase("optimizer"):
            # 0-based rate index, counted from the schedule's origin (0 unless restarted on resume).
            k = step - 1 - self.cfg.lr_schedule_origin
            lr = lr_at(k, self.cfg.optimizer.learning_rate_scheduler, self.cfg.tokens.train_steps)
            grad_norm = self.engine.optimizer_step(lr)
        dt = time.perf_counter() - t0
        extra = {**reduced.extra, **self.times.record()}
        self.times.start()  # what runs between this step and the next counts in the next record
        return StepResult(step, reduced.loss, lr, grad_norm, reduced.ids, dt, reduced.replicas, extra)

    # -- the loop ------------------------------------------------------------------------------
    def train(self, stop_after_step: int | None = None) -> list[StepResult]:
        t = self.cfg.tokens
        ck = self.cfg.checkpoints
        results = []
        last = t.train_steps if stop_after_step is None else min(stop_after_step, t.train_steps)
        self.target_step = last
        if self.dp_mode.is_logger():
            # Fields accepted although they run differently here (same math) say so once.
            for note in config_notes(self.cfg) + self._startup_lines:
                print(f"[nanotron-recover] {note}", flush=True)
            self._write_run_info()
            # A resumed run redoes the steps after its checkpoint: drop their old records.
            self._start_reporting(truncate_after_step=self.start_step)
        if ck.save_initial_state and self.start_step == 0:
            self.save(0)
        final_save = ck.save_final_state or stop_after_step is not None
        profiler = StepProfiler.for_run(
            self.cfg.profiler,
            self.run_dir.name,
            f"replica{self.dp_mode.replica_id()}_{self.engine.digest_name}",
        )
        trace_s = stall_trace.trace_after_s(self.cfg.recover)  # a stalled rank's stacks, if any
        try:
            if profiler is not None:
                profiler.start()
            self.times.start()
            step = self.start_step + 1
            while step <= last:
                try:
                    if profiler is not None:
                        profiler.step(step)
                    r = self.train_step(step)
                    results.append(r)
                    self._log(r)
                    stall_trace.arm(trace_s)
                    due = ck.checkpoint_interval and step % ck.checkpoint_interval == 0
                    if due or (step == last and final_save):
                        with self.times.phase("checkpoint"):
                            self._save_or_stop(step)
                    self._poll_save()
                    self.dp_mode.after_step(step)
                except Parked as parked:
                    # My replica failed, I did not: wait for it to re-join, then go on from the
                    # state a healthy replica sends (or the run ends while parked: park exits).
                    self._pending_save = None
                    stall_trace.disarm()  # parked: no commit of mine is due
                    self._stop_reporting()  # a later logging role starts from the file, not from here
                    try:
                        step = self._adopt(parked.wait_for_rejoin()) + 1
                        self._attach()
                        self.times.start()  # the wait while parked is no step's time
                    except Exception as error:
                        self.dp_mode.abort(error)
                        raise
                    continue
                step += 1
            stall_trace.disarm()
            if profiler is not None:
                profiler.stop()  # writes the trace of a cycle still recording
            try:
                self.wait_for_save()
            except CheckpointError as e:
                self.dp_mode.request_stop(StopRun(Kind.IO, " ".join(str(e).split())))
            self.write_parameter_digest()
            self.dp_mode.finish(last, resave=self._resave_final if final_save else None)
            if self.cfg.general.benchmark_csv_path is not None and self.dp_mode.is_logger():
                report_run_row(
                    self.cfg, [r.step_time_s for r in results], self.cfg.general.run or self.run_dir.name
                )
        except Exception as error:
            stall_trace.disarm()
            if profiler is not None:
                profiler.stop()
            self.run_logger.finish(exit_code=1)
            self.dp_mode.abort(error)
            raise
        return results

    def _write_run_info(self) -> None:
        """``<run_dir>/run.json`` (logging/runinfo.py): the target and layout, for watchers."""
        p, r = self.cfg.parallelism, self.cfg.recover
        write_run_info(
            self.run_dir,
            {
                "run": self.cfg.general.run or self.run_dir.name,
                "target_step": self.target_step,
                "train_steps": self.cfg.tokens.train_steps,
                "start_step": self.start_step,
                "dp": p.dp,
                "tp": p.tp,
                "pp": p.pp,
                "dp_shard": p.dp_shard,
                "replica_size": p.replica_size,
                "B": self.B,
                "recover": r.mode if r.enabled else "plain",
                "rejoin": r.rejoin.mode,
                "started_at": time.time(),
            },
        )

    def write_parameter_digest(self) -> Path:
        """``<run_dir>/parameters/replica<r>_pp<p>_tp<t>.sha256``: a digest of this rank's parameters
        (of the full model for HSDP, whose shard index takes the tp place), so anyone can check that
        the replicas ended bitwise identical."""
        digest = self.engine.parameter_digest()
        folder = self.run_dir / "parameters"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"replica{self.dp_mode.replica_id()}_{self.engine.digest_name}.sha256"
        fencing.publish_text(self.run_dir, path, digest + "\n")  # an older job's rank: nothing
        return path

    def _stop_reporting(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
            self.metrics = None
        self.run_logger.finish()
        self.run_logger = RunLogger()
        self._stop_exporter()
        self.progress.close()
        self.progress = Progress(0, enabled=False)
        self._history.clear()

    def _start_reporting(self, truncate_after_step: int | None = None) -> None:
        self.metrics = MetricsWriter(self.run_dir / "metrics.jsonl", truncate_after_step=truncate_after_step)
        write_commit(self.run_dir, self.metrics.last_step)  # a resumed run's record goes back with it
        self.run_logger = RunLogger.start(
            self.cfg.logging.wandb, self.run_dir, run_name_for_config(self.cfg), self.cfg
        )
        self.progress = Progress(self.cfg.tokens.train_steps)
        port = self.cfg.logging.prometheus_port
        if port is not None and self.exporter is None:
            # Replays what the run directory holds: the endpoint moves with the logging role.
            self.exporter = RunExporter.start(self.run_dir, port)

    def _stop_exporter(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None

    def _log(self, r: StepResult) -> None:
        """Every rank keeps the records of recent steps; the logging rank writes them. A rank that
        takes over logging from a failed replica first writes the committed steps its predecessor
        did not get to (all replicas hold the same values for a committed step)."""
        t = self.cfg.tokens
        # B micro-batches a step, except in the adaptive world's ablation, which drops lost ones.
        tokens = len(r.ids) * t.micro_batch_size * t.sequence_length
        before = self._history[-1] if self._history and self._history[-1]["step"] == r.step - 1 else None
        consumed = (before["consumed_tokens"] if before else (r.step - 1) * self.cfg.tokens_per_step) + tokens
        record = {
            "step": r.step,
            "loss": r.loss,
            "lr": r.lr,
            "grad_norm": r.grad_norm,
            "tokens": tokens,
            "consumed_tokens": consumed,
            "step_time_s": r.step_time_s,
            "tokens_per_s": tokens / r.step_time_s,
            "replicas": r.replicas,
            "ids_digest": ids_digest(r.ids),
            "time": time.time(),
            **r.extra,
        }
        self._history.append(record)
        del self._history[:-HISTORY_STEPS]
        if not self.dp_mode.is_logger():
            self._stop_exporter()  # the role moved: the port is the new logger's
            return
        self.dp_mode.check_member()
        if self.metrics is None:
            self._start_reporting()  # taking over from the failed logging replica
        for rec in self._history:
            self.metrics.write(rec)  # skips steps already in the file
            self.run_logger.log_step(rec)  # likewise
        write_commit(self.run_dir, self.metrics.last_step)  # what the supervisor reads
        if self.exporter is not None:
            self.exporter.observe_step(record)
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
        self._stop_exporter()
        if self.metrics is not None:
            self.metrics.close()
        self.engine.close()
        self.dp_mode.close()
