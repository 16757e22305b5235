"""The config schema: Nanotron's YAML sections plus one ``recover:`` section (in ``recover.py``).

Field names follow Nanotron's ``Config`` (its main branch) so a Nanotron config of a dense LLaMA
parses unchanged. Nothing configured is silently ignored; a field this engine does not implement
either

- changes no math (an execution strategy: sequence parallelism, asynchronous TP communication,
  activation recomputation, ...): it is accepted and runs the plain way, with a ``note:`` line in
  the dry-run plan and at training start (``validate.NOTED_FIELDS``); or
- would change the result: only its neutral value (the Nanotron default) is accepted, anything
  else is refused in one line naming the field and the values that run (``validate.FIXED_FIELDS``,
  ``validate.MODEL_FIXED_FIELDS``).

Keys Nanotron refuses too (its older schema) or that describe another model (Mamba, LlaMoE, muP,
DoReMi) are refused while parsing, each with its own line (``REFUSED_KEYS``, ``yaml_variant``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from .loader import ConfigError
from .recover import RecoverArgs

DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class GeneralArgs:
    project: str = "nanotron_recover"
    run: str | None = None
    seed: int = 42
    step: int | None = None
    consumed_train_samples: int | None = None
    # At the end of training the logging rank appends one row of throughput numbers to this CSV.
    benchmark_csv_path: Path | None = None
    # Nanotron's false runs debug assertions that tensors agree across ranks; none run here (noted).
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
    # Nanotron's context parallelism (ring attention over sequence chunks); only 1 runs here.
    context_parallel_size: int = 1
    # Whether sequence parallelism re-gathers its input in backward instead of keeping it: memory
    # only, and with tp_mode running as ALL_REDUCE here there is no gather, so either value runs
    # the same (as in Nanotron with ALL_REDUCE); false with REDUCE_SCATTER is noted
    # (validate.NOTED_FIELDS).
    tp_recompute_allgather: bool = True
    # Recomputation of MoE layers (examples/config_resume_training.yaml; not in Nanotron main's
    # ParallelismArgs): a dense model has none, so true is noted as changing nothing.
    moe_layer_recompute: bool = False
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


# Nanotron's attention implementations (plus Hugging Face's eager): all of them compute the same
# causal softmax attention, which runs as torch's scaled_dot_product_attention here.
AttnImplementation = Literal[
    "flash_attention_2",
    "flex_attention",
    "sdpa",
    "eager",
    "ring_flash_triton",
    "ring",
    "llama3_ring_attention",
]

# model_config markers of Nanotron models that are not a dense LLaMA: the marker, what it is.
OTHER_MODEL_KINDS: dict[str, str] = {
    "is_mamba_config": "Mamba (a state-space model)",
    "is_llamoe_config": "LlaMoE (a mixture-of-experts LLaMA)",
    "is_starcoder2_config": "Starcoder2",
}


@dataclass
class LlamaConfig:
    """Nanotron's LlamaConfig (the Hugging Face LlamaConfig fields that matter for pre-training).

    A Nanotron ``Qwen2Config`` (``is_qwen2_config: true``) parses as :class:`Qwen2Config`, which is
    a LlamaConfig: it trains as one when its Qwen2-only fields are at their dense-LLaMA values.
    """

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
    # Fields of Nanotron main's LlamaConfig: a bias on the attention projections and a z-loss term
    # change the math (only false runs); the attention kernel does not (null: Nanotron's default).
    attention_bias: bool = False
    _attn_implementation: AttnImplementation | None = None
    z_loss_enabled: bool = False
    z_loss_coefficient: float = 1e-4

    @classmethod
    def yaml_variant(cls, data: dict[str, Any], where: str) -> type:
        """The class a ``model_config`` mapping describes: :class:`Qwen2Config` when it carries
        Nanotron's ``is_qwen2_config`` marker, LlamaConfig otherwise; another model's marker
        (Mamba, LlaMoE, Starcoder2) is refused in one line."""
        for marker, kind in OTHER_MODEL_KINDS.items():
            if data.get(marker):
                raise ConfigError(
                    f"{where}.{marker}=true is not supported: {kind} is not a dense LLaMA, the only "
                    "model this engine trains; set is_llama_config: true (or Nanotron's Qwen2Config, "
                    "is_qwen2_config: true, describing a dense LLaMA)"
                )
        return Qwen2Config if "is_qwen2_config" in data else LlamaConfig

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class Qwen2Config(LlamaConfig):
    """Nanotron's Qwen2Config, accepted when it describes a dense LLaMA (e.g. SmolLM2).

    Its fields that change the math (a sliding window, document masking, layers without RoPE,
    position interpolation, experts, an attention bias, a z-loss) are accepted only at the values
    that make it a LLaMA (``validate.MODEL_FIXED_FIELDS``); its kernel switches (fused rotary and
    RMSNorm, a packed QKV, logging attention probabilities) change no math and are accepted as
    they are. It then builds, trains, saves and converts exactly as a LlamaConfig.
    """

    is_qwen2_config: bool = True
    # Not a key of Nanotron's Qwen2Config: a LLaMA flag, set here so every LlamaConfig check holds.
    is_llama_config: bool = field(default=True, init=False)
    rope_seq_len_interpolation_factor: float | None = None
    flex_attention_mask: str | None = None
    sliding_window_size: int | None = None
    no_rope_layer: int | None = None
    _fused_rotary_emb: bool = True
    _fused_rms_norm: bool = True
    _use_qkv_packed: bool = True
    _use_doc_masking: bool = False
    log_attn_probs: bool = True
    # Only read by llama3_ring_attention with context parallelism, which runs as plain attention.
    ring_attn_heads_k_stride: int | None = None
    moe_config: dict[str, Any] | None = None
    # An older spelling of rope_interleaved (examples/config_resume_training.yaml sets it; Nanotron
    # main does not know it): accepted when it agrees with rope_interleaved.
    interleaved_rotary: bool | None = None


InitScaling = Literal["NONE", "NUM_LAYERS", "LAYER_INDEX", "MODEL_SCALE"]


@dataclass
class InitMethod:
    """``{std: 0.02}`` draws fresh weights; ``{path: CKPT}`` starts from a saved checkpoint."""

    std: float | None = None
    path: Path | None = None
    # Nanotron's RandomInit.scaling_method, with its default: NUM_LAYERS draws the output projections
    # (o_proj, down_proj) with std / sqrt(2 * num_hidden_layers), NONE every weight with std.
    scaling_method: InitScaling = "NUM_LAYERS"

    @property
    def depth_scaled(self) -> bool:
        """Whether the output projections' std shrinks with depth (``scaling_method: NUM_LAYERS``)."""
        return self.scaling_method == "NUM_LAYERS"

    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        "use_mup": "is not supported: spectral muP (Nanotron's SpectralMupInit) is not implemented, "
        "LLaMA trains in standard parametrisation here; set model.init_method to {std: ...} or {path: ...}",
    }


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
    lr_decay_style: Literal["linear", "cosine", "1-sqrt", "constant"] = "linear"
    lr_decay_steps: int | None = None
    lr_decay_starting_step: int | None = None
    # Nanotron's default: null decays to the learning rate itself (no decay).
    min_decay_lr: float | None = None

    def __post_init__(self) -> None:
        if self.min_decay_lr is None:
            self.min_decay_lr = self.learning_rate


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
    # Nanotron main: regex patterns of parameters without weight decay; only none is implemented.
    weight_decay_exclude_named_params: list[str] | None = None

    # Nanotron's older schema put the AdamW fields directly under optimizer; Nanotron main
    # refuses them there too.
    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        name: f"is Nanotron's older schema (Nanotron main refuses it too): it goes under "
        f"optimizer.optimizer_factory.{name} now, next to name: adamW"
        for name in ("adam_beta1", "adam_beta2", "adam_eps", "torch_adam_is_fused")
    }


