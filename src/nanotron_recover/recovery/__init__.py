"""In-step recovery: bucket snapshots and the step transaction (DESIGN.md section 3.2)."""

from .buckets import Bucket, BucketedReduction

__all__ = ["Bucket", "BucketedReduction"]
