"""The full-state dict of :class:`~.engine.HSDPEngine` for the 3D engine's stages, both ways.

A full state maps checkpoint entry names to full canonical tensors: ``<name>`` (weights, model
dtype), ``exp_avg/<name>``, ``exp_avg_sq/<name>`` and, for 16-bit models, ``master/<name>``. Loading
cuts each rank's tensor-parallel shard (``ParamSpec``), so a state taken from one layout loads into
any other; taking one from a stage needs the stage's full tensors, i.e. ``tp == 1``.
"""

from __future__ import annotations

import torch

from ...models.llama import LlamaStage
from ...optim import MasterOptimizer
from ...parallel.sharding import shard


@torch.no_grad()
def stage_full_state(stage: LlamaStage, optimizer: MasterOptimizer | None = None) -> dict[str, torch.Tensor]:
    """This stage's canonical tensors (a tp=1 stage: its tensors are full)."""
    if stage.tp != 1:
        raise ValueError("stage_full_state needs full tensors: tensor-parallel size 1")
    params = dict(stage.named_parameters())
    opt = optimizer.state_tensors() if optimizer is not None else {}
    out: dict[str, torch.Tensor] = {}
    for name, spec in stage.specs.items():
        if spec.is_tied_copy:
            continue  # saved once, as the embedding
        out[spec.canonical_name] = params[name].detach().cpu().clone()
        for key, value in opt.get(name, {}).items():
            out[f"{key}/{spec.canonical_name}"] = value.detach().cpu().clone()
    return out


@torch.no_grad()
def load_stage_full_state(
    stage: LlamaStage,
    state: dict[str, torch.Tensor],
    optimizer: MasterOptimizer | None = None,
    step: int | None = None,
) -> None:
    """Load a full state into a stage of any tp/pp layout (and its optimizer, when given and the
    state has optimizer entries; ``step`` is then the optimizer step count)."""
    params = dict(stage.named_parameters())
    for spec in stage.specs.values():  # everything is checked before anything changes
        canonical = spec.canonical_name
        if canonical not in state:
            raise KeyError(f"full state has no tensor {canonical!r}")
        for key in [canonical] + [f"{k}/{canonical}" for k in ("exp_avg", "exp_avg_sq", "master")]:
            if key in state and tuple(state[key].shape) != spec.full_shape:
                raise ValueError(
                    f"{key}: got shape {list(state[key].shape)}, expected {list(spec.full_shape)}"
                )
    opt_state: dict[str, dict[str, torch.Tensor]] = {}
    for name, spec in stage.specs.items():
        canonical = spec.canonical_name
        params[name].copy_(shard(state[canonical], spec, stage.tp_rank, stage.tp))
        entry = {
            key: shard(state[f"{key}/{canonical}"], spec, stage.tp_rank, stage.tp)
            for key in ("exp_avg", "exp_avg_sq", "master")
            if f"{key}/{canonical}" in state
        }
        if entry:
            opt_state[name] = entry
    if optimizer is None:
        return
    for name, master in optimizer.master.items():
        if master is not params[name] and "master" not in opt_state.get(name, {}):
            master.copy_(params[name])  # no fp32 master saved: start from the loaded weights
    if any("exp_avg" in entry for entry in opt_state.values()):
        if step is None:
            raise ValueError("loading optimizer state needs the step count")
        optimizer.load_state_tensors(opt_state, step)
    else:
        optimizer.load_state_tensors(opt_state, 0)  # masters only
