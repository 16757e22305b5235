"""Pipeline schedules: all-forward-all-backward (AFAB) and one-forward-one-backward (1F1B).

Both run ``M`` micro-batches through this rank's stage and leave the summed gradients of
``loss_scale * loss(mb)`` in the parameters' gradient hooks. ``M`` is an argument of every call, not
a constant of the engine, because the fault-tolerant mode changes it from step to step.

A micro-batch is a ``[micro_batch_size, seq + 1]`` tensor of token ids that every stage can compute
for itself (it is a pure function of the micro-batch id): the first stage reads the inputs
``[:, :-1]``, the last stage the labels ``[:, 1:]``, and only hidden states and their gradients
travel between stages.

1F1B keeps at most ``pp - pp_rank`` micro-batches of activations alive on a stage (AFAB keeps all
``M``): stage ``s`` runs ``pp - s - 1`` warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...failures import Phase
from ...models.llama import LlamaStage
from ..context import ParallelContext
from .p2p import P2P


class PipelineEngine:
    def __init__(self, stage: LlamaStage, ctx: ParallelContext, micro_batch_size: int, sequence_length: int):
        self.stage, self.ctx = stage, ctx
        act_dtype = next(stage.parameters()).dtype
        self.p2p = P2P(ctx, (micro_batch_size, sequence_length, stage.cfg.hidden_size), act_dtype)
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        # Called as hook("forward"|"backward", i) before micro-batch i goes that way: the
        # fault-tolerant mode injects faults and syncs asynchronous restores there.
        self.event_hook: Callable[[str, int], None] | None = None

    # -- one micro-batch each way ------------------------------------------------------------
    def _forward(self, i: int, mb: torch.Tensor, loss_scale: float, losses: list[torch.Tensor]) -> None:
        if self.event_hook is not None:
            self.event_hook(Phase.FORWARD, i)
        if self.ctx.is_first_stage:
            x = mb[:, :-1].to(self.ctx.device)
        else:
            x = self.p2p.recv_forward().requires_grad_()
        out = self.stage(x)
        if self.ctx.is_last_stage:
            loss = self.stage.loss(out, mb[:, 1:].to(self.ctx.device))
            losses.append(loss.detach())
            out = loss * loss_scale
        else:
            self.p2p.send_forward(out)
        self._inputs[i], self._outputs[i] = x, out

    def _backward(self, i: int) -> None:
        if self.event_hook is not None:
            self.event_hook(Phase.BACKWARD, i)
        x, out = self._inputs.pop(i), self._outputs.pop(i)
        if self.ctx.is_last_stage:
            out.backward()
        else:
            torch.autograd.backward(out, self.p2p.recv_backward())
        if not self.ctx.is_first_stage:
            self.p2p.send_backward(x.grad)

    # -- schedules -------------------------------------------------------------------------
    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[torch.Tensor]:
        """Forward+backward of every micro-batch; returns the per-micro-batch losses (last stage
        only; empty elsewhere)."""
        raise NotImplementedError

    @torch.no_grad()
    def forward_only(self, microbatches: list[torch.Tensor]) -> list[torch.Tensor]:
        """Vocab-sharded logits per micro-batch on the last stage (empty elsewhere). Micro-batches are
        ``[batch, seq]`` input ids here (no labels)."""
        outputs = []
        for mb in microbatches:
            if self.ctx.is_first_stage:
                x = mb.to(self.ctx.device)
            else:
                shape = (mb.shape[0], mb.shape[1], self.stage.cfg.hidden_size)
                x = torch.empty(shape, dtype=self.p2p.dtype, device=self.ctx.device)
                torch.distributed.recv(x, src=self.ctx.prev_rank)
            out = self.stage(x)
            if self.ctx.is_last_stage:
                outputs.append(out)
            else:
                torch.distributed.send(out.contiguous(), dst=self.ctx.next_rank)
        return outputs


class AllForwardAllBackward(PipelineEngine):
    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        for i, mb in enumerate(microbatches):
            self._forward(i, mb, loss_scale, losses)
        for i in range(len(microbatches)):
            self._backward(i)
        self.p2p.wait_all()
        return losses


class OneForwardOneBackward(PipelineEngine):
    def train_batch(self, microbatches: list[torch.Tensor], loss_scale: float) -> list[torch.Tensor]:
        losses: list[torch.Tensor] = []
        m = len(microbatches)
        warmup = min(self.ctx.pp - self.ctx.pp_rank - 1, m)
        for i in range(warmup):
            self._forward(i, microbatches[i], loss_scale, losses)
        for i in range(m - warmup):
            self._forward(warmup + i, microbatches[warmup + i], loss_scale, losses)
            self._backward(i)
        for i in range(m - warmup, m):
            self._backward(i)
        self.p2p.wait_all()
        return losses


def build_engine(
    name: str, stage: LlamaStage, ctx: ParallelContext, micro_batch_size: int, sequence_length: int
) -> PipelineEngine:
    engines = {"afab": AllForwardAllBackward, "1f1b": OneForwardOneBackward}
    if name not in engines:
        raise ValueError(f"unknown pipeline engine {name!r}; choose afab or 1f1b")
    return engines[name](stage, ctx, micro_batch_size, sequence_length)