@dataclass
class NanosetDatasetsArgs:
    """Nanotron's Nanoset: one or more folders tokenized by datatrove (``*.ds`` files).

    ``dataset_folder`` is one folder, a list of folders (each weighted by its size, so an epoch
    reads every sample once) or a ``{folder: weight}`` mapping; ``dataset_weights`` gives the
    weights of a list instead. How samples are drawn is in :mod:`nanotron_recover.data.nanoset`.
    """

    dataset_folder: str | list[str] | dict[str, float]
    dataset_weights: list[float] | None = None
    # A local copy of each folder, read instead of dataset_folder where it exists (Nanotron's
    # offloading: the same tokens, so the same samples).
    dataset_read_path: str | list[str] | None = None
    # Nanotron fills these from the folders' .ds.metadata; when set they must agree with it.
    tokenizer_name: str | None = None
    vocab_size: int | None = None
    token_size_in_bytes: int | None = None
    # Per-document positions matter only with document masking, which LLaMA here does not use:
    # either value trains the same model.
    return_positions: bool | None = True
    # Fields of Nanotron's tokenized-bytes loader; only their defaults are implemented
    # (validate.FIXED_FIELDS-style refusals in validate._validate_data).
    skip_in_stream: bool | None = False
    pad_samples_to_global_batch_size: bool | None = False
    dataset_max_tokens: list[int] | None = None
    shuffle_files: bool | None = False
    use_old_brrr_dataloader: bool | None = False
    # Ours: the folders' tokenizer (.ds.metadata) must be tokenizer.tokenizer_name_or_path.
    validate_tokenizer: bool = True

    def folders(self) -> list[str]:
        """The folders, in the config's order."""
        if isinstance(self.dataset_folder, str):
            return [self.dataset_folder]
        return list(self.dataset_folder)

    def weights(self) -> list[float] | None:
        """The folders' weights as given (not normalised), or None: weighted by size."""
        if isinstance(self.dataset_folder, dict):
            return [float(w) for w in self.dataset_folder.values()]
        if self.dataset_weights is not None:
            return [float(w) for w in self.dataset_weights]
        return None

    def read_paths(self) -> list[str]:
        """Where each folder is read from: its ``dataset_read_path`` when that exists."""
        folders = self.folders()
        given = self.dataset_read_path
        if given is None:
            return folders
        reads = [given] if isinstance(given, str) else list(given)
        return [r if Path(r).is_dir() else f for f, r in zip(folders, reads, strict=True)]


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
    dataset: NanosetDatasetsArgs | HFDatasetArgs | None = None
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
    # null keeps every checkpoint (as Nanotron does); N >= 2 keeps the N newest: each publication
    # removes older step folders (checkpoint/publish.py), so a long run's disk use stays bounded.
    keep_last: int | None = None


