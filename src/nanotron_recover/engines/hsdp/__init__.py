"""The HSDP engine: FSDP2 sharding over one replica's ranks, gradients summed across replicas by the
data-parallel mode through a flat fp32 gradient-shard buffer.

- :mod:`.engine`: :class:`HSDPEngine`, ``fully_shard`` over the replica's group, the sum
  reduce-scatter into ``grads_flat``, AdamW on the fp32 shards;
- :mod:`.model_engine`: :class:`HSDPModelEngine`, that engine behind the
  :class:`~nanotron_recover.engines.ModelEngine` interface (checkpoints, state transfer);
- :mod:`.checkpoint`: its checkpoints in the layout-independent format (saved as tp=1, pp=1);
- :mod:`.memory`: its memory per rank, before anything is launched;
- :mod:`.stage_state`: the same full state taken from, or loaded into, the 3D engine's stages.
"""

from .checkpoint import load_hsdp_checkpoint, save_hsdp_checkpoint
from .engine import HSDPEngine, dim0_block
from .memory import HSDPMemory, hsdp_memory_per_rank
from .model_engine import HSDPModelEngine
from .stage_state import load_stage_full_state, stage_full_state

__all__ = [
    "HSDPEngine",
    "HSDPMemory",
    "HSDPModelEngine",
    "dim0_block",
    "hsdp_memory_per_rank",
    "load_hsdp_checkpoint",
    "load_stage_full_state",
    "save_hsdp_checkpoint",
    "stage_full_state",
]
