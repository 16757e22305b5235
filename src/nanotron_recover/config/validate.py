"""Cross-field checks: each raises one line that says what is wrong and what to change.

Every check here reads only the config, so every rank that loads the same file reaches the same
verdict before anything is started. A value is refused when training cannot run with it (or a
fault could never fire), and the message names the key and the range it accepts.

A Nanotron field this engine accepts either takes effect; or changes no math and runs the plain
way, with a ``note:`` line saying so (:data:`NOTED_FIELDS`, :func:`config_notes`); or, where only
one behaviour is implemented and another value would change the result, accepts only that value
(the Nanotron default): any other value is refused with the field, the value given, the value that
runs and why (:data:`MODEL_FIXED_FIELDS`, :data:`FIXED_FIELDS`), never silently ignored.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ..failures import InjectedKind, Phase
from .loader import ConfigError
from .recover import FaultSpec
from .schema import Config, HFDatasetArgs, NanosetDatasetsArgs


def validate_config(cfg: Config, check_paths: bool = True) -> None:
    """Raise ConfigError for a config that cannot train; ``check_paths`` also checks dataset folders."""
    p, m, t = cfg.parallelism, cfg.model.model_config, cfg.tokens
    # A model this engine cannot build makes every other verdict moot: say so first.
    _check_fixed(MODEL_FIXED_FIELDS, cfg)
    interleaved = getattr(m, "interleaved_rotary", None)
    if interleaved is not None and interleaved != m.rope_interleaved:
        raise ConfigError(
            f"model.model_config.interleaved_rotary={_yaml(interleaved)} disagrees with "
            f"rope_interleaved={_yaml(m.rope_interleaved)}: interleaved_rotary is an older spelling of "
            "rope_interleaved; remove it or set both the same"
        )
    for name in ("dp", "tp", "pp", "dp_shard"):
        if getattr(p, name) < 1:
            raise ConfigError(f"parallelism.{name} must be >= 1, got {getattr(p, name)}")
    if p.dp_shard > 1 and (p.tp > 1 or p.pp > 1):
        raise ConfigError(
            f"parallelism.dp_shard={p.dp_shard} (HSDP) needs tp=1 and pp=1, got tp={p.tp} pp={p.pp}: "
            "shard a replica with FSDP2 or split it with tensor/pipeline parallelism, not both"
        )
    if p.expert_parallel_size != 1:
        _refuse("parallelism.expert_parallel_size", p.expert_parallel_size, "1", "LLaMA has no experts")
    _validate_model_sizes(cfg)
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
    if m.rope_scaling is not None:
        _refuse("model.model_config.rope_scaling", m.rope_scaling, "null", "RoPE scaling is not implemented")
    if m.pretraining_tp != 1:
        _refuse(
            "model.model_config.pretraining_tp",
            m.pretraining_tp,
            "1",
            "the sliced linears that emulate pre-training tensor parallelism are not implemented",
        )
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
    _validate_optimizer(cfg)
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
    _validate_recover(cfg, check_paths)
    if cfg.checkpoints.checkpoint_interval < 0:
        raise ConfigError("checkpoints.checkpoint_interval must be >= 0 (0 disables periodic checkpoints)")
    keep = cfg.checkpoints.keep_last
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 2):
        raise ConfigError(
            f"checkpoints.keep_last must be null (keep every checkpoint) or an integer >= 2, got {keep!r}: "
            "the previous checkpoint is kept while a new one is published"
        )
    if not cfg.data_stages:
        raise ConfigError("data_stages must list at least one stage")
    starts = [s.start_training_step for s in cfg.data_stages]
    if 1 not in starts:
        raise ConfigError("data_stages: one stage must have start_training_step: 1")
    if len(set(starts)) != len(starts):
        raise ConfigError(f"data_stages: two stages share a start_training_step ({sorted(starts)})")
    for i, stage in enumerate(cfg.data_stages):
        # Micro-batches are drawn from numpy SeedSequences, which take no negative seed.
        if stage.data.seed is not None and stage.data.seed < 0:
            raise ConfigError(f"data_stages[{i}].data.seed must be >= 0 or null, got {stage.data.seed}")
        if stage.data.seed is None and cfg.general.seed < 0:
            raise ConfigError(
                f"general.seed must be >= 0 (data_stages[{i}] draws its data with it), got {cfg.general.seed}"
            )
        where = f"data_stages[{i}].data.dataset"
        ds = stage.data.dataset
        if isinstance(ds, HFDatasetArgs) and check_paths:
            # A dry run plans the job before the data is tokenized; training needs the tokens.
            raise ConfigError(
                f"{where}: hf_dataset_or_datasets is tokenized on the fly by Nanotron; here run "
                "`nanotron-recover preprocess` once and set dataset_folder to its output"
            )
        if isinstance(ds, NanosetDatasetsArgs):
            _validate_nanoset(ds, where, check_paths)
        # Micro-batches are read from the Nanoset files by the training process itself. Nanotron's
        # default of one loader worker is accepted as the same thing (it changes only speed).
        workers = stage.data.num_loading_workers
        if workers not in (0, 1):
            _refuse(
                f"data_stages[{i}].data.num_loading_workers",
                workers,
                "0 or 1",
                "micro-batches are read in the training process, without loader workers",
            )
    if cfg.logging.iteration_step_info_interval < 1:
        raise ConfigError(
            "logging.iteration_step_info_interval must be >= 1 (print every that many steps), "
            f"got {cfg.logging.iteration_step_info_interval}"
        )
    port = cfg.logging.prometheus_port
    if port is not None and not 0 <= port <= 65535:
        raise ConfigError(
            f"logging.prometheus_port must be a TCP port 1-65535, 0 (any free port) or null (off), got {port}"
        )
    _validate_profiler(cfg)
    _check_fixed(FIXED_FIELDS, cfg)


def _check_fixed(table: list[FixedField], cfg: Config) -> None:
    """Refuse the first field of ``table`` whose value is not one of those that run."""
    for key, get, allowed, why in table:
        value = get(cfg)
        if not any(value == a and type(value) is type(a) for a in allowed):
            _refuse(key, value, " or ".join(map(_yaml, allowed)), why)


def _validate_profiler(cfg: Config) -> None:
    """The profiler's schedule: its ranges, and (like Nanotron) a window that fits in the run."""
    prof = cfg.profiler
    if prof is None:
        return
    for name in ("wait", "warmup", "skip_first", "repeat"):
        if getattr(prof, name) < 0:
            raise ConfigError(f"profiler.{name} must be >= 0, got {getattr(prof, name)}")
    if prof.active < 1:
        raise ConfigError(f"profiler.active must be >= 1 (steps recorded per cycle), got {prof.active}")
    if prof.profiler_export_path is not None:
        window = prof.skip_first + prof.repeat * (prof.wait + prof.warmup + prof.active)
        steps = cfg.tokens.train_steps
        if window > steps:
            raise ConfigError(
                f"profiler: skip_first + repeat * (wait + warmup + active) = {window} steps is longer "
                f"than the run (tokens.train_steps={steps}): shorten the profiling window or train longer"
            )


