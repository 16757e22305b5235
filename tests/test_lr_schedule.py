"""nanotron_recover.optim.lr_at: warm-up, then cosine, linear or no decay down to min_decay_lr."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nanotron_example import NANOTRON, NANOTRON_FIXES

from nanotron_recover.config import LRSchedulerArgs, load_config
from nanotron_recover.optim import lr_at

LR, MIN = 1e-3, 1e-5


def sched(**kw) -> LRSchedulerArgs:
    kw.setdefault("learning_rate", LR)
    kw.setdefault("min_decay_lr", MIN)
    return LRSchedulerArgs(**kw)


# -- warm-up ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("warmup", [1, 3, 4, 10])
def test_linear_warmup_ramps_to_the_peak(warmup: int):
    args = sched(lr_warmup_steps=warmup, lr_warmup_style="linear", lr_decay_style="cosine", lr_decay_steps=20)
    values = [lr_at(k, args, 100) for k in range(warmup)]
    assert values == pytest.approx([(k + 1) / warmup * LR for k in range(warmup)], rel=1e-15)
    assert values[-1] == LR
    assert all(a < b for a, b in zip(values, values[1:], strict=False))


def test_linear_warmup_of_four_steps_in_numbers():
    args = sched(lr_warmup_steps=4, lr_decay_style="constant")
    assert [lr_at(k, args, 10) for k in range(5)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3], rel=1e-15
    )


def test_constant_warmup_holds_the_peak():
    args = sched(lr_warmup_steps=3, lr_warmup_style="constant", lr_decay_style="linear", lr_decay_steps=10)
    assert [lr_at(k, args, 20) for k in range(3)] == [LR, LR, LR]


def test_no_warmup_starts_decaying_from_the_peak():
    args = sched(lr_warmup_steps=0, lr_decay_style="linear", lr_decay_steps=4)
    assert [lr_at(k, args, 10) for k in range(6)] == pytest.approx(
        [LR, MIN + (LR - MIN) * 0.75, (LR + MIN) / 2, MIN + (LR - MIN) * 0.25, MIN, MIN], rel=1e-12
    )


# -- decay ------------------------------------------------------------------------------------------
def test_cosine_reaches_min_at_the_end_of_decay_and_stays():
    args = sched(lr_warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=10)
    assert lr_at(2, args, 100) == LR  # decay starts after warm-up, at progress 0
    assert lr_at(2 + 10, args, 100) == MIN
    assert [lr_at(k, args, 100) for k in (13, 20, 99, 1000)] == [MIN] * 4
    decay = [lr_at(k, args, 100) for k in range(2, 13)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))


def test_cosine_values_follow_half_a_cosine():
    args = sched(lr_warmup_steps=2, lr_decay_style="cosine", lr_decay_steps=8)
    assert lr_at(2 + 4, args, 100) == pytest.approx((LR + MIN) / 2, rel=1e-12)
    assert lr_at(2 + 2, args, 100) == pytest.approx(
        MIN + (LR - MIN) * (1 + math.cos(math.pi / 4)) / 2, rel=1e-12
    )
    assert lr_at(2 + 6, args, 100) == pytest.approx(
        MIN + (LR - MIN) * (1 - math.cos(math.pi / 4)) / 2, rel=1e-12
    )


def test_linear_decay_midpoint_and_end():
    args = sched(lr_warmup_steps=2, lr_decay_style="linear", lr_decay_steps=8)
    assert lr_at(2, args, 100) == LR
    assert lr_at(2 + 4, args, 100) == pytest.approx((LR + MIN) / 2, rel=1e-12)
    assert lr_at(2 + 2, args, 100) == pytest.approx(MIN + 0.75 * (LR - MIN), rel=1e-12)
    assert lr_at(2 + 8, args, 100) == MIN
    assert lr_at(2 + 50, args, 100) == MIN


def test_decay_starting_step_holds_the_peak_until_then():
    args = sched(lr_warmup_steps=2, lr_decay_starting_step=6, lr_decay_style="linear", lr_decay_steps=4)
    values = [lr_at(k, args, 20) for k in range(12)]
    assert values[:2] == pytest.approx([LR / 2, LR], rel=1e-15)
    assert values[2:7] == [LR] * 5  # k = 2..6: constant after warm-up, decay progress 0 at k = 6
    assert values[8] == pytest.approx((LR + MIN) / 2, rel=1e-12)
    assert values[10:] == [MIN, MIN]


def test_decay_steps_default_to_the_rest_of_training():
    args = sched(lr_warmup_steps=2, lr_decay_style="linear", lr_decay_steps=None)
    # train_steps 12, decay from k = 2 over 10 steps.
    assert lr_at(7, args, 12) == pytest.approx((LR + MIN) / 2, rel=1e-12)
    assert lr_at(12, args, 12) == MIN


def test_decay_steps_default_with_a_late_start_and_short_run():
    args = sched(lr_warmup_steps=0, lr_decay_starting_step=10, lr_decay_style="cosine")
    # Starting at or after the last step leaves one decay step, not zero (no division by zero).
    assert lr_at(10, args, 5) == LR
    assert lr_at(11, args, 5) == MIN


def test_constant_decay_style_keeps_the_peak():
    args = sched(lr_warmup_steps=2, lr_decay_style="constant", lr_decay_steps=5)
    assert [lr_at(k, args, 50) for k in range(2, 50, 7)] == [LR] * 7
    assert lr_at(0, args, 50) == pytest.approx(LR / 2, rel=1e-15)


def test_nanotron_example_schedule():
    cfg = load_config(NANOTRON, NANOTRON_FIXES)
    args, steps = cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps
    values = [lr_at(k, args, steps) for k in range(steps)]
    assert values[0] == pytest.approx(1.5e-4, rel=1e-12)
    assert values[1] == values[2] == 3e-4
    assert values[2 + 13 // 2] < 3e-4
    # 15 steps: k = 0..14; the 13-step cosine from k = 2 ends exactly at k = 15, just after training.
    assert values[-1] == pytest.approx(
        1e-5 + (3e-4 - 1e-5) * (1 + math.cos(math.pi * 12 / 13)) / 2, rel=1e-12
    )
    assert lr_at(15, args, steps) == 1e-5


@settings(max_examples=200, deadline=None)
@given(
    warmup=st.integers(0, 20),
    start=st.one_of(st.none(), st.integers(0, 30)),
    decay=st.one_of(st.none(), st.integers(1, 40)),
    style=st.sampled_from(["linear", "cosine", "constant"]),
    warmup_style=st.sampled_from(["linear", "constant"]),
    train_steps=st.integers(1, 60),
    k=st.integers(0, 100),
)
def test_rate_stays_between_min_and_peak(warmup, start, decay, style, warmup_style, train_steps, k):
    args = sched(
        lr_warmup_steps=warmup,
        lr_warmup_style=warmup_style,
        lr_decay_starting_step=start,
        lr_decay_steps=decay,
        lr_decay_style=style,
    )
    value = lr_at(k, args, train_steps)
    assert value <= LR
    assert value >= (LR / warmup if warmup and k < warmup else MIN)
