"""The config schema: Nanotron's YAML sections plus one ``recover:`` section.

Field names follow Nanotron's ``Config`` so a Nanotron example config parses unchanged. Sections
this engine does not use (``lighteval``, ``profiler``) are accepted only when null, and a field with
one implemented behaviour accepts only that value (``validate.FIXED_FIELDS``), so nothing configured
is ever silently ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from ..logging.wandb_logger import WandbArgs

DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class GeneralArgs:
    project: str = "nanotron_recover"
    run: str | None = None
    seed: int = 42
    step: int | None = None
    consumed_train_samples: int | None = None
    benchmark_csv_path: str | None = None
    ignore_sanity_checks: bool = True


@dataclass
class ParallelismArgs:
    dp: int = 1
    pp: int = 1
    tp: int = 1
    pp_engine: Literal["afab", "1f1b"] = "1f1b"
    tp_mode: Literal["ALL_REDUCE", "REDUCE_SCATTER"] = "ALL_REDUCE"
    tp_linear_async_communication: bool = False
    expert_parallel_size: int = 1
    recompute_layer: bool = False
    # HSDP: each data-parallel replica is dp_shard ranks running FSDP2 (parameters, gradients and
    # optimizer state sharded inside the replica); 1 is the 3D engine. Needs tp = pp = 1.
    dp_shard: int = 1

    @property
    def inner(self) -> int:
        """Ranks along the innermost dimension of the rank grid: tp ranks, or HSDP shard ranks."""
        return self.tp * self.dp_shard

    @property
    def replica_size(self) -> int:
        """Ranks per data-parallel replica."""
        return self.inner * self.pp


@dataclass
class LlamaConfig:
    """Nanotron's LlamaConfig (the Hugging Face LlamaConfig fields that matter for pre-training)."""

    bos_token_id: int = 1
    eos_token_id: int = 2
    hidden_act: Literal["silu"] = "silu"
    hidden_size: int = 4096
    initializer_range: float = 0.02
    intermediate_size: int = 11008
    is_llama_config: bool = True
    max_position_embeddings: int = 2048
    num_attention_heads: int = 32
    num_hidden_layers: int = 32
    num_key_value_heads: int | None = None
    pad_token_id: int | None = None
    pretraining_tp: int = 1
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = None
    rope_theta: float = 10000.0
    rope_interleaved: bool = False
    tie_word_embeddings: bool = False
    use_cache: bool = True
    vocab_size: int = 32000

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class InitMethod:
    """``{std: 0.02}`` draws fresh weights; ``{path: CKPT}`` starts from a saved checkpoint."""

    std: float | None = None
    path: Path | None = None


@dataclass
class ModelArgs:
    model_config: LlamaConfig = field(default_factory=LlamaConfig)
    init_method: InitMethod = field(default_factory=lambda: InitMethod(std=0.02))
    dtype: DType = "bfloat16"
    make_vocab_size_divisible_by: int = 1
    ddp_bucket_cap_mb: int = 25


@dataclass
class TokensArgs:
    sequence_length: int = 2048
    train_steps: int = 1
    micro_batch_size: int = 1
    batch_accumulation_per_replica: int = 1
    val_check_interval: int = -1
    limit_val_batches: int = 0
    limit_test_batches: int = 0


@dataclass
class LRSchedulerArgs:
    learning_rate: float = 3e-4
    lr_warmup_steps: int = 0
    lr_warmup_style: Literal["linear", "constant"] = "linear"
    lr_decay_style: Literal["linear", "cosine", "constant"] = "linear"
    lr_decay_steps: int | None = None
    lr_decay_starting_step: int | None = None
    min_decay_lr: float = 0.0


@dataclass
class OptimizerFactory:
    name: Literal["adamW"] = "adamW"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    torch_adam_is_fused: bool = False


@dataclass
class OptimizerArgs:
    optimizer_factory: OptimizerFactory = field(default_factory=OptimizerFactory)
    learning_rate_scheduler: LRSchedulerArgs = field(default_factory=LRSchedulerArgs)
    zero_stage: int = 0
    weight_decay: float = 0.0
    clip_grad: float | None = None
    accumulate_grad_in_fp32: bool = True


