"""Metrics and incident logs, plus the optional mirrors of them: W&B and a terminal progress line."""

from .incidents import IncidentLog, read_incidents
from .metrics import MetricsWriter, ids_digest, read_metrics
from .progress import Progress
from .wandb_logger import RunLogger, WandbArgs, run_name_for, run_name_for_config

__all__ = [
    "IncidentLog",
    "MetricsWriter",
    "Progress",
    "RunLogger",
    "WandbArgs",
    "ids_digest",
    "read_incidents",
    "read_metrics",
    "run_name_for",
    "run_name_for_config",
]
