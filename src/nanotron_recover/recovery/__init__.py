"""In-step recovery: bucket snapshots and the step transaction (docs/architecture.md)."""

from .buckets import Bucket, BucketedReduction

__all__ = ["Bucket", "BucketedReduction"]
