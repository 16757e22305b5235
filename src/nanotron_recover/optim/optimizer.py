"""AdamW over fp32 master weights, fed from the fp32 gradient buffer.

fp32 parameters are their own master weights. bf16/fp16 parameters get an fp32 master copy; after
each step the master is rounded back into the model. Optimizer state lives only next to the master
weights, keyed by parameter name, which is what checkpoints save and reshard.

Gradient clipping is global over the model: squared norms are summed over the replica's
tensor- and pipeline-parallel ranks, counting a tp-replicated parameter (norm weights) once and a
tied output head copy once.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ..config import OptimizerArgs
from ..parallel.sharding import ParamSpec
from .adamw import AdamW
from .grad_buffer import GradBuffer


def build_adamw(params: list[torch.Tensor], args: OptimizerArgs) -> torch.optim.AdamW:
    """AdamW with the config's betas, eps and weight decay over fp32 master ``params`` (both engines):
    torch's, without its compiler's import (:mod:`.adamw`)."""
    f = args.optimizer_factory
    fused = f.torch_adam_is_fused and all(p.is_cuda for p in params)
    return AdamW(
        params,
        lr=args.learning_rate_scheduler.learning_rate,
        betas=(f.adam_beta1, f.adam_beta2),
        eps=f.adam_eps,
        weight_decay=args.weight_decay,
        # Fused kernels exist for CUDA tensors only; elsewhere the plain per-parameter loop.
        foreach=False if not fused else None,
        fused=fused,
    )


class MasterOptimizer:
    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        grads: GradBuffer,
        args: OptimizerArgs,
    ):
        self.params = dict(named_params)
        self.grads = grads
        self.master: dict[str, torch.Tensor] = {}
        for name, p in named_params:
            # fp32 parameters are their own master: the model is updated in place.
            self.master[name] = p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_()
        self.torch_opt = build_adamw(list(self.master.values()), args)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.torch_opt.param_groups:
            group["lr"] = lr
        for name, m in self.master.items():
            m.grad = self.grads.views[name]
        self.torch_opt.step()
        for name, m in self.master.items():
            m.grad = None
            p = self.params[name]
            if p is not m:
                p.copy_(m)

    # -- checkpointing: state keyed by parameter name -----------------------------------------
    def state_tensors(self) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {"exp_avg", "exp_avg_sq", "master" (non-fp32 models)}} for this rank's shards."""
        out = {}
        for name, m in self.master.items():
            st = self.torch_opt.state.get(m, {})
            entry = {k: v for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")}
            if m is not self.params[name]:
                entry["master"] = m.detach()
            out[name] = entry
        return out

    def step_count(self) -> int:
        for st in self.torch_opt.state.values():
            return int(st["step"])
        return 0

    @torch.no_grad()
    def load_state_tensors(self, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        for name, m in self.master.items():
            entry = state.get(name, {})
            if "master" in entry and m is not self.params[name]:
                m.copy_(entry["master"])
            if "exp_avg" in entry:
                self.torch_opt.state[m] = {
                    "step": torch.tensor(float(step)),
                    "exp_avg": entry["exp_avg"].to(m.device, torch.float32).clone(),
                    "exp_avg_sq": entry["exp_avg_sq"].to(m.device, torch.float32).clone(),
                }


@torch.no_grad()
def clip_grad_norm_(
    grads: GradBuffer,
    specs: dict[str, ParamSpec],
    max_norm: float | None,
    tp_rank: int,
    mp_group: dist.ProcessGroup | None,
) -> float:
    """Global L2 norm of the gradients of the whole model; scales the buffer if above ``max_norm``."""
    local = torch.zeros((), dtype=torch.float32, device=grads.flat.device)
    for name, view in grads.views.items():
        spec = specs[name]
        if spec.is_tied_copy or (spec.tp_replicated and tp_rank != 0):
            continue
        local += view.pow(2).sum()
    if mp_group is not None and dist.get_world_size(mp_group) > 1:
        dist.all_reduce(local, group=mp_group)
    norm = math.sqrt(local.item())
    if max_norm is not None and max_norm > 0 and norm > max_norm:
        grads.flat.mul_(max_norm / (norm + 1e-6))
    return norm