# Nanotron's log levels. Console output here has no levels: another than info is noted.
LogLevel = Literal["debug", "info", "warning", "error", "critical", "passive"]


# How a W&B run is written (see logging/wandb_logger.py for how null resolves).
WandbMode = Literal["online", "offline", "disabled"]


@dataclass
class WandbArgs:
    """The ``logging.wandb`` config section; absent (null) means no W&B at all."""

    project: str = "nanotron-recover"
    entity: str | None = None
    group: str | None = None
    # null: online when an API key is available, offline otherwise (see logging/wandb_logger.py).
    mode: WandbMode | None = None
    # null: the run name the trainer derives from the recovery mode (see run_name_for).
    name: str | None = None


@dataclass
class LoggingArgs:
    log_level: LogLevel = "info"
    log_level_replica: LogLevel = "info"
    iteration_step_info_interval: int = 1
    # Weights & Biases: {project, entity, group, mode}; mode defaults to offline without an API key.
    wandb: WandbArgs | None = None
    # Prometheus: the logging rank serves the run's metrics over HTTP on this port (null: off; 0: a
    # free port the system picks). Where it is served, which moves with the logging role, is written
    # to <run_dir>/prometheus_targets.json (see logging/prometheus.py).
    prometheus_port: int | None = None


@dataclass
class TokenizerArgs:
    tokenizer_name_or_path: str | None = None
    tokenizer_revision: str | None = None
    tokenizer_max_length: int | None = None


@dataclass
class ProfilerArgs:
    """Nanotron's ``profiler:`` section: torch.profiler over a window of training steps.

    Steps are counted from the first step this process trains (a resumed run profiles the same
    window after its restart, as in Nanotron): ``skip_first`` steps, then ``repeat`` cycles of
    ``wait`` idle, ``warmup`` and ``active`` recorded steps (``repeat: 0`` cycles until the end).
    Each rank writes one Chrome-trace JSON per cycle under ``profiler_export_path``; see
    :class:`nanotron_recover.logging.profiler.StepProfiler`.
    """

    profiler_export_path: Path | None = None
    wait: int = 1
    warmup: int = 1
    active: int = 1
    repeat: int = 1
    skip_first: int = 3
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = True
    # The traces written are Chrome traces already (TensorBoard reads them too): nothing to add.
    export_chrome_trace: bool = False


@dataclass
class MetricsLoggingArgs:
    """Nanotron's ``metrics_logging:``: level 0 logs the basic metrics (all that is logged here,
    to ``<run_dir>/metrics.jsonl``); level 1 adds detailed per-layer statistics (refused)."""

    log_level: int = 0
    log_detail_interval: int = 10


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
    metrics_logging: MetricsLoggingArgs | None = None
    profiler: ProfilerArgs | None = None
    # Nanotron's LightEval runs and S3 checkpoint uploads: parsed as mappings so that a set one is
    # refused with its reason (validate.FIXED_FIELDS); only null runs.
    lighteval: dict[str, Any] | None = None
    s3_upload: dict[str, Any] | None = None
    kill_switch_path: Path | None = None
    # Run-time state, not configuration (no YAML key, not dumped, not compared): the optimizer
    # step the learning-rate schedule counts from. 0, or the resumed step when
    # checkpoints.load_lr_scheduler is false (a fresh schedule, as Nanotron's); every checkpoint
    # records it so that resuming this run's own checkpoints continues the same schedule.
    lr_schedule_origin: int = field(default=0, init=False, repr=False, compare=False)

    REFUSED_KEYS: ClassVar[dict[str, str]] = {
        "doremi": "is not supported: DoReMi (Nanotron's domain reweighting with a reference and a "
        "proxy model) is not implemented, this engine pre-trains one dense LLaMA; remove the section",
        "data": "is Nanotron's older schema (Nanotron main refuses it too): the section goes under "
        "data_stages now, as data_stages: [{name: ..., start_training_step: 1, data: <this section>}]",
    }

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
