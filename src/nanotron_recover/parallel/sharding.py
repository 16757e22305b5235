"""How a parameter's local shard relates to the full tensor.

Every parameter the engine creates has a ``ParamSpec``: its full shape, the dimension split across
tensor-parallel ranks (None when replicated), and the canonical name its values are stored under
(differs from the module path only for a tied output head living on another pipeline stage). Init,
checkpoints and Hugging Face conversion all go through these specs, which is what makes weights and
optimizer state portable between layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSpec:
    full_shape: tuple[int, ...]
    shard_dim: int | None
    canonical_name: str
    # Replicated across the tensor-parallel group: counted once (on tp rank 0) in global norms.
    tp_replicated: bool = False
    # A copy of another stage's parameter (tied output head): counted once in global norms.
    is_tied_copy: bool = False


def shard(full: torch.Tensor, spec: ParamSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's contiguous block of ``full``."""
    if spec.shard_dim is None:
        return full
    size = full.shape[spec.shard_dim] // tp
    return full.narrow(spec.shard_dim, tp_rank * size, size)


def unshard(parts: list[torch.Tensor], spec: ParamSpec) -> torch.Tensor:
    """Inverse of ``shard`` over all ranks' blocks, in tp-rank order."""
    if spec.shard_dim is None:
        return parts[0]
    return torch.cat(parts, dim=spec.shard_dim)
