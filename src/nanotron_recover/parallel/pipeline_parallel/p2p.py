"""Point-to-point transfers between neighbouring pipeline stages.

Sends are non-blocking and only waited for at the end of the batch: a stage never blocks on a send,
so the 1F1B schedule (where neighbours send to each other in both directions) cannot deadlock on
gloo, whose send completes only once the peer posts the matching receive. Receives are blocking:
a stage needs the tensor it asked for before it can go on. Activations flow to ``next_rank`` and
gradients to ``prev_rank``; each direction between a pair of ranks is one ordered channel, so the
k-th receive gets the k-th send.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..context import ParallelContext


class P2P:
    def __init__(self, ctx: ParallelContext, shape: tuple[int, ...], dtype: torch.dtype):
        self.ctx, self.shape, self.dtype = ctx, shape, dtype
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _recv(self, src: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.ctx.device)
        dist.irecv(buf, src=src).wait()
        return buf

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        tensor = tensor.detach().contiguous()
        self._pending.append((dist.isend(tensor, dst=dst), tensor))  # keep alive until waited

    def recv_forward(self) -> torch.Tensor:
        return self._recv(self.ctx.prev_rank)

    def send_forward(self, activation: torch.Tensor) -> None:
        self._send(activation, self.ctx.next_rank)

    def recv_backward(self) -> torch.Tensor:
        return self._recv(self.ctx.next_rank)

    def send_backward(self, grad: torch.Tensor) -> None:
        self._send(grad, self.ctx.prev_rank)

    def wait_all(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
