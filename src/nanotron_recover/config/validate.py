"""Cross-field checks: each returns one line that says what is wrong and what to change."""

from __future__ import annotations

from .loader import ConfigError
from .schema import Config, HFDatasetArgs, TokenizedDatasetArgs


def validate_config(cfg: Config, check_paths: bool = True) -> None:
    """Raise ConfigError for a config that cannot train; ``check_paths`` also checks dataset folders."""
    p, m, t = cfg.parallelism, cfg.model.model_config, cfg.tokens
    for name in ("dp", "tp", "pp"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallelism.{name} must be >= 1, got {getattr(p, name)}")
    if p.expert_parallel_size != 1:
        raise ConfigError("parallelism.expert_parallel_size must be 1: LLaMA has no experts")
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model_config.hidden_size {m.hidden_size} is not divisible by "
            f"num_attention_heads {m.num_attention_heads}"
        )
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(
            f"model_config.num_attention_heads {m.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {m.kv_heads}"
        )
    if m.num_attention_heads % p.tp:
        raise ConfigError(
            f"parallelism.tp={p.tp} does not divide model_config.num_attention_heads="
            f"{m.num_attention_heads}: choose tp among the divisors of the head count"
        )
    if m.kv_heads % p.tp:
        raise ConfigError(
            f"parallelism.tp={p.tp} does not divide model_config.num_key_value_heads={m.kv_heads}: "
            "each tensor-parallel rank needs whole key/value heads"
        )
    if m.intermediate_size % p.tp:
        raise ConfigError(
            f"parallelism.tp={p.tp} does not divide model_config.intermediate_size={m.intermediate_size}"
        )
    if m.vocab_size % p.tp:
        raise ConfigError(
            f"parallelism.tp={p.tp} does not divide model_config.vocab_size={m.vocab_size}: "
            "pad the vocabulary (model.make_vocab_size_divisible_by) or change tp"
        )
    if m.vocab_size % cfg.model.make_vocab_size_divisible_by:
        raise ConfigError(
            f"model_config.vocab_size={m.vocab_size} is not a multiple of "
            f"model.make_vocab_size_divisible_by={cfg.model.make_vocab_size_divisible_by}"
        )
    if p.pp > m.num_hidden_layers:
        raise ConfigError(
            f"parallelism.pp={p.pp} is greater than model_config.num_hidden_layers="
            f"{m.num_hidden_layers}: every pipeline stage needs at least one layer"
        )
    if p.tp > 1 and p.tp_mode != "ALL_REDUCE":
        raise ConfigError(
            f"parallelism.tp_mode={p.tp_mode} (sequence parallelism) is not implemented: "
            "set parallelism.tp_mode: ALL_REDUCE"
        )
    if m.rope_scaling is not None:
        raise ConfigError("model_config.rope_scaling is not supported: set it to null")
    if m.pretraining_tp != 1:
        raise ConfigError("model_config.pretraining_tp must be 1")
    if t.sequence_length > m.max_position_embeddings:
        raise ConfigError(
            f"tokens.sequence_length={t.sequence_length} exceeds "
            f"model_config.max_position_embeddings={m.max_position_embeddings}"
        )
    for name in ("sequence_length", "train_steps", "micro_batch_size", "batch_accumulation_per_replica"):
        if getattr(t, name) < 1:
            raise ConfigError(f"tokens.{name} must be >= 1, got {getattr(t, name)}")
    sched = cfg.optimizer.learning_rate_scheduler
    if sched.lr_warmup_steps < 0:
        raise ConfigError(
            f"optimizer.learning_rate_scheduler.lr_warmup_steps must be >= 0, got {sched.lr_warmup_steps}"
        )
    if sched.lr_decay_steps is not None and sched.lr_decay_steps < 1:
        raise ConfigError(
            f"optimizer.learning_rate_scheduler.lr_decay_steps must be >= 1 or null, got {sched.lr_decay_steps}: "
            "for a constant rate set lr_decay_style: constant"
        )
    init = cfg.model.init_method
    if (init.std is None) == (init.path is None):
        raise ConfigError("model.init_method must set exactly one of std (random init) or path (checkpoint)")
    if init.std is not None and init.std <= 0:
        raise ConfigError(f"model.init_method.std must be > 0, got {init.std}")
    if cfg.optimizer.zero_stage != 0:
        if cfg.recover.enabled:
            raise ConfigError(
                "optimizer.zero_stage > 0 cannot be used with recover.enabled: a ZeRO shard lost with "
                "its replica could not be recovered; set optimizer.zero_stage: 0"
            )
        raise ConfigError(
            f"optimizer.zero_stage={cfg.optimizer.zero_stage} is not supported: set optimizer.zero_stage: 0"
        )
    _validate_recover(cfg)
    if cfg.checkpoints.checkpoint_interval < 0:
        raise ConfigError("checkpoints.checkpoint_interval must be >= 0 (0 disables periodic checkpoints)")
    if not cfg.data_stages:
        raise ConfigError("data_stages must list at least one stage")
    starts = [s.start_training_step for s in cfg.data_stages]
    if 1 not in starts:
        raise ConfigError("data_stages: one stage must have start_training_step: 1")
    if len(set(starts)) != len(starts):
        raise ConfigError(f"data_stages: two stages share a start_training_step ({sorted(starts)})")
    for i, stage in enumerate(cfg.data_stages):
        ds = stage.data.dataset
        where = f"data_stages[{i}].data.dataset"
        if isinstance(ds, HFDatasetArgs):
            raise ConfigError(
                f"{where}: hf_dataset_or_datasets is tokenized on the fly by Nanotron; here run "
                "`nanotron-recover preprocess` once and set dataset_folder to its output"
            )
        if check_paths and isinstance(ds, TokenizedDatasetArgs) and not ds.dataset_folder.is_dir():
            raise ConfigError(
                f"{where}.dataset_folder {str(ds.dataset_folder)!r} does not exist: run "
                "`nanotron-recover preprocess --out` into it or fix the path"
            )


