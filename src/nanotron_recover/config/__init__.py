"""Config: Nanotron-schema YAML, strict loading, ``--set`` overrides and validation."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from .loader import ConfigError, apply_override, from_dict, load_yaml, to_dict
from .recover import FaultSpec, RandomFaults, RecoverArgs, RejoinArgs, SnapshotArgs
from .schema import (
    CheckpointsArgs,
    Config,
    DataArgs,
    DatasetStageArgs,
    GeneralArgs,
    HFDatasetArgs,
    InitMethod,
    LlamaConfig,
    LoggingArgs,
    LRSchedulerArgs,
    MetricsLoggingArgs,
    ModelArgs,
    NanosetDatasetsArgs,
    OptimizerArgs,
    ParallelismArgs,
    ProfilerArgs,
    Qwen2Config,
    TokenizerArgs,
    TokensArgs,
    WandbArgs,
)
from .validate import check_world_size, config_notes, launched_replicas, validate_config


def add_config_arguments(
    parser: argparse.ArgumentParser,
    required: bool = True,
    config_help: str = "YAML config (Nanotron schema + recover:)",
) -> None:
    """``--config`` and the repeatable ``--set KEY=VALUE`` of every command that reads a config
    (``required=False``: a command that can also work without one)."""
    parser.add_argument("--config", required=required, help=config_help)
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any field, e.g. --set parallelism.tp=2 (repeatable)",
    )


def load_config(path: str | Path, overrides: list[str] | None = None, check_paths: bool = True) -> Config:
    """Load ``path``, apply ``--set`` overrides, check every field; raise ConfigError otherwise.

    Relative paths inside the config are relative to the working directory, as in Nanotron.
    """
    data = load_yaml(path)
    for assignment in overrides or []:
        apply_override(data, assignment)
    return config_from_dict(data, check_paths=check_paths)


def config_from_dict(data: dict, check_paths: bool = True) -> Config:
    cfg = from_dict(Config, data)
    validate_config(cfg, check_paths=check_paths)
    return cfg


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


__all__ = [
    "CheckpointsArgs",
    "Config",
    "ConfigError",
    "DataArgs",
    "DatasetStageArgs",
    "FaultSpec",
    "GeneralArgs",
    "HFDatasetArgs",
    "InitMethod",
    "LRSchedulerArgs",
    "LlamaConfig",
    "LoggingArgs",
    "MetricsLoggingArgs",
    "ModelArgs",
    "NanosetDatasetsArgs",
    "OptimizerArgs",
    "ParallelismArgs",
    "ProfilerArgs",
    "Qwen2Config",
    "RandomFaults",
    "RecoverArgs",
    "RejoinArgs",
    "SnapshotArgs",
    "TokenizerArgs",
    "TokensArgs",
    "WandbArgs",
    "add_config_arguments",
    "apply_override",
    "check_world_size",
    "launched_replicas",
    "config_notes",
    "config_from_dict",
    "dump_config",
    "from_dict",
    "load_config",
    "to_dict",
    "validate_config",
]
