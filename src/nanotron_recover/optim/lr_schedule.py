"""Nanotron's learning-rate schedule: linear (or constant) warm-up, then cosine, linear, 1-sqrt or no
decay down to ``min_decay_lr``. ``lr_at(k)`` is the rate of the k-th optimizer step (0-based): a pure
function, so resuming from a checkpoint needs only the step count."""

from __future__ import annotations

import math

from ..config import LRSchedulerArgs


def lr_at(k: int, args: LRSchedulerArgs, train_steps: int) -> float:
    lr, warmup = args.learning_rate, args.lr_warmup_steps
    if warmup > 0 and k < warmup:
        return lr * (k + 1) / warmup if args.lr_warmup_style == "linear" else lr
    start = args.lr_decay_starting_step if args.lr_decay_starting_step is not None else warmup
    steps = args.lr_decay_steps if args.lr_decay_steps is not None else max(train_steps - start, 1)
    if k < start or args.lr_decay_style == "constant":
        return lr
    progress = min((k - start) / steps, 1.0)
    low = args.min_decay_lr if args.min_decay_lr is not None else lr
    if args.lr_decay_style == "cosine":
        return low + (lr - low) * 0.5 * (1 + math.cos(math.pi * progress))
    if args.lr_decay_style == "1-sqrt":
        return low + (lr - low) * (1 - math.sqrt(progress))
    return low + (lr - low) * (1 - progress)
