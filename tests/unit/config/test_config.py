"""nanotron_recover.config: the schema, the strict loader, ``--set`` overrides and validation."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from nanotron_recover.config import (
    Config,
    ConfigError,
    FaultSpec,
    NanosetDatasetsArgs,
    RecoverArgs,
    RejoinArgs,
    SnapshotArgs,
    apply_override,
    check_world_size,
    config_from_dict,
    dump_config,
    from_dict,
    launched_replicas,
    load_config,
)
from nanotron_recover.config.loader import load_yaml
from nanotron_recover.config.validate import FIXED_FIELDS, MODEL_FIXED_FIELDS, NOTED_FIELDS, config_notes
from nanotron_recover.errors import InputError
from tests.helpers.nanotron_example import NANOTRON

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "configs" / "tiny_cpu.yaml"


def tiny(*overrides: str, check_paths: bool = True) -> Config:
    return load_config(TINY, list(overrides), check_paths=check_paths)


def tiny_error(*overrides: str, check_paths: bool = True) -> str:
    with pytest.raises(ConfigError) as info:
        tiny(*overrides, check_paths=check_paths)
    return str(info.value)


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# -- a config written like Nanotron's examples ---------------------------------------------------
def test_nanotron_example_parses_into_the_schema_unchanged():
    cfg = from_dict(Config, load_yaml(NANOTRON))

    assert (cfg.parallelism.dp, cfg.parallelism.tp, cfg.parallelism.pp) == (2, 2, 2)
    assert cfg.parallelism.tp_mode == "REDUCE_SCATTER"
    assert cfg.parallelism.tp_linear_async_communication is True
    assert cfg.world_size == 8
    m = cfg.model.model_config
    assert (m.hidden_size, m.intermediate_size, m.num_hidden_layers, m.vocab_size) == (16, 64, 2, 256)
    assert (m.num_attention_heads, m.kv_heads, m.head_dim) == (4, 4, 4)
    assert m.tie_word_embeddings is True
    assert m.rms_norm_eps == 1e-5
    assert cfg.model.dtype == "bfloat16"
    assert cfg.model.init_method.std == 0.02 and cfg.model.init_method.path is None
    sched = cfg.optimizer.learning_rate_scheduler
    assert (sched.learning_rate, sched.lr_warmup_steps, sched.lr_decay_steps) == (1e-3, 3, 12)
    assert (sched.lr_decay_style, sched.min_decay_lr) == ("cosine", 1e-4)
    assert cfg.optimizer.optimizer_factory.torch_adam_is_fused is True
    assert cfg.optimizer.clip_grad == 1.0 and cfg.optimizer.weight_decay == 0.1
    assert [s.name for s in cfg.data_stages] == ["Main phase", "Cool-down phase"]
    assert [s.start_training_step for s in cfg.data_stages] == [1, 12]
    assert [s.data.dataset for s in cfg.data_stages] == [None, None]
    assert cfg.checkpoints.checkpoints_path == Path("checkpoints/tiny")
    assert cfg.checkpoints.checkpoint_interval == 5
    assert cfg.checkpoints.checkpoints_path_is_shared_file_system is False
    assert (cfg.tokens.sequence_length, cfg.tokens.micro_batch_size, cfg.tokens.train_steps) == (64, 4, 16)
    assert cfg.recover.enabled is False
    assert cfg.lighteval is None and cfg.profiler is None and cfg.s3_upload is None


def test_nanotron_example_validates_with_a_note_per_strategy_run_the_plain_way():
    cfg = load_config(NANOTRON)

    assert cfg.parallelism.tp_mode == "REDUCE_SCATTER"  # accepted as given; runs as ALL_REDUCE
    check_world_size(cfg, 8)
    assert config_notes(cfg) == [
        "note: parallelism.tp_mode REDUCE_SCATTER runs as ALL_REDUCE here: same math, no "
        "sequence-parallel activation saving",
        "note: parallelism.tp_linear_async_communication true runs synchronously here: same math, "
        "tensor-parallel communication does not overlap compute",
        "note: checkpoints.checkpoints_path_is_shared_file_system false changes nothing (Nanotron main "
        "ignores it too): every rank writes into one checkpoint folder, so a job across nodes needs "
        "checkpoints_path on a file system they all see",
    ]


def test_sequence_parallelism_over_one_tensor_rank_needs_no_note():
    cfg = load_config(NANOTRON, ["parallelism.tp=1"])
    assert not any("parallelism.tp_" in note for note in config_notes(cfg))


# -- strict loading: unknown keys ------------------------------------------------------------------
def test_unknown_top_level_key_is_named_with_its_section():
    data = load_yaml(TINY)
    data["paralelism"] = {"tp": 2}
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    message = str(info.value)
    assert message.startswith("unknown key 'paralelism' in section 'top level' (allowed: ")
    assert "parallelism" in message.split("allowed: ")[1]


def test_unknown_nested_key_names_the_full_section_path():
    data = load_yaml(TINY)
    data["model"]["model_config"]["hiden_size"] = 64
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    message = str(info.value)
    assert message.startswith("unknown key 'hiden_size' in section 'model.model_config'")
    assert "hidden_size" in message


def test_unknown_key_inside_a_list_item_names_the_item_index():
    data = load_yaml(NANOTRON)
    data["data_stages"][1]["data"]["seeed"] = 3
    with pytest.raises(ConfigError, match=r"^unknown key 'seeed' in section 'data_stages\[1\]\.data'"):
        from_dict(Config, data)


def test_unknown_keys_of_mixed_types_are_reported_not_crashed_on():
    # YAML keys need not be strings (``1:``, ``on:``); sorting them must not raise TypeError.
    data = load_yaml(TINY)
    data["general"][1] = "x"
    data["general"]["projcet"] = "y"
    with pytest.raises(ConfigError, match=r"^unknown key 1 in section 'general'"):
        config_from_dict(data)


def test_typo_in_a_dataset_section_shows_the_offending_mapping():
    data = load_yaml(TINY)
    data["data_stages"][0]["data"]["dataset"] = {"dataset_foldr": "/data/corpus"}
    with pytest.raises(ConfigError) as info:
        config_from_dict(data)
    assert str(info.value).startswith("data_stages[0].data.dataset: ")
    assert "'dataset_foldr'" in str(info.value)


def test_missing_required_key_is_named():
    with pytest.raises(ConfigError) as info:
        from_dict(NanosetDatasetsArgs, {"validate_tokenizer": True}, "data_stages[0].data.dataset")
    assert str(info.value) == "missing required key 'dataset_folder' in section 'data_stages[0].data.dataset'"


# -- strict loading: types -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("override", "message"),
    [
        ('tokens.micro_batch_size="two"', "tokens.micro_batch_size: expected an integer, got 'two'"),
        ("tokens.train_steps=true", "tokens.train_steps: expected an integer, got True"),
        ("tokens.sequence_length=64.0", "tokens.sequence_length: expected an integer, got 64.0"),
        ("optimizer.weight_decay=false", "optimizer.weight_decay: expected a number, got False"),
        ("optimizer.clip_grad=big", "optimizer.clip_grad: expected a number, got 'big'"),
        (
            "parallelism.recompute_layer=maybe",
            "parallelism.recompute_layer: expected true or false, got 'maybe'",
        ),
        ("general.project=7", "general.project: expected a string, got 7"),
        ("checkpoints.checkpoints_path=3", "checkpoints.checkpoints_path: expected a path, got 3"),
        ("tokens.sequence_length=null", "tokens.sequence_length: expected an integer, got None"),
        ("data_stages={name: x}", "data_stages: expected a list, got {'name': 'x'}"),
        ("parallelism=3", "parallelism: expected a mapping (section ParallelismArgs), got 3"),
        ("profiler=3", "profiler: expected a mapping (section ProfilerArgs), got 3"),
    ],
)
def test_wrong_type_names_the_field_and_the_value(override: str, message: str):
    assert tiny_error(override) == message


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("parallelism.pp_engine=gpipe", "parallelism.pp_engine: must be one of 'afab', '1f1b', got 'gpipe'"),
        (
            "parallelism.tp_mode=all_reduce",
            "parallelism.tp_mode: must be one of 'ALL_REDUCE', 'REDUCE_SCATTER', got 'all_reduce'",
        ),
        ("model.dtype=fp8", "model.dtype: must be one of 'float32', 'bfloat16', 'float16', got 'fp8'"),
        (
            "optimizer.learning_rate_scheduler.lr_decay_style=exponential",
            "optimizer.learning_rate_scheduler.lr_decay_style: must be one of 'linear', 'cosine', "
            "'1-sqrt', 'constant', got 'exponential'",
        ),
    ],
)
def test_literal_choice_lists_the_allowed_values(override: str, message: str):
    assert tiny_error(override) == message


def test_int_is_accepted_where_a_float_is_expected():
    cfg = tiny("optimizer.learning_rate_scheduler.learning_rate=1")
    assert cfg.optimizer.learning_rate_scheduler.learning_rate == 1.0
    assert isinstance(cfg.optimizer.learning_rate_scheduler.learning_rate, float)


@pytest.mark.parametrize(
    ("text", "value"), [("1e-3", 1e-3), ("3.0e4", 3e4), ("-2.5E-2", -0.025), (".5e1", 5.0)]
)
def test_scientific_notation_is_a_number(text: str, value: float):
    # PyYAML (YAML 1.1) loads these as strings; a float field must still take them. (A field
    # without a range check, so that the negative value is not refused by validation.)
    cfg = tiny(f"model.model_config.initializer_range={text}")
    assert cfg.model.model_config.initializer_range == value


def test_scientific_notation_in_a_yaml_file_is_a_number(tmp_path: Path):
    text = TINY.read_text().replace("learning_rate: 0.003", "learning_rate: 3e-3")
    assert "learning_rate: 3e-3" in text
    cfg = load_config(write(tmp_path, text))
    assert cfg.optimizer.learning_rate_scheduler.learning_rate == 0.003


def test_a_numeric_looking_string_is_still_refused_for_an_int():
    assert tiny_error("tokens.train_steps=1e3") == "tokens.train_steps: expected an integer, got '1e3'"


# -- the YAML file itself --------------------------------------------------------------------------
def test_missing_config_file(tmp_path: Path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value) == f"config file {str(missing)!r} does not exist"


def test_a_directory_is_not_a_config_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path)


def test_invalid_yaml_is_one_line_with_the_position(tmp_path: Path):
    path = write(tmp_path, "general:\n  seed: [1, 2\n  run: x\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"config file {str(path)!r} is not valid YAML: line 3, column ")
    assert "expected ',' or ']'" in message
    assert "\n" not in message


@pytest.mark.parametrize("text", ["- general\n- model\n", "just a string\n", "", "42\n"])
def test_yaml_top_level_must_be_a_mapping(tmp_path: Path, text: str):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {str(path)!r} must contain a mapping of sections"


# -- validation: one test per rule -------------------------------------------------------------
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["parallelism.dp=0"], "parallelism.dp must be >= 1, got 0"),
        (["parallelism.tp=0"], "parallelism.tp must be >= 1, got 0"),
        (["parallelism.pp=-1"], "parallelism.pp must be >= 1, got -1"),
        (
            ["parallelism.expert_parallel_size=2"],
            "parallelism.expert_parallel_size=2 is not supported: LLaMA has no experts; set 1",
        ),
        (
            ["model.model_config.hidden_size=66"],
            "model_config.hidden_size 66 is not divisible by num_attention_heads 4",
        ),
        (
            ["model.model_config.num_key_value_heads=3"],
            "model_config.num_attention_heads 4 is not a multiple of num_key_value_heads 3",
        ),
        (
            ["parallelism.tp=3"],
            "parallelism.tp=3 does not divide model_config.num_attention_heads=4: "
            "choose tp among the divisors of the head count",
        ),
        (
            ["parallelism.tp=4"],
            "parallelism.tp=4 does not divide model_config.num_key_value_heads=2: "
            "each tensor-parallel rank needs whole key/value heads",
        ),
        (
            ["parallelism.tp=2", "model.model_config.intermediate_size=129"],
            "parallelism.tp=2 does not divide model_config.intermediate_size=129",
        ),
        (
            ["parallelism.tp=2", "model.model_config.vocab_size=511"],
            "parallelism.tp=2 does not divide model_config.vocab_size=511: "
            "pad the vocabulary (model.make_vocab_size_divisible_by) or change tp",
        ),
        (
            ["model.make_vocab_size_divisible_by=100"],
            "model_config.vocab_size=512 is not a multiple of model.make_vocab_size_divisible_by=100",
        ),
        (
            ["parallelism.pp=3"],
            "parallelism.pp=3 is greater than model_config.num_hidden_layers=2: "
            "every pipeline stage needs at least one layer",
        ),
        (
            ["model.model_config.rope_scaling={type: linear, factor: 2.0}"],
            "model.model_config.rope_scaling={type: linear, factor: 2.0} is not supported: "
            "RoPE scaling is not implemented; set null",
        ),
        (
            ["model.model_config.pretraining_tp=2"],
            "model.model_config.pretraining_tp=2 is not supported: the sliced linears that emulate "
            "pre-training tensor parallelism are not implemented; set 1",
        ),
        (
            ["tokens.sequence_length=257"],
            "tokens.sequence_length=257 exceeds model_config.max_position_embeddings=256",
        ),
        (["tokens.sequence_length=0"], "tokens.sequence_length must be >= 1, got 0"),
        (["tokens.train_steps=0"], "tokens.train_steps must be >= 1, got 0"),
        (["tokens.micro_batch_size=0"], "tokens.micro_batch_size must be >= 1, got 0"),
        (
            ["tokens.batch_accumulation_per_replica=-2"],
            "tokens.batch_accumulation_per_replica must be >= 1, got -2",
        ),
        (
            ["optimizer.learning_rate_scheduler.lr_warmup_steps=-1"],
            "optimizer.learning_rate_scheduler.lr_warmup_steps must be >= 0, got -1",
        ),
        (
            ["optimizer.learning_rate_scheduler.lr_decay_steps=0"],
            "optimizer.learning_rate_scheduler.lr_decay_steps must be >= 1 or null, got 0: "
            "for a constant rate set lr_decay_style: constant",
        ),
        (
            ["model.init_method.path=/ckpt/step_10"],
            "model.init_method must set exactly one of std (random init) or path (checkpoint)",
        ),
        (
            ["model.init_method.std=null"],
            "model.init_method must set exactly one of std (random init) or path (checkpoint)",
        ),
        (["model.init_method.std=0"], "model.init_method.std must be > 0, got 0.0"),
        (
            ["optimizer.zero_stage=1"],
            "optimizer.zero_stage=1 is not supported: set optimizer.zero_stage: 0",
        ),
        (
            ["optimizer.zero_stage=1", "recover.enabled=true"],
            "optimizer.zero_stage > 0 cannot be used with recover.enabled: a ZeRO shard lost with "
            "its replica could not be recovered; set optimizer.zero_stage: 0",
        ),
        (
            ["checkpoints.checkpoint_interval=-1"],
            "checkpoints.checkpoint_interval must be >= 0 (0 disables periodic checkpoints)",
        ),
        (
            ["checkpoints.keep_last=1"],
            "checkpoints.keep_last must be null (keep every checkpoint) or an integer >= 2, got 1: "
            "the previous checkpoint is kept while a new one is published",
        ),
        (
            ["checkpoints.keep_last=0"],
            "checkpoints.keep_last must be null (keep every checkpoint) or an integer >= 2, got 0: "
            "the previous checkpoint is kept while a new one is published",
        ),
        (
            ["recover.enabled=true", "recover.mode=checkpoint_restart"],
            "recover.mode: checkpoint_restart needs checkpoints.checkpoint_interval >= 1",
        ),
        (
            [
                "recover.enabled=true",
                "recover.mode=checkpoint_restart",
                "checkpoints.checkpoint_interval=2",
                "recover.faults=[{step: 2, replica: 0, phase: gate}]",
            ],
            "recover.faults[0]: phase 'gate' does not exist in checkpoint_restart mode "
            "(choose forward, backward, reduce, optimizer, save)",
        ),
        (["data_stages=[]"], "data_stages must list at least one stage"),
        (
            ["data_stages.0.start_training_step=2"],
            "data_stages: one stage must have start_training_step: 1",
        ),
        (
            ["data_stages=[{name: a, start_training_step: 1}, {name: b, start_training_step: 1}]"],
            "data_stages: two stages share a start_training_step ([1, 1])",
        ),
    ],
)
def test_validation_rule_message(overrides: list[str], message: str):
    assert tiny_error(*overrides) == message


RECOVER_ON = "recover.enabled=true"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["recover.bucket_size_mb=0"], "recover.bucket_size_mb must be > 0, got 0.0"),
        (["recover.min_replicas=0"], "recover.min_replicas=0 must be between 1 and parallelism.dp=2"),
        (["recover.min_replicas=3"], "recover.min_replicas=3 must be between 1 and parallelism.dp=2"),
        (["recover.gate_timeout_s=0"], "recover.gate_timeout_s must be > 0"),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, replica: 0, rank: 1}]"],
            "recover.faults[0]: set exactly one of replica or rank",
        ),
        ([RECOVER_ON, "recover.faults=[{step: 2}]"], "recover.faults[0]: set exactly one of replica or rank"),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, replica: 1}, {step: 3}]"],
            "recover.faults[1]: set exactly one of replica or rank",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, replica: 1}, {step: 3, replica: 2}]"],
            "recover.faults[1]: replica 2 does not exist (parallelism.dp=2)",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, rank: 2}]"],
            "recover.faults[0]: rank 2 does not exist (world size 2)",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 21, replica: 0}]"],
            "recover.faults[0]: step 21 is outside 1..tokens.train_steps=20",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 0, replica: 0}]"],
            "recover.faults[0]: step 0 is only for phase start (the first launch, while its first world "
            "is built); steps run 1..tokens.train_steps=20",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: -1, replica: 0, phase: start}]"],
            "recover.faults[0]: step -1 is outside 1..tokens.train_steps=20",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, replica: 0, microbatch: -1}]"],
            "recover.faults[0]: microbatch must be >= 0",
        ),
        (
            [RECOVER_ON, "recover.random_faults={every_steps: 0}"],
            "recover.random_faults.every_steps must be >= 1",
        ),
        (
            [RECOVER_ON, "recover.random_faults={every_steps: 2, until_replicas: 3}"],
            "recover.random_faults.until_replicas must be between 1 and parallelism.dp=2",
        ),
        (
            ["recover.faults=[{step: 2, replica: 0}]"],
            "recover.faults / recover.random_faults need recover.enabled: true",
        ),
        (
            ["recover.random_faults={every_steps: 2}"],
            "recover.faults / recover.random_faults need recover.enabled: true",
        ),
    ],
)
def test_recover_rule_message(overrides: list[str], message: str):
    assert tiny_error(*overrides) == message


EXACT_ON = "recover.exact=true"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [EXACT_ON, "parallelism.dp_shard=2"],
            "recover.exact: true is implemented for the 3D engine (parallelism.dp_shard: 1); HSDP "
            "accumulates FSDP's reduce-scattered floats, whose sum is not exact",
        ),
        (
            [EXACT_ON, RECOVER_ON, "recover.policy=adaptive_world", "recover.spares=off"],
            "recover.exact: true cannot be used with recover.policy: adaptive_world, which changes the "
            "batch when a replica is lost; exact mode equals the fault-free run only with static_world",
        ),
        (
            [EXACT_ON, RECOVER_ON, "recover.mode=checkpoint_restart", "checkpoints.checkpoint_interval=2"],
            "recover.exact: true needs recover.mode: forward (or recover.enabled: false)",
        ),
        (
            [EXACT_ON, "recover.exact_fraction_bits=60"],
            "recover.exact_fraction_bits must be between 8 and 56, got 60",
        ),
    ],
)
def test_exact_mode_refuses_what_it_cannot_make_exact(overrides: list[str], message: str):
    assert tiny_error(*overrides) == message


def test_exact_mode_is_accepted_in_plain_and_forward_runs():
    assert tiny(EXACT_ON).recover.exact
    assert tiny(EXACT_ON, RECOVER_ON).recover.exact_fraction_bits == 40
    assert tiny(EXACT_ON, RECOVER_ON, "recover.rejoin.mode=spawn").recover.exact


LR = "optimizer.learning_rate_scheduler"
SAVE_EVERY_2 = "checkpoints.checkpoint_interval=2"
RESTART = ["recover.enabled=true", "recover.mode=checkpoint_restart", SAVE_EVERY_2]


# The tiny config: lr 0.003, min_decay_lr 0.0003, 20 steps, dp=2 x 4 accumulation = 8 micro-batches
# per step (step s computes ids 8(s-1)..8s-1), world size 2. Each row: overrides, then a piece of
# the one-line message that names the key and the range it accepts.
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{LR}.learning_rate=0"], f"{LR}.learning_rate must be > 0, got 0.0"),
        ([f"{LR}.learning_rate=-1e-3"], f"{LR}.learning_rate must be > 0, got -0.001"),
        ([f"{LR}.learning_rate=.nan"], f"{LR}.learning_rate must be > 0, got nan"),
        (
            [f"{LR}.min_decay_lr=-1e-5"],
            f"{LR}.min_decay_lr must be between 0 and learning_rate=0.003, got -1e-05",
        ),
        (
            [f"{LR}.min_decay_lr=0.01"],
            f"{LR}.min_decay_lr must be between 0 and learning_rate=0.003, got 0.01",
        ),
        (
            [f"{LR}.lr_warmup_steps=21"],
            f"{LR}.lr_warmup_steps=21 is longer than the run (tokens.train_steps=20): "
            "choose lr_warmup_steps between 0 and 20",
        ),
        ([f"{LR}.lr_decay_starting_step=-1"], f"{LR}.lr_decay_starting_step must be >= 0 or null, got -1"),
        (["optimizer.clip_grad=0"], "optimizer.clip_grad must be > 0, or null for no clipping, got 0.0"),
        (["optimizer.clip_grad=-1"], "optimizer.clip_grad must be > 0, or null for no clipping, got -1.0"),
        (["optimizer.weight_decay=-0.1"], "optimizer.weight_decay must be >= 0, got -0.1"),
        (
            ["optimizer.optimizer_factory.adam_beta1=1"],
            "optimizer.optimizer_factory.adam_beta1 must be in [0, 1), got 1.0",
        ),
        (
            ["optimizer.optimizer_factory.adam_beta2=-0.5"],
            "optimizer.optimizer_factory.adam_beta2 must be in [0, 1), got -0.5",
        ),
        (
            ["optimizer.optimizer_factory.adam_eps=0"],
            "optimizer.optimizer_factory.adam_eps must be > 0, got 0.0",
        ),
        (["data_stages.0.data.seed=-1"], "data_stages[0].data.seed must be >= 0 or null, got -1"),
        (
            ["data_stages.0.data.seed=null", "general.seed=-3"],
            "general.seed must be >= 0 (data_stages[0] draws its data with it), got -3",
        ),
        (["recover.heartbeat_period_s=0"], "recover.heartbeat_period_s must be > 0, got 0.0"),
        (
            ["recover.heartbeat_timeout_s=1"],
            "recover.heartbeat_timeout_s=1.0 must be greater than 3 x recover.heartbeat_period_s=1.0",
        ),
        (
            ["recover.heartbeat_period_s=10"],
            "recover.heartbeat_timeout_s=5.0 must be greater than 3 x recover.heartbeat_period_s=10.0",
        ),
        (
            ["recover.watchdog_timeout_s=0"],
            "recover.watchdog_timeout_s must be > 0, or null for no watchdog, got 0.0",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: error}]"],
            "recover.faults[0]: kind error needs id, the global micro-batch id to fail: step 2 computes ids 8..15",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: error, id: 16}]"],
            "recover.faults[0]: id 16 is not computed in step 2: choose id in [8, 16) "
            "(parallelism.dp * tokens.batch_accumulation_per_replica = 8 micro-batches per step)",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: error, id: 7}]"],
            "recover.faults[0]: id 7 is not computed in step 2: choose id in [8, 16)",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: error, id: 9, replica: 0}]"],
            "recover.faults[0]: kind error fires in whichever replica computes micro-batch id; "
            "remove replica and rank",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: error, id: 9, rank: 1}]"],
            "remove replica and rank",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: error, id: 9, phase: reduce}]"],
            "recover.faults[0]: kind error fires while a micro-batch is computed, so phase must be one of "
            "forward, backward, recovery, got 'reduce'",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: error, id: 9, microbatch: 1}]"],
            "recover.faults[0]: microbatch is not used by kind error (id names the micro-batch)",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: freeze}]"],
            "recover.faults[0]: set exactly one of replica or rank",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: kill, replica: 0, rank: 1}]"],
            "recover.faults[0]: set exactly one of replica or rank",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, kind: freeze, replica: 0, id: 9}]"],
            "recover.faults[0]: id is only for kind error; kind freeze picks its victim with replica or rank",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, replica: 0, persistent: true}]"],
            "recover.faults[0]: persistent is only for kind error; remove it from kind kill",
        ),
        (
            [RECOVER_ON, "recover.faults=[{step: 2, replica: 0, phase: save}]"],
            "recover.faults[0]: phase save needs periodic checkpoints: set checkpoints.checkpoint_interval >= 1",
        ),
        (
            [RECOVER_ON, SAVE_EVERY_2, "recover.faults=[{step: 3, replica: 0, phase: save}]"],
            "recover.faults[0]: phase save at step 3 would never fire: checkpoints are saved every "
            "checkpoints.checkpoint_interval=2 steps, so choose a step that is a multiple of 2",
        ),
        (
            [*RESTART, "recover.faults=[{step: 2, replica: 0, kind: freeze}]"],
            "recover.faults[0]: kind 'freeze' is not supported in checkpoint_restart mode, which recovers "
            "only from dead ranks: use kind: kill, or recover.mode: forward",
        ),
        (
            [*RESTART, "recover.faults=[{step: 2, kind: error, id: 8}]"],
            "recover.faults[0]: kind 'error' is not supported in checkpoint_restart mode",
        ),
    ],
)
def test_out_of_range_value_is_one_line_naming_the_key(overrides: list[str], expected: str):
    message = tiny_error(*overrides)
    assert "\n" not in message
    assert expected in message


@pytest.mark.parametrize(
    "overrides",
    [
        # Decay reaching past the end of the run is fine (Nanotron allows it): the rate just
        # never gets down to min_decay_lr.
        [f"{LR}.lr_warmup_steps=10", f"{LR}.lr_decay_steps=100"],
        [f"{LR}.lr_warmup_steps=20"],  # warm-up as long as the run
        [f"{LR}.min_decay_lr=0.003"],  # min == peak: a constant rate
        [f"{LR}.min_decay_lr=0"],
        ["optimizer.clip_grad=null", "optimizer.weight_decay=0", "optimizer.optimizer_factory.adam_beta1=0"],
        [
            "recover.watchdog_timeout_s=null",
            "recover.heartbeat_period_s=0.5",
            "recover.heartbeat_timeout_s=1.6",
        ],
        [RECOVER_ON, "recover.faults=[{step: 2, kind: error, id: 8}, {step: 2, kind: error, id: 15}]"],
        [RECOVER_ON, "recover.faults=[{step: 3, kind: error, id: 20, persistent: true, phase: backward}]"],
        [RECOVER_ON, "recover.faults=[{step: 2, kind: freeze, rank: 1}]"],
        [RECOVER_ON, SAVE_EVERY_2, "recover.faults=[{step: 4, replica: 1, phase: save, kind: freeze}]"],
        [*RESTART, "recover.faults=[{step: 4, replica: 1, phase: save}]"],
        [*RESTART, "recover.faults=[{step: 3, rank: 0, kind: kill}]"],
    ],
)
def test_values_at_the_edge_of_their_range_validate(overrides: list[str]):
    tiny(*overrides)


def test_fault_kinds_and_ids_reach_the_config():
    cfg = tiny(
        RECOVER_ON, "recover.faults=[{step: 2, kind: error, id: 9, persistent: true}, {step: 3, rank: 1}]"
    )
    error, kill = cfg.recover.faults
    assert (error.kind, error.id, error.persistent, error.replica, error.rank) == (
        "error",
        9,
        True,
        None,
        None,
    )
    assert (kill.kind, kill.id, kill.rank) == ("kill", None, 1)


def test_recover_fault_phase_is_a_literal_choice():
    message = tiny_error(RECOVER_ON, "recover.faults=[{step: 2, replica: 0, phase: backwards}]")
    assert message.startswith("recover.faults[0].phase: must be one of 'forward', 'backward', ")
    assert message.endswith("got 'backwards'")


def test_recover_enabled_with_faults_validates():
    cfg = tiny(
        RECOVER_ON, "recover.faults=[{step: 2, replica: 1, phase: reduce, microbatch: 1}, {step: 3, rank: 0}]"
    )
    assert cfg.recover.enabled is True
    assert [(f.step, f.phase, f.replica, f.rank, f.microbatch) for f in cfg.recover.faults] == [
        (2, "reduce", 1, None, 1),
        (3, "forward", None, 0, 0),
    ]


@pytest.mark.parametrize(
    ("overrides", "forward", "checkpoint_restart"),
    [
        ([], False, False),
        (["recover.mode=checkpoint_restart"], False, False),  # a mode without recover.enabled runs plain
        ([RECOVER_ON], True, False),
        (RESTART, False, True),
    ],
)
def test_recover_mode_properties(overrides: list[str], forward: bool, checkpoint_restart: bool):
    recover = tiny(*overrides).recover
    assert (recover.forward, recover.checkpoint_restart) == (forward, checkpoint_restart)


# -- recover.rejoin ------------------------------------------------------------------------------
SPAWN = "recover.rejoin.mode=spawn"


def test_rejoin_defaults_load():
    rejoin = tiny().recover.rejoin
    assert rejoin == RejoinArgs()
    assert (rejoin.mode, rejoin.after_steps, rejoin.max_spawns, rejoin.max_failures_per_replica) == (
        "off",
        1,
        16,
        3,
    )
    assert rejoin.hosts == [] and rejoin.hostfile is None


def test_a_full_rejoin_section_loads_from_yaml(tmp_path: Path):
    data = load_yaml(TINY)
    data["recover"] = {
        "enabled": True,
        "mode": "forward",
        "rejoin": {
            "mode": "spawn",
            "after_steps": 0,
            "max_spawns": 4,
            "max_failures_per_replica": 1,
            "hosts": ["node7", "node8:4"],
        },
    }
    cfg = load_config(write(tmp_path, yaml.safe_dump(data)))
    assert cfg.recover.rejoin == RejoinArgs(
        mode="spawn", after_steps=0, max_spawns=4, max_failures_per_replica=1, hosts=["node7", "node8:4"]
    )
    assert load_config(write(tmp_path, dump_config(cfg), "dumped.yaml")) == cfg


def test_a_rejoin_hostfile_that_exists_loads(tmp_path: Path):
    hostfile = tmp_path / "spares.txt"
    hostfile.write_text("node7 slots=8\n")
    cfg = tiny(RECOVER_ON, SPAWN, f"recover.rejoin.hostfile={hostfile}")
    assert cfg.recover.rejoin.hostfile == str(hostfile) and cfg.recover.rejoin.hosts == []


def test_unknown_key_in_the_rejoin_section_is_named():
    message = tiny_error(RECOVER_ON, "recover.rejoin.max_spawn=3")
    assert message.startswith("unknown key 'max_spawn' in section 'recover.rejoin' (allowed: ")
    assert "max_spawns" in message


def test_a_bare_yaml_off_means_off():
    """YAML 1.1 reads an unquoted ``off`` as false: it still selects the "off" choice."""
    cfg = tiny(RECOVER_ON, "recover.rejoin.mode=off", "recover.spares=off")
    assert (cfg.recover.rejoin.mode, cfg.recover.spares) == ("off", "off")


def test_rejoin_mode_is_a_literal_choice():
    assert tiny_error(RECOVER_ON, "recover.rejoin.mode=grow") == (
        "recover.rejoin.mode: must be one of 'off', 'spawn', got 'grow'"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["recover.rejoin.after_steps=-1"],
            "recover.rejoin.after_steps must be >= 0, got -1",
        ),
        (
            ["recover.rejoin.max_spawns=0"],
            "recover.rejoin.max_spawns must be >= 1, got 0: to never spawn set recover.rejoin.mode: off",
        ),
        (
            ["recover.rejoin.max_failures_per_replica=0"],
            "recover.rejoin.max_failures_per_replica must be >= 1, got 0",
        ),
        (
            [RECOVER_ON, SPAWN, "recover.rejoin.hosts=[node7]", "recover.rejoin.hostfile=spares.txt"],
            "recover.rejoin: set hosts or hostfile, not both (neither: any free slot mpirun knows of)",
        ),
        (
            [RECOVER_ON, SPAWN, "recover.rejoin.hosts=[node7, 'node8:0']"],
            "recover.rejoin.hosts[1] 'node8:0' is not a host: write a name or name:slots, e.g. node7 or node7:4",
        ),
        (
            [RECOVER_ON, SPAWN, "recover.rejoin.hosts=['node7 node8']"],
            "recover.rejoin.hosts[0] 'node7 node8' is not a host",
        ),
        (
            [RECOVER_ON, SPAWN, "recover.rejoin.join_timeout_s=0"],
            "recover.rejoin.join_timeout_s must be > 0, got 0",
        ),
        (
            [SPAWN],
            "recover.rejoin.mode: spawn needs recover.enabled: true (re-join grows back a job that recovers "
            "forward); set recover.enabled: true or recover.rejoin.mode: off",
        ),
        (
            [*RESTART, SPAWN],
            "recover.rejoin.mode: spawn cannot be used with recover.mode: checkpoint_restart: a relaunch "
            "already restores full width; set recover.mode: forward or recover.rejoin.mode: off",
        ),
    ],
)
def test_rejoin_rule_message(overrides: list[str], message: str):
    got = tiny_error(*overrides)
    assert "\n" not in got
    assert got.startswith(message)


def test_a_missing_rejoin_hostfile_is_named(tmp_path: Path):
    missing = tmp_path / "spares.txt"
    assert tiny_error(RECOVER_ON, SPAWN, f"recover.rejoin.hostfile={missing}") == (
        f"recover.rejoin.hostfile {str(missing)!r} does not exist: write it or fix the path"
    )
    assert tiny_error(RECOVER_ON, SPAWN, f"recover.rejoin.hostfile={tmp_path}") == (
        f"recover.rejoin.hostfile {str(tmp_path)!r} is not a file"
    )
    # Like dataset folders, it is checked only where the job's files are expected (not by a dry run).
    cfg = tiny(RECOVER_ON, SPAWN, f"recover.rejoin.hostfile={missing}", check_paths=False)
    assert cfg.recover.rejoin.hostfile == str(missing)


def test_a_missing_rejoin_hostfile_is_an_input_error(tmp_path: Path):
    with pytest.raises(InputError, match="recover.rejoin.hostfile"):
        tiny(RECOVER_ON, SPAWN, f"recover.rejoin.hostfile={tmp_path / 'nope'}")


def test_init_from_a_checkpoint_path_alone_is_valid():
    cfg = tiny("model.init_method={path: /ckpt/step_10}")
    assert cfg.model.init_method.path == Path("/ckpt/step_10")
    assert cfg.model.init_method.std is None


def test_shapes_that_divide_evenly_validate():
    cfg = tiny("parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=1")
    assert cfg.world_size == 4


def test_missing_dataset_folder_is_named(tmp_path: Path):
    missing = tmp_path / "corpus"
    message = tiny_error(f"data_stages.0.data.dataset={{dataset_folder: {missing}}}")
    assert message == (
        f"data_stages[0].data.dataset.dataset_folder {str(missing)!r} does not exist: run "
        "`nanotron-recover preprocess --out` into it or fix the path"
    )


def test_missing_dataset_folder_is_not_checked_without_check_paths(tmp_path: Path):
    missing = tmp_path / "corpus"
    cfg = tiny(f"data_stages.0.data.dataset={{dataset_folder: {missing}}}", check_paths=False)
    assert cfg.data_stages[0].data.dataset == NanosetDatasetsArgs(dataset_folder=str(missing))


def test_existing_dataset_folder_validates(tmp_path: Path):
    cfg = tiny(f"data_stages.0.data.dataset.dataset_folder={tmp_path}")
    assert isinstance(cfg.data_stages[0].data.dataset, NanosetDatasetsArgs)
    assert cfg.data_stages[0].data.dataset.dataset_folder == str(tmp_path)


def test_check_world_size_accepts_the_product():
    cfg = tiny("parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=3")
    check_world_size(cfg, 12)


@pytest.mark.parametrize("world_size", [1, 11, 13, 24])
def test_check_world_size_refuses_any_other_count(world_size: int):
    cfg = tiny("parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=3")
    with pytest.raises(ConfigError) as info:
        check_world_size(cfg, world_size)
    assert str(info.value) == (
        f"world size {world_size} != tp*pp*dp = 2*2*3 = 12: launch 12 ranks or change parallelism"
    )


# -- Nanotron fields with one implemented behaviour ------------------------------------------------
# Each row: an override, then a piece of the one-line refusal, which names the field, the value
# given, why it cannot take effect and the value that runs. (The refusals of Nanotron keys that
# describe other models or Nanotron's older schema are in tests/unit/config/test_nanotron_configs.py.)
@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("general.step=100", "general.step=100 is not supported: a run starts at step 0 or at the step"),
        ("general.consumed_train_samples=6400", "general.consumed_train_samples=6400 is not supported: "),
        (
            "model.model_config.is_llama_config=false",
            "model.model_config.is_llama_config=false is not supported: this engine trains LLaMA "
            "models only; set true",
        ),
        (
            "model.model_config.use_cache=false",
            "model.model_config.use_cache=false is not supported: training uses no KV cache",
        ),
        (
            "tokens.val_check_interval=100",
            "tokens.val_check_interval=100 is not supported: no validation runs during training "
            "(score a checkpoint with `nanotron-recover eval`); set -1",
        ),
        ("tokens.val_check_interval=0", "tokens.val_check_interval=0 is not supported: "),
        (
            "tokens.limit_val_batches=4",
            "tokens.limit_val_batches=4 is not supported: no validation runs during training; set 0",
        ),
        (
            "tokens.limit_test_batches=4",
            "tokens.limit_test_batches=4 is not supported: no test runs during training; set 0",
        ),
        (
            "optimizer.accumulate_grad_in_fp32=false",
            "optimizer.accumulate_grad_in_fp32=false is not supported: gradients are always "
            "accumulated in an fp32 buffer (the recovery snapshots it); set true",
        ),
        (
            "tokenizer.tokenizer_revision=main",
            "tokenizer.tokenizer_revision=main is not supported: corpora are tokenized by "
            "`nanotron-recover preprocess`, which loads the default revision; set null",
        ),
        (
            "tokenizer.tokenizer_max_length=2048",
            "tokenizer.tokenizer_max_length=2048 is not supported: documents are packed into samples "
            "of tokens.sequence_length tokens; set null",
        ),
        (
            "kill_switch_path=runs/stop_training",
            "kill_switch_path=runs/stop_training is not supported: training does not watch for a stop "
            "file; set null",
        ),
        (
            "parallelism.context_parallel_size=2",
            "parallelism.context_parallel_size=2 is not supported: context parallelism is not "
            "implemented (every rank of a replica holds whole sequences); set 1",
        ),
        (
            "optimizer.weight_decay_exclude_named_params=[norm]",
            "optimizer.weight_decay_exclude_named_params=[norm] is not supported: every parameter is "
            "decayed by optimizer.weight_decay; set null or []",
        ),
        (
            "metrics_logging.log_level=1",
            "metrics_logging.log_level=1 is not supported: detailed per-layer metrics are not logged",
        ),
        (
            "lighteval={tasks: {tasks: early-signal}, batch_size: 16}",
            "lighteval={tasks: {tasks: early-signal}, batch_size: 16} is not supported: no LightEval "
            "evaluation runs during training",
        ),
        (
            "s3_upload={upload_s3_path: s3://bucket/run, remove_after_upload: true}",
            "s3_upload={upload_s3_path: 's3://bucket/run', remove_after_upload: true} is not supported: "
            "checkpoints are not uploaded to S3",
        ),
        (
            "data_stages.0.data.num_loading_workers=8",
            "data_stages[0].data.num_loading_workers=8 is not supported: micro-batches are read in the "
            "training process, without loader workers; set 0 or 1",
        ),
        (
            "data_stages.0.data.num_loading_workers=-1",
            "data_stages[0].data.num_loading_workers=-1 is not supported: ",
        ),
    ],
)
def test_unimplemented_value_is_refused_in_one_line(override: str, expected: str):
    message = tiny_error(override)
    assert "\n" not in message
    assert expected in message


def test_a_long_refused_section_is_cut_short_in_its_line():
    sections = ", ".join(f"key{i}: value{i}" for i in range(30))
    message = tiny_error(f"lighteval={{{sections}}}")
    assert message.startswith("lighteval={key0: value0, key1: value1")
    assert "...} is not supported" not in message and "... is not supported: no LightEval" in message
    assert "key29" not in message


def test_every_fixed_field_accepts_its_schema_default():
    # The value that runs is the Nanotron default, so a config that leaves the field out loads.
    cfg = Config()
    for key, get, allowed, _ in MODEL_FIXED_FIELDS + FIXED_FIELDS:
        assert get(cfg) in allowed, key


# -- Nanotron fields accepted with a note (they change no math) -----------------------------------
def test_every_noted_field_needs_no_note_at_its_schema_default():
    assert config_notes(Config()) == []
    assert config_notes(tiny()) == []


@pytest.mark.parametrize(
    ("overrides", "note"),
    [
        (
            ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"],
            "note: parallelism.tp_mode REDUCE_SCATTER runs as ALL_REDUCE here: same math, "
            "no sequence-parallel activation saving",
        ),
        (
            ["parallelism.tp=2", "parallelism.tp_linear_async_communication=true"],
            "note: parallelism.tp_linear_async_communication true runs synchronously here: same math",
        ),
        (
            ["parallelism.recompute_layer=true"],
            "note: parallelism.recompute_layer true runs without recomputation here: same math, every "
            "layer's activations are kept",
        ),
        (
            ["parallelism.moe_layer_recompute=true"],
            "note: parallelism.moe_layer_recompute true changes nothing here: a dense LLaMA has no MoE layers",
        ),
        (
            ["model.ddp_bucket_cap_mb=120"],
            "note: model.ddp_bucket_cap_mb 120 changes nothing here: same math, plain mode all-reduces "
            "the gradients as one flat buffer",
        ),
        (
            ["model.model_config._attn_implementation=flash_attention_2"],
            "note: model.model_config._attn_implementation flash_attention_2 runs as torch "
            "scaled_dot_product_attention here",
        ),
        (
            ["general.ignore_sanity_checks=false"],
            "note: general.ignore_sanity_checks false runs no extra checks here: Nanotron's debug "
            "assertions that tensors agree across ranks are not implemented",
        ),
        (
            ["checkpoints.checkpoints_path_is_shared_file_system=false"],
            "note: checkpoints.checkpoints_path_is_shared_file_system false changes nothing (Nanotron "
            "main ignores it too)",
        ),
        (
            ["checkpoints.load_lr_scheduler=false"],
            "note: checkpoints.load_lr_scheduler false restarts the learning-rate schedule (warm-up "
            "again) at the step of the checkpoint named in checkpoints.resume_checkpoint_path",
        ),
        (["logging.log_level=debug"], "note: logging.log_level debug changes nothing here: console output"),
        (["logging.log_level_replica=warning"], "note: logging.log_level_replica warning changes nothing"),
        (
            ["profiler={profiler_export_path: null}"],
            "note: profiler.profiler_export_path null writes no trace (as in Nanotron), so no profiler runs",
        ),
    ],
)
def test_a_field_that_changes_no_math_loads_with_one_note(overrides: list[str], note: str):
    notes = config_notes(tiny(*overrides))
    assert len(notes) == 1 and notes[0].startswith(note), notes
    assert "\n" not in notes[0]


def test_tp_recompute_allgather_false_under_sequence_parallelism_is_noted():
    """Nanotron reads tp_recompute_allgather only under REDUCE_SCATTER over several tensor ranks:
    there, false is noted (no all-gather runs here); elsewhere it is ignored by Nanotron too."""
    sp = ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"]
    notes = config_notes(tiny(*sp, "parallelism.tp_recompute_allgather=false"))
    assert [n for n in notes if "tp_recompute_allgather" in n] == [
        "note: parallelism.tp_recompute_allgather false changes nothing here: tp_mode runs as ALL_REDUCE, "
        "whose tensor-parallel layers all-gather no input, so there is none to keep for the backward pass "
        "or to gather again"
    ]
    assert not any("tp_recompute_allgather" in n for n in config_notes(tiny(*sp)))
    for other in (["parallelism.tp=2"], ["parallelism.tp=1", "parallelism.tp_mode=REDUCE_SCATTER"]):
        assert config_notes(tiny(*other, "parallelism.tp_recompute_allgather=false")) == []


def test_noted_fields_are_listed_once():
    keys = [key for key, *_ in NOTED_FIELDS]
    assert len(keys) == len(set(keys))
    assert not set(keys) & {key for key, *_ in MODEL_FIXED_FIELDS + FIXED_FIELDS}


def test_log_levels_are_nanotrons():
    # Any of Nanotron's levels loads (with the note); another word is refused, as Nanotron does.
    assert config_notes(tiny("logging.log_level=passive"))[0].startswith("note: logging.log_level passive")
    assert tiny_error("logging.log_level=verbose") == (
        "logging.log_level: must be one of 'debug', 'info', 'warning', 'error', 'critical', 'passive', "
        "got 'verbose'"
    )


@pytest.mark.parametrize(
    "overrides",
    [
        [
            "general.step=null",
            "general.consumed_train_samples=null",
            "general.benchmark_csv_path=null",
            "general.ignore_sanity_checks=true",
            "parallelism.tp_linear_async_communication=false",
            "parallelism.recompute_layer=false",
            "parallelism.expert_parallel_size=1",
            "parallelism.context_parallel_size=1",
            "parallelism.tp_recompute_allgather=false",
            "parallelism.moe_layer_recompute=false",
            "model.ddp_bucket_cap_mb=25",
            "model.model_config.is_llama_config=true",
            "model.model_config.use_cache=true",
            "model.model_config.pretraining_tp=1",
            "model.model_config.rope_scaling=null",
            "model.model_config.attention_bias=false",
            "model.model_config.z_loss_enabled=false",
            "model.model_config.z_loss_coefficient=0.001",
            "model.model_config._attn_implementation=sdpa",
            "model.init_method.scaling_method=NONE",
            "tokens.val_check_interval=-1",
            "tokens.limit_val_batches=0",
            "tokens.limit_test_batches=0",
            "optimizer.accumulate_grad_in_fp32=true",
            "optimizer.weight_decay_exclude_named_params=[]",
            "checkpoints.checkpoints_path_is_shared_file_system=true",
            "checkpoints.load_lr_scheduler=true",
            "logging.log_level=info",
            "logging.log_level_replica=info",
            "tokenizer.tokenizer_revision=null",
            "tokenizer.tokenizer_max_length=null",
            "kill_switch_path=null",
            "metrics_logging={log_level: 0, log_detail_interval: 5}",
            "lighteval=null",
            "s3_upload=null",
            "profiler=null",
        ],
        ["data_stages.0.data.num_loading_workers=0"],
        ["data_stages.0.data.num_loading_workers=1"],
        # Sequence parallelism over a single tensor-parallel rank is plain tensor parallelism.
        ["parallelism.tp=1", "parallelism.tp_mode=REDUCE_SCATTER"],
        # A larger bucket for the recovery is set where it takes effect.
        ["recover.enabled=true", "recover.bucket_size_mb=100"],
    ],
)
def test_neutral_values_load(overrides: list[str]):
    assert config_notes(tiny(*overrides)) == []


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.model_config.hidden_size=0", "model.model_config.hidden_size must be >= 1, got 0"),
        (
            "model.model_config.intermediate_size=0",
            "model.model_config.intermediate_size must be >= 1, got 0",
        ),
        (
            "model.model_config.num_attention_heads=0",
            "model.model_config.num_attention_heads must be >= 1, got 0",
        ),
        (
            "model.model_config.num_hidden_layers=0",
            "model.model_config.num_hidden_layers must be >= 1, got 0",
        ),
        ("model.model_config.vocab_size=-2", "model.model_config.vocab_size must be >= 1, got -2"),
        (
            "model.model_config.max_position_embeddings=0",
            "model.model_config.max_position_embeddings must be >= 1, got 0",
        ),
        (
            "model.model_config.num_key_value_heads=0",
            "model.model_config.num_key_value_heads must be >= 1, or null for one per attention head, got 0",
        ),
        ("model.make_vocab_size_divisible_by=0", "model.make_vocab_size_divisible_by must be >= 1, got 0"),
        ("model.model_config.rms_norm_eps=0", "model.model_config.rms_norm_eps must be > 0, got 0.0"),
        ("model.model_config.rope_theta=-1", "model.model_config.rope_theta must be > 0, got -1.0"),
        (
            "model.model_config.hidden_size=12",
            "model.model_config: head dimension hidden_size/num_attention_heads = 3 must be even "
            "(rotary embeddings rotate pairs of dimensions)",
        ),
        (
            "logging.iteration_step_info_interval=0",
            "logging.iteration_step_info_interval must be >= 1 (print every that many steps), got 0",
        ),
    ],
)
def test_model_size_and_logging_interval_ranges(override: str, message: str):
    assert tiny_error(override) == message


def test_prometheus_port():
    assert tiny().logging.prometheus_port is None  # off unless asked for
    assert tiny("logging.prometheus_port=9464").logging.prometheus_port == 9464
    assert tiny("logging.prometheus_port=0").logging.prometheus_port == 0
    for bad in ("-1", "65536"):
        assert tiny_error(f"logging.prometheus_port={bad}") == (
            f"logging.prometheus_port must be a TCP port 1-65535, 0 (any free port) or null (off), got {bad}"
        )
    assert "prometheus_port" in tiny_error("logging.prometheus_port=true")
    assert "prometheus_port" in tiny_error("logging.prometheus_port=http")


# -- --set overrides -------------------------------------------------------------------------------
def test_override_nested_scalar_keeps_the_rest_of_the_section():
    data = load_yaml(TINY)
    apply_override(data, "parallelism.tp=2")
    assert data["parallelism"] == {"dp": 2, "tp": 2, "pp": 1, "pp_engine": "1f1b", "tp_mode": "ALL_REDUCE"}


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("7", 7),
        ("0.25", 0.25),
        ("null", None),
        ("", None),
        ("[1, 2]", [1, 2]),
        ("{a: 1}", {"a": 1}),
        ("true", True),
        ("'7'", "7"),
        ("a=b", "a=b"),
    ],
)
def test_override_value_is_parsed_as_yaml(raw: str, value: object):
    data: dict = {"general": {"run": "x"}}
    apply_override(data, f"general.run={raw}")
    assert data["general"]["run"] == value
    assert type(data["general"]["run"]) is type(value)


def test_override_list_item_by_index():
    data = load_yaml(NANOTRON)
    apply_override(data, "data_stages.0.data.seed=9")
    assert data["data_stages"][0]["data"]["seed"] == 9
    assert data["data_stages"][1]["data"]["seed"] == 8


def test_override_replaces_a_whole_list_item():
    data = load_yaml(NANOTRON)
    apply_override(data, "data_stages.1={name: last, start_training_step: 12}")
    assert data["data_stages"][1] == {"name": "last", "start_training_step": 12}


def test_override_list_value_reaches_the_config():
    data = load_yaml(NANOTRON)
    apply_override(data, "optimizer.weight_decay_exclude_named_params=[norm, embed]")
    parsed = from_dict(Config, data)
    assert parsed.optimizer.weight_decay_exclude_named_params == ["norm", "embed"]


def test_override_creates_a_missing_section():
    data = load_yaml(TINY)
    del data["recover"]
    apply_override(data, "recover.enabled=false")
    assert data["recover"] == {"enabled": False}
    assert config_from_dict(data).recover.enabled is False


def test_override_fills_a_null_section():
    data = load_yaml(TINY)
    assert data["data_stages"][0]["data"]["dataset"] is None
    apply_override(data, "data_stages.0.data.dataset.dataset_folder=/corpus")
    assert data["data_stages"][0]["data"]["dataset"] == {"dataset_folder": "/corpus"}


def test_override_new_key_is_then_rejected_by_the_strict_loader():
    data = load_yaml(TINY)
    apply_override(data, "parallelism.foo=1")
    assert data["parallelism"]["foo"] == 1
    with pytest.raises(ConfigError, match=r"^unknown key 'foo' in section 'parallelism'"):
        config_from_dict(data)


def test_override_new_key_through_load_config():
    with pytest.raises(ConfigError, match=r"^unknown key 'warmup' in section 'optimizer'"):
        tiny("optimizer.warmup=3")


@pytest.mark.parametrize(
    ("assignment", "message"),
    [
        ("no_equals", "--set 'no_equals': expected KEY=VALUE, e.g. parallelism.tp=2"),
        ("a..b=1", "--set 'a..b=1': empty key in 'a..b'"),
        ("=1", "--set '=1': empty key in ''"),
        ("parallelism.=1", "--set 'parallelism.=1': empty key in 'parallelism.'"),
        ("data_stages.3.data.seed=1", "--set data_stages.3: '3' is not an index of a list of length 1"),
        ("data_stages.1=null", "--set data_stages.1: '1' is not an index of a list of length 1"),
        ("data_stages.-1.name=x", "--set data_stages.-1: '-1' is not an index of a list of length 1"),
        (
            "data_stages.first.name=x",
            "--set data_stages.first: 'first' is not an index of a list of length 1",
        ),
        ("parallelism.tp.size=2", "--set 'parallelism.tp.size=2': parallelism.tp is not a section"),
        ("parallelism.tp.size.x=2", "--set parallelism.tp.size: parent is not a section"),
    ],
)
def test_malformed_override_is_refused(assignment: str, message: str):
    data = load_yaml(TINY)
    before = copy.deepcopy(data)
    with pytest.raises(ConfigError) as info:
        apply_override(data, assignment)
    assert str(info.value) == message
    assert data == before


def test_override_value_that_is_not_yaml_is_a_config_error():
    data = load_yaml(TINY)
    with pytest.raises(ConfigError) as info:
        apply_override(data, "general.run=[1,")
    message = str(info.value)
    assert message.startswith("--set 'general.run=[1,': value is not valid YAML: line 1, column 4: ")
    assert "\n" not in message
    assert data["general"]["run"] == "tiny_cpu"


# -- data stages, derived sizes, dump -----------------------------------------------------------
@pytest.mark.parametrize(
    ("step", "name"),
    [
        (1, "Main phase"),
        (11, "Main phase"),
        (12, "Cool-down phase"),
        (16, "Cool-down phase"),
    ],
)
def test_stage_for_step_picks_the_last_started_stage(step: int, name: str):
    cfg = load_config(NANOTRON)
    assert cfg.stage_for_step(step).name == name


def test_stage_for_step_does_not_depend_on_list_order():
    cfg = load_config(
        TINY,
        [
            "data_stages=[{name: c, start_training_step: 20}, {name: a, start_training_step: 1}, "
            "{name: b, start_training_step: 5}]"
        ],
    )
    assert [cfg.stage_for_step(s).name for s in (1, 4, 5, 19, 20, 100)] == ["a", "a", "b", "b", "c", "c"]


def test_derived_sizes_of_the_tiny_config():
    cfg = tiny()
    assert cfg.world_size == 2
    assert cfg.microbatches_per_step == 2 * 4
    assert cfg.tokens_per_step == 8 * 2 * 64


def test_dump_config_round_trips_the_tiny_config(tmp_path: Path):
    cfg = tiny()
    path = write(tmp_path, dump_config(cfg), "dumped.yaml")
    assert load_config(path) == cfg


def test_dump_config_round_trips_paths_lists_and_floats(tmp_path: Path):
    cfg = load_config(
        NANOTRON,
        [
            "data_stages.1.data.dataset.dataset_folder=/corpora/anneal",
            "model.init_method={path: /ckpt/step_10}",
            "optimizer.learning_rate_scheduler.min_decay_lr=1e-7",
        ],
        check_paths=False,
    )
    text = dump_config(cfg)
    assert list(yaml.safe_load(text))[:3] == ["general", "parallelism", "model"]
    loaded = load_config(write(tmp_path, text, "dumped.yaml"), check_paths=False)
    assert loaded == cfg
    assert loaded.data_stages[1].data.dataset.dataset_folder == "/corpora/anneal"
    assert loaded.optimizer.learning_rate_scheduler.min_decay_lr == 1e-7


def test_dump_config_round_trips_an_unvalidated_nanotron_config():
    cfg = from_dict(Config, load_yaml(NANOTRON))
    assert from_dict(Config, yaml.safe_load(dump_config(cfg))) == cfg


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: RecoverArgs(heartbeat_period_s=1.0, heartbeat_timeout_s=2.0), "must be greater than 3 x"),
        (
            lambda: RecoverArgs(exact=True, exact_fraction_bits=4),
            "exact_fraction_bits must be between 8 and 56",
        ),
        (lambda: RejoinArgs(hosts=["a b"]), "is not a host"),
        (lambda: FaultSpec(step=2), r"^recover\.faults\[\?\]: set exactly one of replica or rank$"),
        (
            lambda: FaultSpec(step=2, kind="error", id=9, phase="reduce"),
            "phase must be one of forward, backward",
        ),
        (lambda: SnapshotArgs(interval=-1), "recover.snapshot.interval must be >= 0"),
        (lambda: SnapshotArgs(replicas_per_coordinate=0), "replicas_per_coordinate must be >= 1"),
    ],
)
def test_recover_sections_check_their_own_fields_when_built(build, message):
    """Like Nanotron's *Args, a recover section refuses a bad value when it is built, config file
    or not; only the checks that need other sections wait for validate_config. A fault built outside
    a file does not know its index in recover.faults."""
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_relaunch_may_run_fewer_whole_replicas():
    cfg = tiny("parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=3")
    assert launched_replicas(cfg, 12, relaunched=False) == 3
    assert launched_replicas(cfg, 12, relaunched=True) == 3
    assert launched_replicas(cfg, 8, relaunched=True) == 2
    assert launched_replicas(cfg, 4, relaunched=True) == 1


@pytest.mark.parametrize("world_size", [6, 16, 0])
def test_a_relaunch_refuses_a_partial_replica_or_a_wider_world(world_size: int):
    cfg = tiny("parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=3")
    with pytest.raises(
        ConfigError, match=r"relaunch runs whole replicas of 4 ranks, between recover.min_replicas=1 and dp=3"
    ):
        launched_replicas(cfg, world_size, relaunched=True)


def test_a_launch_is_not_narrowed_and_a_relaunch_not_below_min_replicas():
    cfg = tiny("parallelism.tp=2", "parallelism.pp=2", "parallelism.dp=3")
    with pytest.raises(ConfigError, match=r"^world size 8 != tp\*pp\*dp"):
        launched_replicas(cfg, 8, relaunched=False)
    cfg = tiny("parallelism.dp=3", "recover.enabled=true", "recover.min_replicas=2")
    assert launched_replicas(cfg, 2, relaunched=True) == 2
    with pytest.raises(ConfigError, match=r"between recover.min_replicas=2 and dp=3"):
        launched_replicas(cfg, 1, relaunched=True)
