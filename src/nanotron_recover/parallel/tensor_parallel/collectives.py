"""Differentiable tensor-parallel collectives (Megatron's f and g operators).

``copy_to_tp``: identity forward, all-reduce of the gradient backward. It sits in front of a
column-parallel layer, whose input is replicated but whose gradient arrives in partial sums.
``reduce_from_tp``: all-reduce forward, identity backward. It closes a row-parallel layer, whose
output is a partial sum on every rank. ``gather_from_tp``: concatenate shards on the last dim
forward, keep this rank's slice backward (used to hand full logits to evaluation).
With a group of one rank all three are the identity, so tp=1 pays nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = grad.shape[-1] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[..., rank * size : (rank + 1) * size].contiguous(), None


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if _world(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if _world(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return x if _world(group) == 1 else _GatherFromTP.apply(x, group)