@dataclass
class TokenizedDatasetArgs:
    """A corpus written by ``nanotron-recover preprocess`` (token memmap + JSON index)."""

    dataset_folder: Path
    validate_tokenizer: bool = True


@dataclass
class HFDatasetArgs:
    """Nanotron's on-the-fly Hugging Face dataset; accepted so Nanotron configs load, but training
    needs it tokenized first with ``nanotron-recover preprocess``."""

    hf_dataset_or_datasets: str | list[str] | dict[str, float]
    hf_dataset_splits: str | list[str] | None = None
    hf_dataset_config_name: str | None = None
    dataset_processing_num_proc_per_process: int = 1
    dataset_overwrite_cache: bool = False
    text_column_name: str = "text"


@dataclass
class DataArgs:
    # null -> deterministic synthetic tokens keyed by micro-batch id (as in Nanotron's examples).
    dataset: TokenizedDatasetArgs | HFDatasetArgs | None = None
    seed: int | None = None
    num_loading_workers: int = 1


@dataclass
class DatasetStageArgs:
    data: DataArgs = field(default_factory=DataArgs)
    name: str = "Stable Training Stage"
    start_training_step: int = 1


@dataclass
class CheckpointsArgs:
    checkpoints_path: Path | None = None
    checkpoint_interval: int = 0
    save_initial_state: bool = False
    save_final_state: bool = True
    resume_checkpoint_path: Path | None = None
    checkpoints_path_is_shared_file_system: bool = True
    # Stage to CPU memory, then write in a background thread while training goes on.
    async_save: bool = False
    load_lr_scheduler: bool = True
    load_optimizer: bool = True


@dataclass
class LoggingArgs:
    log_level: str = "info"
    log_level_replica: str = "info"
    iteration_step_info_interval: int = 1
    # Weights & Biases: {project, entity, group, mode}; mode defaults to offline without an API key.
    wandb: WandbArgs | None = None


@dataclass
class TokenizerArgs:
    tokenizer_name_or_path: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_max_length: int | None = None


Phase = Literal["forward", "backward", "gate", "reduce", "agree", "optimizer", "recovery", "save", "rejoin"]


@dataclass
class FaultSpec:
    """A fault injected at an exact point of a step.

    ``kind: kill`` (default) SIGKILLs one replica (all its ranks) or one rank; ``kind: freeze``
    SIGSTOPs it instead (how a hung GPU or a stuck collective looks from outside). ``microbatch`` is
    the index, within what the victim computes in that phase, of the micro-batch
    (forward/backward/recovery) or bucket (reduce) before which it fires; ``phase: save`` fires while
    the victim writes its checkpoint files; ``phase: rejoin`` fires in the re-join at the boundary
    after ``step``: ``microbatch: 0`` before the spawn (a member), ``1`` mid-transfer (the donor
    after sending the layout, or the spawned process taking ``rank``'s place after receiving it).

    ``kind: error`` raises an exception in whichever replica computes the micro-batch ``id`` (a
    global micro-batch id) of ``step``; ``persistent: true`` raises it every time (a deterministic
    error, e.g. a bad sample), otherwise only the first time (a transient, hardware-like error).
    """

    step: int
    phase: Phase = "forward"
    replica: int | None = None
    rank: int | None = None
    microbatch: int = 0
    kind: Literal["kill", "freeze", "error"] = "kill"
    id: int | None = None
    persistent: bool = False


@dataclass
class RandomFaults:
    """Every ``every_steps`` steps kill one alive replica chosen by ``seed``, until
    ``until_replicas`` are left."""

    every_steps: int
    seed: int = 0
    until_replicas: int = 1


@dataclass
class RejoinArgs:
    """Growing back to full width after a replica is lost (see docs/architecture.md, "Re-join")."""

    # off: a job only shrinks. spawn: at a step boundary the survivors spawn processes for the dead
    # ranks of a lost replica (MPI_Comm_spawn), its surviving ranks are reused, and the replica's
    # state is copied from a healthy replica.
    mode: Literal["off", "spawn"] = "off"
    # Re-join at the first step boundary at least this many committed steps after the failure.
    after_steps: int = 1
    # Spawn attempts over the whole run (a failed attempt counts); then the job stays at its width.
    max_spawns: int = 16
    # A replica lost this many times is not re-spawned again.
    max_failures_per_replica: int = 3
    # Where spawned processes go: hosts ("node7" or "node7:4" slots) or a hostfile; neither: any
    # free slot mpirun knows of (on Slurm, the spare nodes of `nanotron-recover slurm --spare-nodes`).
    hosts: list[str] = field(default_factory=list)
    hostfile: str | None = None