# Fields of Nanotron's NanosetDatasetsArgs read only by its tokenized-bytes loader, with the one
# value implemented here: (field, accepted values, why).
_NANOSET_FIXED: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("skip_in_stream", (False, None), "samples are addressed by micro-batch id, there is no stream to skip"),
    (
        "pad_samples_to_global_batch_size",
        (False, None),
        "every step reads exactly B micro-batches, so no padding is needed",
    ),
    ("dataset_max_tokens", (None,), "every folder is read whole (cut it when tokenizing)"),
    ("shuffle_files", (False, None), "files are read in name order; samples are shuffled by the seed"),
    ("use_old_brrr_dataloader", (False, None), "there is one data loader"),
)


def _validate_nanoset(ds: NanosetDatasetsArgs, where: str, check_paths: bool) -> None:
    """A Nanoset stage: its folders, weights and read paths agree, and (``check_paths``) exist."""
    folders = ds.folders()
    if not folders:
        raise ConfigError(f"{where}.dataset_folder: name at least one folder")
    if len(set(folders)) != len(folders):
        raise ConfigError(f"{where}.dataset_folder lists a folder twice: give it a larger weight instead")
    if isinstance(ds.dataset_folder, dict) and ds.dataset_weights is not None:
        raise ConfigError(
            f"{where}: weights are given twice (a folder -> weight mapping and dataset_weights): keep one"
        )
    if ds.dataset_weights is not None and len(ds.dataset_weights) != len(folders):
        raise ConfigError(
            f"{where}.dataset_weights has {len(ds.dataset_weights)} weights for {len(folders)} folders"
        )
    weights = ds.weights()
    if weights is not None and not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError(f"{where}: dataset weights must be finite and > 0, got {weights}")
    if ds.dataset_read_path is not None:
        reads = [ds.dataset_read_path] if isinstance(ds.dataset_read_path, str) else ds.dataset_read_path
        if len(reads) != len(folders):
            raise ConfigError(
                f"{where}.dataset_read_path has {len(reads)} paths for {len(folders)} folders: one per folder"
            )
    if ds.token_size_in_bytes not in (None, 2, 4):
        raise ConfigError(
            f"{where}.token_size_in_bytes must be 2 or 4 (or null), got {ds.token_size_in_bytes}"
        )
    if ds.vocab_size is not None and ds.vocab_size < 1:
        raise ConfigError(f"{where}.vocab_size must be >= 1 (or null), got {ds.vocab_size}")
    for name, allowed, why in _NANOSET_FIXED:
        value = getattr(ds, name)
        if not any(value == a and type(value) is type(a) for a in allowed):
            _refuse(f"{where}.{name}", value, " or ".join(map(_yaml, allowed)), why)
    if check_paths:
        for folder, read in zip(folders, ds.read_paths(), strict=True):
            if not Path(read).is_dir():
                raise ConfigError(
                    f"{where}.dataset_folder {folder!r} does not exist: run "
                    "`nanotron-recover preprocess --out` into it or fix the path"
                )


