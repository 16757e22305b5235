"""Metrics and incident logs."""

from .metrics import MetricsWriter, ids_digest, read_metrics

__all__ = ["MetricsWriter", "ids_digest", "read_metrics"]
