"""Tensor parallelism: explicit layers and the collectives they are built from."""

from .collectives import copy_to_tp, gather_from_tp, reduce_from_tp
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp",
    "gather_from_tp",
    "reduce_from_tp",
    "vocab_parallel_cross_entropy",
]