def check_world_size(cfg: Config, world_size: int) -> None:
    """The launched world must be exactly tp*pp*dp ranks."""
    p = cfg.parallelism
    if world_size != cfg.world_size:
        grid = f"dp_shard*dp = {p.dp_shard}*{p.dp}" if p.dp_shard > 1 else f"tp*pp*dp = {p.tp}*{p.pp}*{p.dp}"
        raise ConfigError(
            f"world size {world_size} != {grid} = {cfg.world_size}: "
            f"launch {cfg.world_size} ranks or change parallelism"
        )


def launched_replicas(cfg: Config, world_size: int, relaunched: bool) -> int:
    """How many replicas a launched world of ``world_size`` ranks holds: all ``dp`` at launch
    (:func:`check_world_size`); a job relaunched on fewer hosts than it had may hold fewer, whole
    replicas, down to ``recover.min_replicas`` (the others count as lost, and the same ``B`` is
    shared by those that run)."""
    if not relaunched or world_size == cfg.world_size:
        check_world_size(cfg, world_size)
        return cfg.parallelism.dp
    p = cfg.parallelism
    size = p.replica_size
    replicas, extra = divmod(world_size, size)
    least = max(1, cfg.recover.min_replicas)
    if extra or not least <= replicas <= p.dp:
        raise ConfigError(
            f"relaunched on {world_size} ranks: a relaunch runs whole replicas of {size} ranks, "
            f"between recover.min_replicas={least} and dp={p.dp} of them"
        )
    return replicas


FixedField = tuple[str, Callable[[Config], Any], tuple[Any, ...], str]


def _qwen2(name: str, default: Any) -> Callable[[Config], Any]:
    """Getter of a Qwen2Config-only field: the LLaMA value when the model_config is a LlamaConfig."""
    return lambda c: getattr(c.model.model_config, name, default)


