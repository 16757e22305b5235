"""Loss and perplexity of a checkpoint on a token file, on any tp/pp layout.

Runs as one process for tp=pp=1, or under ``mpirun -n tp*pp`` (one replica, dp=1). The checkpoint
may have been saved with any layout: weights are resharded on load. Rank 0 reports the numbers and,
if asked, writes the full-vocabulary logits ``[batch, seq, vocab]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checkpoint import CheckpointReader
from .config import Config, check_world_size
from .errors import InputError
from .models.llama import LlamaStage
from .parallel.context import ParallelContext
from .parallel.pipeline_parallel import build_engine
from .parallel.world import init_world


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int


def load_tokens(path: str | Path, vocab_size: int) -> torch.Tensor:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist")
    arr = np.load(path)
    if arr.ndim != 2 or arr.shape[1] < 2:
        raise InputError(f"{path}: expected token ids of shape [batch, seq>=2], got {list(arr.shape)}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise InputError(f"{path}: token ids must lie in [0, {vocab_size}), found [{arr.min()}, {arr.max()}]")
    return torch.from_numpy(arr.astype(np.int64))


def evaluate(
    cfg: Config, checkpoint: str | Path, tokens_file: str | Path, logits_out: str | Path | None
) -> EvalResult | None:
    """Collective over the eval world; returns the result on rank 0, None elsewhere."""
    cfg = replace(cfg, parallelism=replace(cfg.parallelism, dp=1))
    world = init_world()
    check_world_size(cfg, world.size)
    p = cfg.parallelism
    ctx = ParallelContext.create(p.tp, p.pp, 1, world.device)
    mcfg = cfg.model.model_config
    tokens = load_tokens(tokens_file, mcfg.vocab_size)
    stage = LlamaStage(
        mcfg, tp_group=ctx.tp_group, pp=p.pp, pp_rank=ctx.pp_rank, dtype=torch.float32, device=world.device
    )
    CheckpointReader(checkpoint).load_model(stage)
    stage.eval()
    engine = build_engine(p.pp_engine, stage, ctx, tokens.shape[0], tokens.shape[1] - 1)
    outputs = engine.forward_only([tokens[:, :-1]])

    result = torch.zeros(2, dtype=torch.float64, device=world.device)  # (sum of token losses, count)
    logits = None
    if ctx.is_last_stage:
        logits = stage.full_logits(outputs[0])  # collective over the tp group
        if ctx.tp_rank == 0:
            labels = tokens[:, 1:].to(world.device)
            nll = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
            result += torch.tensor([nll.item(), labels.numel()], dtype=torch.float64, device=world.device)
    dist.all_reduce(result)
    if logits_out is not None and p.pp > 1:
        # The last stage's tp rank 0 hands the full logits to rank 0.
        if ctx.is_last_stage and ctx.tp_rank == 0:
            dist.send(logits.contiguous(), dst=0)
        elif world.rank == 0:
            logits = torch.empty(tokens.shape[0], tokens.shape[1] - 1, mcfg.vocab_size, device=world.device)
            dist.recv(logits, src=ctx.last_stage_rank)
    if world.rank != 0:
        return None
    if logits_out is not None:
        np.save(logits_out, logits.float().cpu().numpy())
    loss = result[0].item() / result[1].item()
    return EvalResult(loss=loss, perplexity=math.exp(loss), tokens=int(result[1].item()))
