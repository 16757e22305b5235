"""Tensor-parallel layers: column-parallel and row-parallel linears, vocab-parallel embedding.

Each layer holds only this rank's shard and records which dimension of the full weight is split
(``tp_shard_dim``), so checkpoints and Hugging Face conversion can reassemble or re-split weights for
any layout. Shards are contiguous blocks: rank ``r`` of ``n`` holds rows (or columns)
``[r*k, (r+1)*k)`` of the full weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .collectives import copy_to_tp, reduce_from_tp


def _tp_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {parts}")
    return n // parts


class ColumnParallelLinear(nn.Module):
    """``y = x W^T`` with W split by output rows: each rank computes its slice of the features."""

    tp_shard_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: dist.ProcessGroup | None,
        copy_input: bool = True,
        **factory,
    ):
        super().__init__()
        self.group = group
        # False when the caller already applied copy_to_tp once for several layers sharing an input.
        self.copy_input = copy_input
        _, size = _tp_info(group)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(_divide(out_features, size, "out_features"), in_features, **factory)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input:
            x = copy_to_tp(x, self.group)
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with W split by input columns; the input arrives already split (from a
    column-parallel layer) and the partial products are summed across the group."""

    tp_shard_dim = 1

    def __init__(self, in_features: int, out_features: int, group: dist.ProcessGroup | None, **factory):
        super().__init__()
        self.group = group
        _, size = _tp_info(group)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, _divide(in_features, size, "in_features"), **factory)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows. A rank looks up the ids in its range, writes zeros
    for the rest, and the sum over the group gives every rank the full embedding."""

    tp_shard_dim = 0

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup | None, **factory):
        super().__init__()
        self.group = group
        rank, size = _tp_info(group)
        self.num_embeddings = num_embeddings
        per_rank = _divide(num_embeddings, size, "vocab_size")
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, **factory))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_start == 0 and self.vocab_end == self.num_embeddings:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)