# Fields that decide which model is built (checked before anything else): (key, getter, accepted
# values, why no other value can take effect). Each accepted value is the dense-LLaMA one, which is
# the Nanotron default; a Qwen2Config holding them is a LLaMA.
MODEL_FIXED_FIELDS: list[FixedField] = [
    (
        "model.model_config.is_qwen2_config",
        _qwen2("is_qwen2_config", True),
        (True,),
        "a Qwen2Config section is one that says is_qwen2_config: true (without it, it is a LlamaConfig)",
    ),
    (
        "model.model_config.moe_config",
        _qwen2("moe_config", None),
        (None,),
        "mixture-of-experts layers are not implemented (this engine trains dense LLaMA models)",
    ),
    (
        "model.model_config.attention_bias",
        lambda c: c.model.model_config.attention_bias,
        (False,),
        "the attention projections have no bias in LLaMA",
    ),
    (
        "model.model_config.sliding_window_size",
        _qwen2("sliding_window_size", None),
        (None,),
        "attention is full causal attention (no sliding window)",
    ),
    (
        "model.model_config.flex_attention_mask",
        _qwen2("flex_attention_mask", None),
        (None,),
        "attention is full causal attention over the whole sequence (no document or window mask)",
    ),
    (
        "model.model_config._use_doc_masking",
        _qwen2("_use_doc_masking", False),
        (False,),
        "documents packed into a sample are not masked from each other (positions run over the whole "
        "sequence and every token is a label)",
    ),
    (
        "model.model_config.no_rope_layer",
        _qwen2("no_rope_layer", None),
        (None,),
        "every layer applies rotary embeddings",
    ),
    (
        "model.model_config.rope_seq_len_interpolation_factor",
        _qwen2("rope_seq_len_interpolation_factor", None),
        (None,),
        "RoPE position interpolation is not implemented",
    ),
    (
        "model.model_config.z_loss_enabled",
        lambda c: c.model.model_config.z_loss_enabled,
        (False,),
        "the loss is the plain cross-entropy (no z-loss term)",
    ),
    (
        "model.init_method.scaling_method",
        lambda c: c.model.init_method.scaling_method,
        ("NUM_LAYERS", "NONE"),
        "Nanotron implements only these two (LAYER_INDEX raises there too)",
    ),
]


# Nanotron fields with one implemented behaviour: (key, getter, accepted values, why no other value
# can take effect). Every accepted value is the Nanotron default.
FIXED_FIELDS: list[FixedField] = [
    (
        "general.step",
        lambda c: c.general.step,
        (None,),
        "a run starts at step 0 or at the step of the checkpoint it resumes",
    ),
    (
        "general.consumed_train_samples",
        lambda c: c.general.consumed_train_samples,
        (None,),
        "the samples consumed follow from the step (the resumed checkpoint's)",
    ),
    (
        "model.model_config.is_llama_config",
        lambda c: c.model.model_config.is_llama_config,
        (True,),
        "this engine trains LLaMA models only",
    ),
    (
        "model.model_config.use_cache",
        lambda c: c.model.model_config.use_cache,
        (True,),
        "training uses no KV cache and the exported Hugging Face config keeps its default",
    ),
    (
        "tokens.val_check_interval",
        lambda c: c.tokens.val_check_interval,
        (-1,),
        "no validation runs during training (score a checkpoint with `nanotron-recover eval`)",
    ),
    (
        "tokens.limit_val_batches",
        lambda c: c.tokens.limit_val_batches,
        (0,),
        "no validation runs during training",
    ),
    (
        "tokens.limit_test_batches",
        lambda c: c.tokens.limit_test_batches,
        (0,),
        "no test runs during training",
    ),
    (
        "optimizer.accumulate_grad_in_fp32",
        lambda c: c.optimizer.accumulate_grad_in_fp32,
        (True,),
        "gradients are always accumulated in an fp32 buffer (the recovery snapshots it)",
    ),
    (
        "tokenizer.tokenizer_revision",
        lambda c: c.tokenizer.tokenizer_revision,
        (None,),
        "corpora are tokenized by `nanotron-recover preprocess`, which loads the default revision",
    ),
    (
        "tokenizer.tokenizer_max_length",
        lambda c: c.tokenizer.tokenizer_max_length,
        (None,),
        "documents are packed into samples of tokens.sequence_length tokens",
    ),
    (
        "kill_switch_path",
        lambda c: c.kill_switch_path,
        (None,),
        "training does not watch for a stop file",
    ),
    (
        "parallelism.context_parallel_size",
        lambda c: c.parallelism.context_parallel_size,
        (1,),
        "context parallelism is not implemented (every rank of a replica holds whole sequences)",
    ),
    (
        "optimizer.weight_decay_exclude_named_params",
        lambda c: c.optimizer.weight_decay_exclude_named_params,
        (None, []),
        "every parameter is decayed by optimizer.weight_decay",
    ),
    (
        "metrics_logging.log_level",
        lambda c: c.metrics_logging.log_level if c.metrics_logging is not None else 0,
        (0,),
        "detailed per-layer metrics are not logged (the basic ones are in <run_dir>/metrics.jsonl)",
    ),
    (
        "lighteval",
        lambda c: c.lighteval,
        (None,),
        "no LightEval evaluation runs during training (score a checkpoint with `nanotron-recover eval`)",
    ),
    (
        "s3_upload",
        lambda c: c.s3_upload,
        (None,),
        "checkpoints are not uploaded to S3 (copy checkpoints.checkpoints_path with your own tool)",
    ),
]

