"""nanotron_recover.optim.lr_at: warm-up, then cosine, linear or no decay down to min_decay_lr; and
where the schedule counts from when a run resumes (checkpoints.load_lr_scheduler)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nanotron_recover.checkpoint import lr_schedule_origin_at_start, resumed_lr_schedule_origin
from nanotron_recover.config import ConfigError, LRSchedulerArgs, dump_config, load_config
from nanotron_recover.logging import read_metrics
from nanotron_recover.optim import lr_at
from tests.helpers.mpirun_utils import REPO, check, run_cli
from tests.helpers.nanotron_example import NANOTRON

TINY = REPO / "configs" / "tiny_cpu.yaml"

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
    cfg = load_config(NANOTRON)
    args, steps = cfg.optimizer.learning_rate_scheduler, cfg.tokens.train_steps
    values = [lr_at(k, args, steps) for k in range(steps)]
    assert values[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3], rel=1e-15)
    assert values[3] == 1e-3  # the 12-step cosine starts after the 3 warm-up steps
    assert values[3 + 6] == pytest.approx((1e-3 + 1e-4) / 2, rel=1e-12)
    # 16 steps: k = 0..15; the cosine from k = 3 ends exactly at the last step.
    assert values[-1] == 1e-4


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


# -- checkpoints.load_lr_scheduler: where the schedule counts from on resume -------------------------
class SavedCheckpoint:
    """What resumed_lr_schedule_origin reads of a checkpoint: its step and its meta.json."""

    def __init__(self, step: int, origin: int | None):
        self.step = step
        self.meta = {} if origin is None else {"lr_schedule_origin": origin}


@pytest.mark.parametrize(
    ("explicit", "load_lr_scheduler", "saved_origin", "origin"),
    [
        # Named checkpoint, fresh scheduler (Nanotron's load_lr_scheduler: false): restart there.
        (True, False, None, 100),
        (True, False, 40, 100),
        # Loading the scheduler continues the saved schedule, whatever restarted it before.
        (True, True, 40, 40),
        (True, True, None, 0),
        # This run's own checkpoint (an automatic resume, a relaunch): the run's schedule goes on.
        (False, False, 40, 40),
        (False, True, 40, 40),
        (False, False, None, 0),
    ],
)
def test_resumed_schedule_origin(explicit: bool, load_lr_scheduler: bool, saved_origin, origin: int):
    overrides = [f"checkpoints.load_lr_scheduler={str(load_lr_scheduler).lower()}"]
    if explicit:
        overrides.append("checkpoints.resume_checkpoint_path=/ckpt/step_100")
    cfg = load_config(TINY, overrides)
    assert resumed_lr_schedule_origin(cfg, SavedCheckpoint(100, saved_origin)) == origin


def test_the_origin_is_run_time_state_not_configuration(tmp_path):
    cfg = load_config(TINY)
    cfg.lr_schedule_origin = 7
    assert "lr_schedule_origin" not in dump_config(cfg)
    assert cfg == load_config(TINY)  # not compared either
    with pytest.raises(ConfigError, match="unknown key 'lr_schedule_origin' in section 'top level'"):
        load_config(TINY, ["lr_schedule_origin=3"])


def lrs(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in read_metrics(run_dir)}


def test_a_fresh_schedule_restarts_at_the_named_checkpoint_and_survives_a_resume(tmp_path: Path):
    """Nanotron's load_lr_scheduler: false on a real (one-rank) run: the first run saves step 2;
    a second run named on it warms up again from step 3 and is stopped after step 4; resuming its
    own checkpoint (no path named any more) continues the restarted schedule to step 6, and every
    checkpoint of the second run records where the schedule counts from."""
    common = ["parallelism.dp=1", "tokens.batch_accumulation_per_replica=1", "tokens.train_steps=6"]

    def train(run_dir: Path, *sets: str, stop: int | None = None) -> None:
        cmd = ["train", "--config", str(TINY), "--run-dir", str(run_dir)]
        cmd += ["--stop-after-step", str(stop)] if stop else []
        for s in [*common, f"checkpoints.checkpoints_path={run_dir / 'checkpoints'}", *sets]:
            cmd += ["--set", s]
        check(run_cli(cmd, timeout=180))

    first, second = tmp_path / "first", tmp_path / "second"
    train(first, stop=2)
    restart = ["checkpoints.load_lr_scheduler=false", "checkpoints.load_optimizer=false"]
    train(second, *restart, f"checkpoints.resume_checkpoint_path={first / 'checkpoints' / 'step_2'}", stop=4)
    train(second, *restart)

    cfg = load_config(TINY, common)
    args = cfg.optimizer.learning_rate_scheduler
    assert lrs(first) == {s: lr_at(s - 1, args, 6) for s in (1, 2)}
    # Steps 3..6 run the schedule from its start (warm-up again), as a fresh Nanotron scheduler does.
    assert lrs(second) == {s: lr_at(s - 3, args, 6) for s in (3, 4, 5, 6)}
    assert lr_at(0, args, 6) < lr_at(2, args, 6)  # the restart is visible: warm-up again
    for step in (4, 6):
        meta = json.loads((second / "checkpoints" / f"step_{step}" / "meta.json").read_text())
        assert meta["lr_schedule_origin"] == 2
    assert lr_schedule_origin_at_start(cfg, second / "checkpoints") == 2
    assert lr_schedule_origin_at_start(cfg, first / "checkpoints") == 0


def test_one_minus_sqrt_decay_in_numbers():
    """Nanotron's 1-sqrt: min + (lr - min) * (1 - sqrt(progress))."""
    args = sched(lr_warmup_steps=0, lr_decay_style="1-sqrt", lr_decay_steps=4)
    want = [MIN + (LR - MIN) * (1 - math.sqrt(min(k / 4, 1))) for k in range(6)]
    assert [lr_at(k, args, 100) for k in range(6)] == pytest.approx(want)
    assert lr_at(5, args, 100) == pytest.approx(MIN)


def test_min_decay_lr_defaults_to_the_learning_rate_as_in_nanotron():
    args = LRSchedulerArgs(learning_rate=LR, lr_decay_style="cosine", lr_decay_steps=4)
    assert args.min_decay_lr == LR
    assert all(lr_at(k, args, 100) == pytest.approx(LR) for k in range(8))
