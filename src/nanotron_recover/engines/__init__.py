"""Model engines: one rank's share of one replica's model, behind one interface.

A data-parallel mode (``data_parallel/``) only ever needs, from the model side, what
:class:`ModelEngine` offers: run a list of micro-batches forward and backward, expose this rank's
gradient contribution as one flat fp32 tensor (which it sums across replicas, snapshots and
restores), and after the sum, take the optimizer step. Two engines implement it:

- :class:`~.three_d.ThreeDEngine`: Nanotron-style tensor and pipeline parallelism inside the
  replica (``parallelism.tp``, ``pp``), an fp32 gradient buffer, AdamW on fp32 master weights;
- :class:`~.hsdp.HSDPModelEngine`: FSDP2 over the replica's ``parallelism.dp_shard`` ranks
  (parameters, gradients and optimizer state sharded inside the replica).

Across replicas both are the same to the data-parallel mode: rank ``k`` of every replica holds the
same slice of the model, so the replicas' flat gradients are summed slice by slice. For the same
reason a re-joining replica can take its state rank by rank from a healthy one:
:meth:`ModelEngine.export_state` on the donor, :meth:`ModelEngine.import_state` on the joiner at the
same ``(pp, tp)`` coordinate (:class:`~.state.EngineState`), and the two continue bitwise alike.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from .state import EngineState

if TYPE_CHECKING:
    from ..checkpoint import CheckpointReader, PendingSave
    from ..config import Config
    from ..parallel.context import ParallelContext
    from ..parallel.world import World


class ModelEngine(Protocol):
    # This rank's gradient contribution, summed in place across replicas (fp32; int64 fixed point
    # with recover.exact, turned back into floats by optimizer_step).
    grads_flat: torch.Tensor
    event_hook: Callable[[str, int], None] | None  # ("forward"|"backward", micro-batch index)

    @property
    def holds_loss(self) -> bool:
        """Whether the losses this rank returns are the replica's (exactly one rank per replica)."""

    @property
    def digest_name(self) -> str:
        """``pp<p>_tp<t>``: where this rank's parameter digest goes (the same on every replica)."""

    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[float]: ...
    def optimizer_step(self, lr: float) -> float:
        """Clip and step on the summed gradients, then zero them; returns the gradient norm."""

    def save(
        self, root: Path, step: int, cfg: Config, *, dp_rank: int, asynchronous: bool
    ) -> Path | PendingSave: ...
    def load(self, reader: CheckpointReader, load_optimizer: bool) -> None: ...
    def parameter_digest(self) -> str: ...
    def export_state(self, copy: bool = True) -> EngineState:
        """This rank's complete training state (weights, fp32 masters, AdamW moments and step counts,
        RNG states) as CPU copies, for the rank at the same coordinate of a re-joining replica; with
        ``copy=False`` the live tensors instead (a node snapshot copies them itself, once). Local
        (not collective); call at a step boundary; the engine is not modified."""

    def import_state(self, state: EngineState) -> None:
        """Load a donor's :meth:`export_state` in place (the optimizer's and the gradient buffer's
        references stay valid) and zero the gradient buffer; the next steps then run bitwise like the
        donor's. Refuses (``ValueError``, nothing changed) a state of another coordinate or layout."""

    def close(self) -> None: ...


def build_model_engine(cfg: Config, world: World, ctx: ParallelContext) -> ModelEngine:
    """The engine the config asks for: HSDP when ``parallelism.dp_shard > 1``, 3D otherwise."""
    if cfg.parallelism.dp_shard > 1:
        from .hsdp import HSDPModelEngine

        return HSDPModelEngine(cfg, world, ctx)
    from .three_d import ThreeDEngine

    return ThreeDEngine(cfg, world, ctx)


__all__ = ["EngineState", "ModelEngine", "build_model_engine"]