# A value no field takes: stands for a noted field that needs no note.
_ABSENT = "<absent>"

NotedField = tuple[str, Callable[[Config], Any], tuple[Any, ...], str]

# Nanotron fields accepted at any value although only one behaviour is implemented, because they
# change no math (how the work is executed or reported, not what is computed): (key, getter, values
# that need no note, what runs instead). A value outside the third item gets the line
# "note: <key> <value> <what runs>" in the dry-run plan and at training start (rank 0).
NOTED_FIELDS: list[NotedField] = [
    (
        "parallelism.tp_mode",
        # Sequence parallelism over one tensor-parallel rank is plain tensor parallelism.
        lambda c: c.parallelism.tp_mode if c.parallelism.tp > 1 else "ALL_REDUCE",
        ("ALL_REDUCE",),
        "runs as ALL_REDUCE here: same math, no sequence-parallel activation saving",
    ),
    (
        "parallelism.tp_linear_async_communication",
        lambda c: c.parallelism.tp_linear_async_communication if c.parallelism.tp > 1 else False,
        (False,),
        "runs synchronously here: same math, tensor-parallel communication does not overlap compute",
    ),
    (
        "parallelism.tp_recompute_allgather",
        # Nanotron reads it only for sequence parallelism (REDUCE_SCATTER over several tensor ranks).
        lambda c: (
            c.parallelism.tp_recompute_allgather
            if c.parallelism.tp > 1 and c.parallelism.tp_mode == "REDUCE_SCATTER"
            else True
        ),
        (True,),
        "changes nothing here: tp_mode runs as ALL_REDUCE, whose tensor-parallel layers all-gather no "
        "input, so there is none to keep for the backward pass or to gather again",
    ),
    (
        "parallelism.recompute_layer",
        lambda c: c.parallelism.recompute_layer,
        (False,),
        "runs without recomputation here: same math, every layer's activations are kept (the memory "
        "estimate counts them)",
    ),
    (
        "parallelism.moe_layer_recompute",
        lambda c: c.parallelism.moe_layer_recompute,
        (False,),
        "changes nothing here: a dense LLaMA has no MoE layers",
    ),
    (
        "model.ddp_bucket_cap_mb",
        lambda c: c.model.ddp_bucket_cap_mb,
        (25,),
        "changes nothing here: same math, plain mode all-reduces the gradients as one flat buffer and "
        "recover mode's buckets are recover.bucket_size_mb",
    ),
    (
        "model.model_config._attn_implementation",
        lambda c: c.model.model_config._attn_implementation,
        (None, "sdpa"),
        "runs as torch scaled_dot_product_attention here: the same causal attention",
    ),
    (
        "general.ignore_sanity_checks",
        lambda c: c.general.ignore_sanity_checks,
        (True,),
        "runs no extra checks here: Nanotron's debug assertions that tensors agree across ranks are "
        "not implemented (they change no math); the replicas' final parameter digests are written to "
        "<run_dir>/parameters/",
    ),
    (
        "checkpoints.checkpoints_path_is_shared_file_system",
        lambda c: c.checkpoints.checkpoints_path_is_shared_file_system,
        (True,),
        "changes nothing (Nanotron main ignores it too): every rank writes into one checkpoint "
        "folder, so a job across nodes needs checkpoints_path on a file system they all see",
    ),
    (
        "checkpoints.load_lr_scheduler",
        lambda c: c.checkpoints.load_lr_scheduler,
        (True,),
        "restarts the learning-rate schedule (warm-up again) at the step of the checkpoint named in "
        "checkpoints.resume_checkpoint_path, as Nanotron's fresh scheduler does; resuming this run's "
        "own checkpoints continues that schedule",
    ),
    (
        "logging.log_level",
        lambda c: c.logging.log_level,
        ("info",),
        "changes nothing here: console output has no levels",
    ),
    (
        "logging.log_level_replica",
        lambda c: c.logging.log_level_replica,
        ("info",),
        "changes nothing here: console output has no levels",
    ),
    (
        "profiler.profiler_export_path",
        # Noted only when a profiler section is given with a null path.
        lambda c: None if c.profiler is not None and c.profiler.profiler_export_path is None else _ABSENT,
        (_ABSENT,),
        "writes no trace (as in Nanotron), so no profiler runs",
    ),
]


