"""Cross-entropy over logits split by vocabulary across the tensor-parallel group.

No rank ever holds a full ``[tokens, vocab]`` row. Per token, three all-reduces give the global
quantities: the max logit (for a stable softmax), the sum of exponentials, and the target's logit
(owned by exactly one rank). Loss = log(sum exp(z - max)) - (z_target - max). Backward is local:
softmax minus the one-hot of the target, restricted to this rank's vocabulary slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None):
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        vocab_local = logits.shape[-1]
        rank = 0 if group is None else dist.get_rank(group)
        start = rank * vocab_local

        max_logit = logits.max(dim=-1).values
        if group is not None:
            dist.all_reduce(max_logit, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - max_logit.unsqueeze(-1)

        in_range = (target >= start) & (target < start + vocab_local)
        local_target = (target - start).masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~in_range, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if group is not None:
            # One collective for both: stack them so the two reductions cost one latency.
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]

        loss = sum_exp.log() - target_logit
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local_target, in_range)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_target, in_range = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -in_range.unsqueeze(-1).to(grad.dtype))
        return (grad * grad_loss.unsqueeze(-1)).to(ctx.input_dtype), None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Per-token loss (fp32, shape of ``target``) for ``logits`` holding this rank's vocab slice."""
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    return _VocabParallelCrossEntropy.apply(logits, target, group)
