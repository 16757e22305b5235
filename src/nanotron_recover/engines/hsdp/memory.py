"""Memory per rank of one replica's HSDP engine, before anything is launched.

Kept for the whole run, on the heaviest shard rank (rank 0: FSDP splits every tensor's dim 0 in
blocks of ``ceil(rows / shard)``):
- the fp32 sharded parameters, which are also AdamW's master weights (no separate master copy);
- the fp32 gradient shard (``grads_flat``);
- AdamW state: two fp32 moments of the shard;
- in the fault-tolerant mode, the bucket snapshots of the gradient shard: one more fp32 copy at most.

Transient, during forward and backward (the compute dtype is the model dtype):
- the root unit (embedding, final norm, output head) unsharded for the whole step, plus two decoder
  layers (the one computing and the one being all-gathered ahead of it);
- without ``reduce_every_microbatch``, the whole model unsharded between micro-batches with its fp32
  gradient accumulated unsharded (that mode trades this memory for one reduce-scatter per step).

Activations are the same as the 3D engine's for tp=1, pp=1 and are not counted here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...config import LlamaConfig
from ...models.llama import LlamaStage

_WIDTH = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class HSDPMemory:
    shard: int
    parameters: int  # the full model
    shard_parameters: int  # elements of the heaviest rank's shard
    param_bytes: int  # fp32 sharded parameters (= the AdamW masters)
    grad_bytes: int  # fp32 gradient shard
    optimizer_bytes: int  # exp_avg + exp_avg_sq
    snapshot_bytes: int  # recovery snapshots of the gradient shard
    unsharded_bytes: int  # transient all-gathered weights (root unit + two layers), compute dtype
    accumulation_bytes: int  # only without reduce_every_microbatch: unsharded model + fp32 grads

    @property
    def persistent_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.snapshot_bytes

    @property
    def total_bytes(self) -> int:
        return self.persistent_bytes + self.unsharded_bytes + self.accumulation_bytes


def _width(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    return _WIDTH[dtype]


def hsdp_memory_per_rank(
    model_cfg: LlamaConfig,
    shard: int,
    dtype: torch.dtype | str = torch.float32,
    *,
    recover: bool = True,
    reduce_every_microbatch: bool = True,
) -> HSDPMemory:
    if shard < 1:
        raise ValueError("shard must be >= 1")
    width = _width(dtype)
    specs = LlamaStage(model_cfg, device="meta").specs
    full = {name: math.prod(spec.full_shape) for name, spec in specs.items()}
    parameters = sum(full.values())
    # rank 0 holds the first ceil(rows / shard) rows of every tensor: the largest shard
    per_rank = sum(
        min(-(-spec.full_shape[0] // shard), spec.full_shape[0]) * math.prod(spec.full_shape[1:])
        for spec in specs.values()
    )
    layers: dict[str, int] = {}
    for name, n in full.items():
        if name.startswith("model.layers."):
            layer = name.split(".")[2]
            layers[layer] = layers.get(layer, 0) + n
    root = parameters - sum(layers.values())
    largest = max(layers.values(), default=0)
    unsharded = width * (root + min(2, len(layers)) * largest)
    return HSDPMemory(
        shard=shard,
        parameters=parameters,
        shard_parameters=per_rank,
        param_bytes=4 * per_rank,
        grad_bytes=4 * per_rank,
        optimizer_bytes=8 * per_rank,
        snapshot_bytes=4 * per_rank if recover else 0,
        unsharded_bytes=unsharded,
        accumulation_bytes=0 if reduce_every_microbatch else (width + 4) * parameters,
    )