@dataclass
class RecoverArgs:
    """Forward recovery across data-parallel replicas (off by default)."""

    enabled: bool = False
    # forward: repair inside the step (this project). checkpoint_restart: the classic baseline, for
    # comparison: on a failure the whole job is relaunched on as many ranks and resumes from the last
    # checkpoint (checkpoints.checkpoint_interval), recomputing the lost steps.
    mode: Literal["forward", "checkpoint_restart"] = "forward"
    # checkpoint_restart: relaunches before giving up.
    max_restarts: int = 100
    # The DP reduction runs in buckets of this size; each bucket is snapshotted before it is reduced.
    bucket_size_mb: float = 25.0
    # How a torn bucket is restored: blocking copy, or (CUDA) on a side stream overlapped with the
    # extra micro-batches; on CPU async falls back to blocking.
    restore: Literal["blocking", "async"] = "blocking"
    # Replicas left over by G = ceil(B/W) shadow a Major (free promotion) or idle.
    spares: Literal["shadow", "off"] = "shadow"
    # Below this many alive replicas the survivors checkpoint and stop.
    min_replicas: int = 1
    # Deadline of every phase only this replica can see (compute, gate, optimizer, its own
    # reductions, checkpoint save); when one passes, the stuck replica leaves (null disables it).
    # Waits on other replicas are never under it: those belong to the heartbeat detector.
    watchdog_timeout_s: float | None = 600.0
    # ULFM's heartbeat failure detector: every rank sends a heartbeat every period; a rank silent
    # for the timeout is declared failed (a frozen process, node or network), and the others
    # shrink past it. Short values catch hangs sooner at the risk of declaring a busy rank dead.
    heartbeat_period_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    # Replica-consistency gate: barrier in the replica's torch world before cross-replica traffic.
    gate_timeout_s: float = 120.0
    faults: list[FaultSpec] = field(default_factory=list)
    random_faults: RandomFaults | None = None
    # Growing back to full width after a replica is lost (forward recovery only).
    rejoin: RejoinArgs = field(default_factory=RejoinArgs)

    @property
    def forward(self) -> bool:
        """Forward recovery runs: ``enabled`` and ``mode: forward`` (ULFM, repair inside the step)."""
        return self.enabled and self.mode == "forward"

    @property
    def checkpoint_restart(self) -> bool:
        """The checkpoint-restart baseline runs: ``enabled`` and ``mode: checkpoint_restart``."""
        return self.enabled and self.mode == "checkpoint_restart"


@dataclass
class Config:
    general: GeneralArgs = field(default_factory=GeneralArgs)
    parallelism: ParallelismArgs = field(default_factory=ParallelismArgs)
    model: ModelArgs = field(default_factory=ModelArgs)
    tokens: TokensArgs = field(default_factory=TokensArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    data_stages: list[DatasetStageArgs] = field(default_factory=lambda: [DatasetStageArgs()])
    checkpoints: CheckpointsArgs = field(default_factory=CheckpointsArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    tokenizer: TokenizerArgs = field(default_factory=TokenizerArgs)
    recover: RecoverArgs = field(default_factory=RecoverArgs)
    lighteval: None = None
    profiler: None = None
    s3_upload: None = None
    kill_switch_path: Path | None = None

    @property
    def world_size(self) -> int:
        p = self.parallelism
        return p.dp * p.replica_size

    @property
    def microbatches_per_step(self) -> int:
        """``B``: micro-batches every optimizer step sums, whatever the layout or the faults."""
        return self.parallelism.dp * self.tokens.batch_accumulation_per_replica

    @property
    def tokens_per_step(self) -> int:
        return self.microbatches_per_step * self.tokens.micro_batch_size * self.tokens.sequence_length

    def stage_for_step(self, step: int) -> DatasetStageArgs:
        """The data stage active at (1-based) ``step``: the last one that has started."""
        started = [s for s in self.data_stages if s.start_training_step <= step]
        return max(started, key=lambda s: s.start_training_step)