def config_notes(cfg: Config) -> list[str]:
    """The ``note:`` lines of a validated config: one per noted field at a value that runs
    differently here (:data:`NOTED_FIELDS`), in table order."""
    notes = []
    for key, get, neutral, text in NOTED_FIELDS:
        value = get(cfg)
        if not any(value == n and type(value) is type(n) for n in neutral):
            notes.append(f"note: {key} {_yaml(value)} {text}")
    return notes


def _yaml(value: Any) -> str:
    """``value`` as it is written in the config (``true``, ``null``, ``{type: linear}``)."""
    if isinstance(value, Path):
        return str(value)
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False).strip()
    return text.removesuffix("...").strip()


def _refuse(key: str, value: Any, supported: str, why: str) -> None:
    """Raise the one-line refusal of a value this engine does not implement."""
    given = _yaml(value)
    if len(given) > 80:  # a whole section (lighteval, s3_upload): its start says enough
        given = given[:77] + "..."
    raise ConfigError(f"{key}={given} is not supported: {why}; set {supported}")


def _validate_model_sizes(cfg: Config) -> None:
    """Sizes the model is built from (before any check divides by them)."""
    m, where = cfg.model.model_config, "model.model_config"
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_hidden_layers",
        "vocab_size",
        "max_position_embeddings",
    ):
        if getattr(m, name) < 1:
            raise ConfigError(f"{where}.{name} must be >= 1, got {getattr(m, name)}")
    if m.num_key_value_heads is not None and m.num_key_value_heads < 1:
        raise ConfigError(
            f"{where}.num_key_value_heads must be >= 1, or null for one per attention head, "
            f"got {m.num_key_value_heads}"
        )
    if cfg.model.make_vocab_size_divisible_by < 1:
        raise ConfigError(
            f"model.make_vocab_size_divisible_by must be >= 1, got {cfg.model.make_vocab_size_divisible_by}"
        )
    for name in ("rms_norm_eps", "rope_theta"):
        if not _positive(getattr(m, name)):
            raise ConfigError(f"{where}.{name} must be > 0, got {getattr(m, name)}")
    if m.hidden_size % m.num_attention_heads == 0 and m.head_dim % 2:
        raise ConfigError(
            f"{where}: head dimension hidden_size/num_attention_heads = {m.head_dim} must be even "
            "(rotary embeddings rotate pairs of dimensions)"
        )


def _positive(value: float) -> bool:
    """``value > 0`` and finite; NaN compares false with everything, so it fails too."""
    return value > 0 and math.isfinite(value)


def _validate_optimizer(cfg: Config) -> None:
    """Ranges of the optimizer and its learning-rate schedule (values the update cannot use)."""
    opt, sched, steps = cfg.optimizer, cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps
    where = "optimizer.learning_rate_scheduler"
    if not _positive(sched.learning_rate):
        raise ConfigError(f"{where}.learning_rate must be > 0, got {sched.learning_rate}")
    if not 0 <= sched.min_decay_lr <= sched.learning_rate:
        raise ConfigError(
            f"{where}.min_decay_lr must be between 0 and learning_rate={sched.learning_rate}, "
            f"got {sched.min_decay_lr}"
        )
    if sched.lr_warmup_steps > steps:
        raise ConfigError(
            f"{where}.lr_warmup_steps={sched.lr_warmup_steps} is longer than the run "
            f"(tokens.train_steps={steps}): choose lr_warmup_steps between 0 and {steps}"
        )
    if sched.lr_decay_starting_step is not None and sched.lr_decay_starting_step < 0:
        raise ConfigError(
            f"{where}.lr_decay_starting_step must be >= 0 or null, got {sched.lr_decay_starting_step}"
        )
    if opt.clip_grad is not None and not _positive(opt.clip_grad):
        raise ConfigError(f"optimizer.clip_grad must be > 0, or null for no clipping, got {opt.clip_grad}")
    if not (opt.weight_decay >= 0 and math.isfinite(opt.weight_decay)):
        raise ConfigError(f"optimizer.weight_decay must be >= 0, got {opt.weight_decay}")
    factory = opt.optimizer_factory
    for name in ("adam_beta1", "adam_beta2"):
        beta = getattr(factory, name)
        if not 0 <= beta < 1:
            raise ConfigError(f"optimizer.optimizer_factory.{name} must be in [0, 1), got {beta}")
    if not _positive(factory.adam_eps):
        raise ConfigError(f"optimizer.optimizer_factory.adam_eps must be > 0, got {factory.adam_eps}")


