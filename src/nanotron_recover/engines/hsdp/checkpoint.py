"""HSDP checkpoints in the project's layout-independent format.

An HSDP replica saves as if it were a tp=1, pp=1 layout: shard rank 0 gathers the full canonical
tensors (``HSDPEngine.full_state``) and writes them as ``model/pp0-tp0.safetensors`` and
``optimizer/pp0-tp0.safetensors``; every rank writes its RNG file. ``CheckpointReader`` reshards
such a checkpoint onto any tp/pp layout, and :func:`load_hsdp_checkpoint` loads a checkpoint saved
by any layout (3D or HSDP, any shard count) into an engine. The save is
:func:`~nanotron_recover.checkpoint.save_checkpoint` itself, so publication, agreement on failures
and asynchronous writing behave as for the 3D engine; it is collective over the default group (the
replica's world), whose ranks must be the engine's group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...checkpoint import DEFAULT_FINALIZE_TIMEOUT_S, CheckpointReader, PendingSave, save_checkpoint
from ...config import Config
from ...parallel.sharding import ParamSpec
from .engine import OPTIMIZER_KEYS, HSDPEngine


class _FullModel:
    """What ``save_checkpoint`` reads from a stage, over full tensors: a tp=1, pp=1 stage."""

    pp_rank = 0
    tp_rank = 0

    def __init__(self, specs: dict[str, ParamSpec], tensors: dict[str, torch.Tensor]):
        self.specs, self._tensors = specs, tensors

    def named_parameters(self):
        return iter(self._tensors.items())


def save_hsdp_checkpoint(
    root: str | Path,
    step: int,
    cfg: Config,
    engine: HSDPEngine,
    *,
    dp_rank: int = 0,
    extra: dict[str, Any] | None = None,
    asynchronous: bool = False,
    finalize_timeout_s: float = DEFAULT_FINALIZE_TIMEOUT_S,
) -> Path | PendingSave:
    """Collective over the replica: returns what ``save_checkpoint`` returns. Only the replica with
    ``dp_rank == 0`` writes tensors (replicas are identical); the full model is gathered in the CPU
    memory of its shard rank 0 for the time of the save."""
    writer = dp_rank == 0
    state = engine.full_state(dst=0) if writer else {}
    model = {name: state[name] for name in engine.names} if state else {}
    optimizer = {
        name: {key: state[f"{key}/{name}"] for key in (*OPTIMIZER_KEYS, "master") if f"{key}/{name}" in state}
        for name in model
    }
    return save_checkpoint(
        root,
        step,
        cfg,
        _FullModel(engine.specs, model),
        optimizer,
        tp=1,
        pp=1,
        # Only shard rank 0 holds the gathered tensors: the other ranks write their RNG file only.
        dp_rank=0 if writer and engine.rank == 0 else 1,
        extra=extra,
        asynchronous=asynchronous,
        finalize_timeout_s=finalize_timeout_s,
    )


def load_hsdp_checkpoint(reader: CheckpointReader, engine: HSDPEngine, load_optimizer: bool = True) -> None:
    """Load a checkpoint of any layout into ``engine`` (every shard rank reads the full tensors and
    keeps its shard). Collective only in that every rank must call it."""
    reader.check_model(engine.cfg)
    state = {name: reader.full(name) for name in engine.names}
    step = None
    if load_optimizer:
        reader.check_optimizer()
        keys = list(OPTIMIZER_KEYS) + (["master"] if reader.meta.get("dtype") != "float32" else [])
        for name in engine.names:
            for key in keys:
                state[f"{key}/{name}"] = reader.full(name, "optimizer", key)
        step = reader.step
    engine.load_full_state(state, step=step)
