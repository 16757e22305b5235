"""AdamW without importing torch's compiler.

torch.optim's optimizers import ``torch._dynamo`` the first time one is built or stepped: the
``_disable_dynamo`` wrappers around ``add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` import it on their first call, and ``step``'s ``_use_grad_for_differentiable``
imports it on every call. With torch 2.13 that import is 1.6 s of CPU per process, paid by every
rank of every launch, relaunch and re-join before its first step, for a compiler this project never
runs. On a busy node, every rank of a job paying it at once delays the first step by seconds.

:class:`AdamW` is ``torch.optim.AdamW`` with those wrappers bypassed. It keeps torch's
hyper-parameters, param groups and per-parameter state (``step``, ``exp_avg``, ``exp_avg_sq``),
so checkpoints, node-memory snapshots and the re-join's state transfer read and write it exactly as
before. For the plain per-parameter loop (``foreach`` and ``fused`` off, tensors on the CPU; what
:func:`~.optimizer.build_adamw` asks for everywhere but CUDA) its step is torch's
``_single_tensor_adam`` written out: the same operations in the same order, so the parameters and
moments come out bit for bit as torch's (``tests/unit/optim/test_adamw.py``). Any other case
(fused CUDA kernels, ``foreach``, amsgrad, ...) is torch's own step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_Optimizer = torch.optim.Optimizer


def _undecorated(method: Callable[..., Any]) -> Callable[..., Any]:
    """The function a ``torch._disable_dynamo`` wrapper holds (``functools.wraps`` sets
    ``__wrapped__``); the method itself when a torch version has no wrapper there."""
    return getattr(method, "__wrapped__", method)


class AdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that never imports ``torch._dynamo`` on the CPU path (module docstring)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _undecorated(_Optimizer.add_param_group)(self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _undecorated(_Optimizer.zero_grad)(self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _undecorated(_Optimizer.state_dict)(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _undecorated(_Optimizer.load_state_dict)(self, state_dict)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None or not all(_plain_loop(group) for group in self.param_groups):
            return super().step(closure)
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            # torch's own lazy state initialization: the same state tensors, dtypes and devices.
            self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
            _adamw_loop(params, grads, exp_avgs, exp_avg_sqs, steps, group)
        return None


def _plain_loop(group: dict[str, Any]) -> bool:
    """Whether torch would run this group through ``_single_tensor_adam`` with plain-number
    hyper-parameters: the case :func:`_adamw_loop` writes out."""
    return (
        not group.get("fused")
        and group.get("foreach") is False
        and not group.get("amsgrad")
        and not group.get("maximize")
        and not group.get("capturable")
        and not group.get("differentiable")
        and group.get("decoupled_weight_decay", True)
        # Plain numbers (a tensor lr or beta takes torch's other branches).
        and not any(torch.is_tensor(group[k]) for k in ("lr", "eps", "weight_decay"))
        and not any(torch.is_tensor(b) for b in group["betas"])
        and all(p.device.type == "cpu" and not torch.is_complex(p) for p in group["params"])
    )


def _adamw_loop(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    group: dict[str, Any],
) -> None:
    """torch 2.13's ``_single_tensor_adam`` for decoupled weight decay, number hyper-parameters and
    no amsgrad, maximize, capturable or differentiable: each line is its line, in its order."""
    lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    for param, grad, exp_avg, exp_avg_sq, step_t in zip(
        params, grads, exp_avgs, exp_avg_sqs, steps, strict=True
    ):
        step_t += 1
        if weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        step = step_t.item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-step_size)
