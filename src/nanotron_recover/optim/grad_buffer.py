"""FP32 gradient accumulation into one contiguous buffer.

Every micro-batch's gradient is added, in fp32, into a view of a single flat buffer as soon as
autograd has produced it (a post-accumulate-grad hook), and the parameter's own ``.grad`` is dropped.
Why one buffer: the data-parallel reduction (and, in the fault-tolerant mode, the bucketed
reduction with its snapshots) works on plain contiguous slices instead of hundreds of tensors, and
bf16 parameters still accumulate their gradients in fp32 over many micro-batches.
The layout is fixed: parameters in ``named_parameters()`` order.
"""

from __future__ import annotations

import torch
from torch import nn


class GradBuffer:
    def __init__(self, named_params: list[tuple[str, nn.Parameter]], device: torch.device):
        self.names = [n for n, _ in named_params]
        total = sum(p.numel() for _, p in named_params)
        self.flat = torch.zeros(total, dtype=torch.float32, device=device)
        self.views: dict[str, torch.Tensor] = {}
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        self._hooks = []
        for name, param in named_params:
            n = param.numel()
            view = self.flat[offset : offset + n].view_as(param)
            self.views[name], self.offsets[name] = view, (offset, offset + n)
            offset += n
            self._hooks.append(param.register_post_accumulate_grad_hook(self._make_hook(view)))

    @staticmethod
    def _make_hook(view: torch.Tensor):
        def hook(param: torch.Tensor) -> None:
            view.add_(param.grad)
            param.grad = None

        return hook

    def zero_(self) -> None:
        self.flat.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
