"""HSDP for one replica: FSDP2 sharding over the replica's ranks, gradients summed across replicas by
the caller through a flat fp32 gradient-shard buffer."""

from .checkpoint import load_hsdp_checkpoint, save_hsdp_checkpoint
from .engine import HSDPEngine, dim0_block
from .memory import HSDPMemory, hsdp_memory_per_rank
from .stage_state import load_stage_full_state, stage_full_state

__all__ = [
    "HSDPEngine",
    "HSDPMemory",
    "dim0_block",
    "hsdp_memory_per_rank",
    "load_hsdp_checkpoint",
    "load_stage_full_state",
    "save_hsdp_checkpoint",
    "stage_full_state",
]
