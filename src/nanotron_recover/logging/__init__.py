"""Metrics and incident logs."""

from .incidents import IncidentLog, read_incidents
from .metrics import MetricsWriter, ids_digest, read_metrics

__all__ = ["IncidentLog", "MetricsWriter", "ids_digest", "read_incidents", "read_metrics"]