def check_world_size(cfg: Config, world_size: int) -> None:
    """The launched world must be exactly tp*pp*dp ranks."""
    p = cfg.parallelism
    if world_size != cfg.world_size:
        raise ConfigError(
            f"world size {world_size} != tp*pp*dp = {p.tp}*{p.pp}*{p.dp} = {cfg.world_size}: "
            f"launch {cfg.world_size} ranks or change parallelism"
        )


# Points of a plain (checkpoint-restart) step where a fault can be injected.
PLAIN_PHASES = ("forward", "backward", "reduce", "optimizer")


def _validate_recover(cfg: Config) -> None:
    r, dp = cfg.recover, cfg.parallelism.dp
    if r.bucket_size_mb <= 0:
        raise ConfigError(f"recover.bucket_size_mb must be > 0, got {r.bucket_size_mb}")
    if not 1 <= r.min_replicas <= dp:
        raise ConfigError(f"recover.min_replicas={r.min_replicas} must be between 1 and parallelism.dp={dp}")
    if r.gate_timeout_s <= 0:
        raise ConfigError("recover.gate_timeout_s must be > 0")
    world = cfg.world_size
    for i, f in enumerate(r.faults):
        where = f"recover.faults[{i}]"
        if (f.replica is None) == (f.rank is None):
            raise ConfigError(f"{where}: set exactly one of replica or rank")
        if f.replica is not None and not 0 <= f.replica < dp:
            raise ConfigError(f"{where}: replica {f.replica} does not exist (parallelism.dp={dp})")
        if f.rank is not None and not 0 <= f.rank < world:
            raise ConfigError(f"{where}: rank {f.rank} does not exist (world size {world})")
        if not 1 <= f.step <= cfg.tokens.train_steps:
            raise ConfigError(
                f"{where}: step {f.step} is outside 1..tokens.train_steps={cfg.tokens.train_steps}"
            )
        if f.microbatch < 0:
            raise ConfigError(f"{where}: microbatch must be >= 0")
    rf = r.random_faults
    if rf is not None:
        if rf.every_steps < 1:
            raise ConfigError("recover.random_faults.every_steps must be >= 1")
        if not 1 <= rf.until_replicas <= dp:
            raise ConfigError(
                f"recover.random_faults.until_replicas must be between 1 and parallelism.dp={dp}"
            )
    if r.enabled and r.mode == "checkpoint_restart":
        if cfg.checkpoints.checkpoint_interval < 1:
            raise ConfigError("recover.mode: checkpoint_restart needs checkpoints.checkpoint_interval >= 1")
        for i, f in enumerate(r.faults):
            if f.phase not in PLAIN_PHASES:
                raise ConfigError(
                    f"recover.faults[{i}]: phase {f.phase!r} does not exist in checkpoint_restart mode "
                    f"(choose {', '.join(PLAIN_PHASES)})"
                )
        if r.max_restarts < 0:
            raise ConfigError("recover.max_restarts must be >= 0")
    if (r.faults or rf is not None) and not r.enabled:
        raise ConfigError("recover.faults / recover.random_faults need recover.enabled: true")