def _validate_recover(cfg: Config, check_paths: bool = True) -> None:
    """The ``recover.*`` checks that need other sections (each ``recover`` dataclass checks its own
    fields when it is built, in ``recover.py``)."""
    r, dp = cfg.recover, cfg.parallelism.dp
    if not 1 <= r.min_replicas <= dp:
        raise ConfigError(f"recover.min_replicas={r.min_replicas} must be between 1 and parallelism.dp={dp}")
    if r.exact and cfg.parallelism.dp_shard > 1:
        raise ConfigError(
            "recover.exact: true is implemented for the 3D engine (parallelism.dp_shard: 1); HSDP "
            "accumulates FSDP's reduce-scattered floats, whose sum is not exact"
        )
    for i, f in enumerate(r.faults):
        _validate_fault(cfg, f, f"recover.faults[{i}]")
    rf = r.random_faults
    if rf is not None and not 1 <= rf.until_replicas <= dp:
        raise ConfigError(f"recover.random_faults.until_replicas must be between 1 and parallelism.dp={dp}")
    if r.checkpoint_restart and cfg.checkpoints.checkpoint_interval < 1:
        raise ConfigError("recover.mode: checkpoint_restart needs checkpoints.checkpoint_interval >= 1")
    j, where = r.rejoin, "recover.rejoin"
    if check_paths and j.hostfile is not None:
        path = Path(j.hostfile)
        if not path.exists():
            raise ConfigError(f"{where}.hostfile {j.hostfile!r} does not exist: write it or fix the path")
        if not path.is_file():
            raise ConfigError(f"{where}.hostfile {j.hostfile!r} is not a file")


def _validate_fault(cfg: Config, f: FaultSpec, where: str) -> None:
    """One ``recover.faults`` entry against the rest of the config: its step, its victim, the
    micro-batch id of kind error, and phase save's checkpoints (the entry checks which fields its
    kind uses itself, :class:`~.recover.FaultSpec`)."""
    dp, world, steps = cfg.parallelism.dp, cfg.world_size, cfg.tokens.train_steps
    if f.step == 0 and f.phase != Phase.START:
        raise ConfigError(
            f"{where}: step 0 is only for phase start (the first launch, while its first world is "
            f"built); steps run 1..tokens.train_steps={steps}"
        )
    if not 0 <= f.step <= steps:
        raise ConfigError(f"{where}: step {f.step} is outside 1..tokens.train_steps={steps}")
    if f.kind == InjectedKind.ERROR:
        b = cfg.microbatches_per_step
        first, end = (f.step - 1) * b, f.step * b
        if f.id is None:
            raise ConfigError(
                f"{where}: kind error needs id, the global micro-batch id to fail: "
                f"step {f.step} computes ids {first}..{end - 1}"
            )
        if not first <= f.id < end:
            raise ConfigError(
                f"{where}: id {f.id} is not computed in step {f.step}: choose id in [{first}, {end}) "
                f"(parallelism.dp * tokens.batch_accumulation_per_replica = {b} micro-batches per step)"
            )
    else:
        if f.replica is not None and not 0 <= f.replica < dp:
            raise ConfigError(f"{where}: replica {f.replica} does not exist (parallelism.dp={dp})")
        if f.rank is not None and not 0 <= f.rank < world:
            raise ConfigError(f"{where}: rank {f.rank} does not exist (world size {world})")
    if f.phase == Phase.SAVE:
        interval = cfg.checkpoints.checkpoint_interval
        if interval < 1:
            raise ConfigError(
                f"{where}: phase save needs periodic checkpoints: set checkpoints.checkpoint_interval >= 1"
            )
        if f.step % interval:
            raise ConfigError(
                f"{where}: phase save at step {f.step} would never fire: checkpoints are saved every "
                f"checkpoints.checkpoint_interval={interval} steps, so choose a step that is a multiple "
                f"of {interval}"
            )
