"""Optimizer: fp32 gradient buffer, AdamW on fp32 master weights, clipping, LR schedule."""

from .grad_buffer import GradBuffer
from .lr_schedule import lr_at
from .optimizer import MasterOptimizer, clip_grad_norm_

__all__ = ["GradBuffer", "MasterOptimizer", "clip_grad_norm_", "lr_at"]
