"""Loss and perplexity of a checkpoint on a token file, on any tp/pp layout.

Runs as one process for tp=pp=1, or under ``mpirun -n tp*pp`` (one replica, dp=1). The checkpoint
may have been saved with any layout: weights are resharded on load. Rank 0 reports the numbers and,
if asked, writes the full-vocabulary logits ``[batch, seq, vocab]``.

Inputs are checked before the world starts (the token file, the checkpoint and its model shape),
so a bad one is the same one-line error on every rank with no process group to strand. The world
is torn down before :func:`evaluate` returns, on success and on error alike: a gloo worker thread
still alive when the interpreter exits can abort the process (``terminate called without an
active exception``) after the result was printed.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
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
from .parallel.world import World, init_world


@dataclass
class EvalResult:
    loss: float
    perplexity: float
    tokens: int


def load_tokens(path: str | Path, vocab_size: int) -> torch.Tensor:
    """The ``[batch, seq]`` int64 token ids of a ``.npy`` file; an :class:`InputError` (one line) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {str(path)!r} does not exist")
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:  # not .npy, truncated, or an object array
        message = " ".join(str(e).split())
        raise InputError(f"{path}: not a readable .npy array of token ids ({message})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive
        raise InputError(f"{path}: expected one .npy array of token ids, got a {type(arr).__name__}")
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] < 2:
        raise InputError(f"{path}: expected token ids of shape [batch>=1, seq>=2], got {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise InputError(f"{path}: token ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise InputError(f"{path}: token ids must lie in [0, {vocab_size}), found [{arr.min()}, {arr.max()}]")
    return torch.from_numpy(arr.astype(np.int64))


@contextmanager
def _eval_world() -> Iterator[World]:
    """The torch.distributed world for one evaluation, destroyed again when the block ends.

    Destroying the process group joins gloo's worker threads; otherwise one can still be releasing
    the last collective's tensors while the interpreter (and, under mpirun, mpi4py's MPI_Finalize at
    exit) shuts down, and the C++ runtime aborts the process. On success every rank first meets in a
    barrier, so none tears its connections down while a peer still exchanges data with it. On an
    error the barrier is skipped: the other ranks may be waiting in a different collective, and a
    mismatched barrier would hang instead of letting the error through.
    """
    world = init_world()
    try:
        yield world
    except BaseException:
        dist.destroy_process_group()
        raise
    try:
        if world.backend == "nccl":
            dist.barrier(device_ids=[world.device.index])  # the GPU this rank uses, not a guessed one
        else:
            dist.barrier()
    finally:
        dist.destroy_process_group()


def evaluate(
    cfg: Config, checkpoint: str | Path, tokens_file: str | Path, logits_out: str | Path | None
) -> EvalResult | None:
    """Collective over the eval world; returns the result on rank 0, None elsewhere.

    The world is started by this call and destroyed before it returns or raises. Bad inputs (token
    file, checkpoint, ``logits_out`` folder) raise before the world starts.
    """
    cfg = replace(cfg, parallelism=replace(cfg.parallelism, dp=1))
    mcfg = cfg.model.model_config
    # File checks first: they read only files every rank sees alike, so every rank fails alike.
    tokens = load_tokens(tokens_file, mcfg.vocab_size)
    if logits_out is not None and not Path(logits_out).parent.is_dir():
        raise InputError(f"--logits-out {logits_out}: folder {Path(logits_out).parent} does not exist")
    reader = CheckpointReader(checkpoint)
    reader.check_model(mcfg)
    reader.verify()  # every shard opens and holds what meta.json lists, before any rank loads one
    with _eval_world() as world:
        check_world_size(cfg, world.size)
        out = _evaluate(cfg, world, reader, tokens, logits_out is not None)
    if out is None:
        return None
    result, logits = out
    if logits_out is not None:
        # Written after the world is gone: a failed write then cannot strand a peer in the barrier.
        np.save(logits_out, logits.float().cpu().numpy())
    return result


def _evaluate(
    cfg: Config, world: World, reader: CheckpointReader, tokens: torch.Tensor, want_logits: bool
) -> tuple[EvalResult, torch.Tensor | None] | None:
    """The collective part of :func:`evaluate`: (result, full logits if wanted) on rank 0, None elsewhere."""
    p = cfg.parallelism
    mcfg = cfg.model.model_config
    ctx = ParallelContext.create(p.tp, p.pp, 1, world.device)
    stage = LlamaStage(
        mcfg, tp_group=ctx.tp_group, pp=p.pp, pp_rank=ctx.pp_rank, dtype=torch.float32, device=world.device
    )
    reader.load_model(stage)
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
    if want_logits and p.pp > 1:
        # The last stage's tp rank 0 hands the full logits to rank 0.
        if ctx.is_last_stage and ctx.tp_rank == 0:
            dist.send(logits.contiguous(), dst=0)
        elif world.rank == 0:
            logits = torch.empty(tokens.shape[0], tokens.shape[1] - 1, mcfg.vocab_size, device=world.device)
            dist.recv(logits, src=ctx.last_stage_rank)
    if world.rank != 0:
        return None
    loss = result[0].item() / result[1].item()
    return EvalResult(loss=loss, perplexity=math.exp(loss), tokens=int(result[1].item())), logits
